"""Hugging Face checkpoints: load a Qwen3-MoE (or dense Qwen3) directory into the NNX model and save
it back in the same format.

A checkpoint directory holds ``config.json`` and either one ``model.safetensors`` or shards
``model-0000i-of-0000n.safetensors`` listed by ``model.safetensors.index.json`` (``{"metadata":
{"total_size": bytes}, "weight_map": {tensor name: shard file}}``), as written by ``transformers``'
``save_pretrained`` and published for Qwen3-30B-A3B(-Base). Everything here reads and writes local
paths only.

Name and layout map (HF tensor → ``Transformer`` parameter path; "ᵀ" marks a transpose because
``torch.nn.Linear.weight`` is [out, in] while our ``Dense.kernel`` is [in, out]):

===============================================  =============================================
``model.embed_tokens.weight`` [V, d]             ``embed_tokens`` [V, d]
``lm_head.weight`` [V, d]                        ``lm_head.kernel`` [d, V] ᵀ (absent when tied)
``model.norm.weight``                            ``norm.weight``
``model.layers.i.input_layernorm.weight``        ``layers.i.input_layernorm.weight``
``model.layers.i.post_attention_layernorm...``   ``layers.i.post_attention_layernorm.weight``
``model.layers.i.self_attn.{q,k,v,o}_proj...``   ``layers.i.self_attn.{q,k,v,o}_proj.kernel`` ᵀ
``model.layers.i.self_attn.{q,k}_norm.weight``   ``layers.i.self_attn.{q,k}_norm.weight``
``model.layers.i.mlp.gate.weight`` [E, d]        ``layers.i.mlp.gate.kernel`` [d, E] ᵀ (router)
``model.layers.i.mlp.experts.e.gate_proj...``    ``layers.i.mlp.gate_proj[e]`` [d, f] ᵀ, stacked
``model.layers.i.mlp.experts.e.up_proj...``      ``layers.i.mlp.up_proj[e]`` [d, f] ᵀ, stacked
``model.layers.i.mlp.experts.e.down_proj...``    ``layers.i.mlp.down_proj[e]`` [f, d] ᵀ, stacked
``model.layers.i.mlp.{gate,up,down}_proj...``    ``layers.i.mlp.{gate,up,down}_proj.kernel`` ᵀ
                                                 (dense blocks: ``mlp_only_layers``, Qwen3)
===============================================  =============================================

Loading streams tensor by tensor (``safetensors.safe_open``, memory-mapped): each parameter is read,
transposed / stacked, cast to ``param_dtype`` and placed on its device(s) before the next one is
read, so host memory peaks at one parameter (one layer's expert stack) rather than a second copy of
the model. Saving gathers one shard at a time.

The numerics match ``transformers``' ``Qwen3MoeForCausalLM`` / ``Qwen3ForCausalLM`` (Yang et al.
2025, "Qwen3 Technical Report"): see ``tests/hf/test_parity.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sat_jax.models.config import ModelConfig
from sat_jax.models.transformer import Transformer

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen3")
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
# Buffers some older checkpoints carry; recomputed from rope_theta, never parameters.
_IGNORED_RE = re.compile(r"\.rotary_emb\.inv_freq$")
_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_FLOAT_DTYPES = {
    "float32": jnp.dtype(jnp.float32),
    "bfloat16": jnp.dtype(jnp.bfloat16),
    "float16": jnp.dtype(jnp.float16),
}

Path_ = tuple[Any, ...]  # a parameter path in the NNX state, e.g. ("layers", 0, "mlp", "gate_proj")


def _import_safetensors():
    try:
        from safetensors import safe_open
        from safetensors.numpy import save_file
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "reading or writing Hugging Face checkpoints needs the `safetensors` package "
            "(pip install 'sat_jax[hf]')"
        ) from e
    return safe_open, save_file


def _float_dtype(name: str, value) -> np.dtype:
    if isinstance(value, str):
        value = _FLOAT_DTYPES.get(value, value)
    dt = jnp.dtype(value)
    if dt not in _FLOAT_DTYPES.values():
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {value!r}")
    return dt


# ----------------------------------------------------------------------------- configuration


def _require(hf: Mapping[str, Any], key: str, *, alias: str | None = None) -> Any:
    if key in hf and hf[key] is not None:
        return hf[key]
    if alias is not None and alias in hf and hf[alias] is not None:
        return hf[alias]
    raise ValueError(f"config.json lacks the required field {key!r}")


def _rope_theta(hf: Mapping[str, Any]) -> float:
    """rope_theta from either layout: top-level ``rope_theta`` + ``rope_scaling`` (transformers 4)
    or ``rope_parameters`` (transformers 5). Only the default (unscaled) rotary is supported."""
    theta = hf.get("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):
        rope = hf.get(key)
        if rope is None:
            continue
        if not isinstance(rope, Mapping):
            raise ValueError(f"config.json {key} must be an object, got {rope!r}")
        if "full_attention" in rope and isinstance(rope["full_attention"], Mapping):
            rope = rope["full_attention"]  # per-layer-type form; all layers are full attention
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in (None, "default"):
            raise ValueError(
                f"config.json {key} has rope_type {kind!r}; only the default rotary embedding is "
                "supported (no YaRN / linear / dynamic scaling)"
            )
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                f"config.json {key}.partial_rotary_factor={rope['partial_rotary_factor']} is not "
                "supported (rotary over the whole head only)"
            )
        theta = rope.get("rope_theta", theta)
    return 10000.0 if theta is None else float(theta)


def config_from_hf(
    hf_config: Mapping[str, Any], *, dtype=jnp.float32, **overrides: Any
) -> ModelConfig:
    """``ModelConfig`` from a Hugging Face ``config.json`` dict of a Qwen3-MoE or dense Qwen3 model.

    ``decoder_sparse_step`` and ``mlp_only_layers`` become ``mlp_only_layers`` (a block is MoE iff
    it is not listed and ``(i + 1) % decoder_sparse_step == 0``, as in transformers). A dense Qwen3
    (or a Qwen3-MoE with ``num_experts = 0``) becomes a config whose every block is in
    ``mlp_only_layers``; its MoE sizes are then unused placeholders (1 expert, top-1, width 1).

    Args:
      hf_config: the parsed ``config.json``.
      dtype: compute dtype of the returned config (parameters' dtype is chosen when loading).
      **overrides: ``ModelConfig`` fields to set after the mapping, e.g. ``remat=True`` or
        ``router_aux_loss_coef=0.0`` (the checkpoint's value is kept otherwise; the paper's R3 runs
        use 0).
    Raises:
      ValueError: naming the field, for an unsupported ``model_type`` or option (sliding-window
        attention, attention biases, scaled rotary, an activation other than SiLU) or a missing
        required field.
    """
    hf = dict(hf_config)
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r} in config.json; sat_jax loads "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"config.json hidden_act={hf['hidden_act']!r} is not supported (silu only)"
        )
    if hf.get("attention_bias", False):
        raise ValueError(
            "config.json attention_bias=true is not supported (projections have no bias)"
        )
    if hf.get("use_sliding_window", False):
        raise ValueError(
            "config.json use_sliding_window=true is not supported (the model has full attention "
            "only)"
        )
    layer_types = hf.get("layer_types") or []
    bad = sorted({t for t in layer_types if t != "full_attention"})
    if bad:
        raise ValueError(f"config.json layer_types {bad} are not supported (full_attention only)")
    rope_theta = _rope_theta(hf)

    num_layers = int(_require(hf, "num_hidden_layers"))
    hidden = int(_require(hf, "hidden_size"))
    heads = int(_require(hf, "num_attention_heads"))
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    # transformers' defaults when head_dim is absent: 128 for Qwen3Config, d / H for Qwen3-MoE.
    default_head_dim = 128 if model_type == "qwen3" else hidden // heads
    head_dim = int(hf.get("head_dim") or default_head_dim)

    num_experts = 0
    if model_type == "qwen3_moe":
        num_experts = int(_require(hf, "num_experts", alias="num_local_experts"))
    if num_experts > 0:
        step = int(hf.get("decoder_sparse_step") or 1)
        listed = {int(i) for i in (hf.get("mlp_only_layers") or [])}
        mlp_only = tuple(
            i for i in range(num_layers) if i in listed or (i + 1) % step != 0
        )
        moe = dict(
            num_experts=num_experts,
            num_experts_per_tok=int(_require(hf, "num_experts_per_tok")),
            moe_intermediate_size=int(_require(hf, "moe_intermediate_size")),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0),
        )
    else:
        mlp_only = tuple(range(num_layers))
        moe = dict(num_experts=1, num_experts_per_tok=1, moe_intermediate_size=1)
    intermediate = hf.get("intermediate_size")
    if mlp_only and not intermediate:
        raise ValueError("config.json lacks 'intermediate_size', needed by the dense blocks")
    fields = dict(
        vocab_size=int(_require(hf, "vocab_size")),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        mlp_only_layers=mlp_only,
        intermediate_size=int(intermediate or ModelConfig.intermediate_size),
        rope_theta=rope_theta,
        rms_norm_eps=float(hf.get("rms_norm_eps") or 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        shared_expert_intermediate_size=0,
        dtype=dtype,
        **moe,
    )
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)})
    if unknown:
        raise ValueError(f"overrides {unknown} are not ModelConfig fields")
    fields.update(overrides)
    return ModelConfig(**fields)


def config_to_hf(
    config: ModelConfig,
    *,
    base: Mapping[str, Any] | None = None,
    torch_dtype: str = "float32",
) -> dict[str, Any]:
    """Hugging Face ``config.json`` dict for ``config`` (inverse of ``config_from_hf``).

    ``base`` (e.g. the original checkpoint's config.json) supplies the fields sat_jax does not model
    (token ids, ``max_position_embeddings`` ...); the architecture fields are overwritten. The
    ``model_type`` is ``base``'s when given, else ``qwen3_moe`` if the config has MoE blocks and
    ``qwen3`` if it has none.
    Raises:
      ValueError: when the config has no Qwen3 equivalent (a shared expert, or MoE blocks under
        ``model_type="qwen3"``).
    """
    if config.shared_expert_intermediate_size:
        raise ValueError(
            "config.shared_expert_intermediate_size > 0 has no Qwen3 / Qwen3-MoE equivalent"
        )
    hf = dict(base or {})
    model_type = hf.get("model_type") or ("qwen3_moe" if config.num_moe_layers else "qwen3")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"base model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    if model_type == "qwen3" and config.num_moe_layers:
        raise ValueError("model_type 'qwen3' cannot hold MoE blocks; use 'qwen3_moe'")
    for stale in ("num_local_experts", "rope_scaling", "layer_types", "dtype"):
        hf.pop(stale, None)
    hf.update(
        model_type=model_type,
        architectures=[_ARCHITECTURES[model_type]],
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        hidden_act="silu",
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        rope_scaling=None,
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        torch_dtype=torch_dtype,
    )
    if "rope_parameters" in hf:  # transformers-5 layout in base: keep it consistent
        hf["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if model_type == "qwen3":
        hf["max_window_layers"] = config.num_layers
    elif config.num_moe_layers:
        hf.update(
            num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=config.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=list(config.mlp_only_layers),
            router_aux_loss_coef=config.router_aux_loss_coef,
        )
    else:
        hf.update(num_experts=0, mlp_only_layers=list(range(config.num_layers)))
    return hf


# ----------------------------------------------------------------------------- name/layout map


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One parameter: its NNX path, its HF tensor name(s) and how the layouts relate.

    kind: "copy" (same layout), "linear" (2-D transpose) or "experts" (``names[e]`` is expert e's
    [out, in] matrix; the parameter is their transposes stacked on axis 0).
    """

    path: Path_
    names: tuple[str, ...]
    kind: str


def _layout(config: ModelConfig) -> list[_Entry]:
    """Every parameter of ``Transformer(config)`` with its HF tensor names, in checkpoint order."""
    entries = [_Entry(("embed_tokens",), ("model.embed_tokens.weight",), "copy")]
    moe_ids = set(config.moe_layer_ids)
    for i in range(config.num_layers):
        hp, lp = f"model.layers.{i}.", ("layers", i)
        entries += [
            _Entry(lp + ("input_layernorm", "weight"), (hp + "input_layernorm.weight",), "copy"),
            _Entry(lp + ("post_attention_layernorm", "weight"),
                   (hp + "post_attention_layernorm.weight",), "copy"),
        ]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            entries.append(_Entry(lp + ("self_attn", proj, "kernel"),
                                  (f"{hp}self_attn.{proj}.weight",), "linear"))
        for norm in ("q_norm", "k_norm"):
            entries.append(_Entry(lp + ("self_attn", norm, "weight"),
                                  (f"{hp}self_attn.{norm}.weight",), "copy"))
        if i in moe_ids:
            entries.append(_Entry(lp + ("mlp", "gate", "kernel"), (hp + "mlp.gate.weight",),
                                  "linear"))
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names = tuple(f"{hp}mlp.experts.{e}.{proj}.weight"
                              for e in range(config.num_experts))
                entries.append(_Entry(lp + ("mlp", proj), names, "experts"))
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                entries.append(_Entry(lp + ("mlp", proj, "kernel"), (f"{hp}mlp.{proj}.weight",),
                                      "linear"))
    entries.append(_Entry(("norm", "weight"), ("model.norm.weight",), "copy"))
    if not config.tie_embeddings:
        entries.append(_Entry(("lm_head", "kernel"), ("lm_head.weight",), "linear"))
    return entries


def _hf_shape(entry: _Entry, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of each HF tensor of ``entry`` given the parameter's shape."""
    if entry.kind == "copy":
        return tuple(shape)
    if entry.kind == "linear":
        return tuple(shape[::-1])
    return (shape[2], shape[1])  # experts: [E, in, out] -> per expert [out, in]


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors (name → shape) a Hugging Face checkpoint of ``config`` holds, in order."""
    shapes = _abstract_shapes(config)
    return {
        name: _hf_shape(entry, shapes[entry.path])
        for entry in _layout(config)
        for name in entry.names
    }


def _key(k) -> Any:
    if isinstance(k, jax.tree_util.DictKey):
        return k.key
    if isinstance(k, jax.tree_util.SequenceKey):
        return k.idx
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    raise TypeError(f"unexpected key {k!r} in a parameter path")


def param_path(path) -> Path_:
    """A ``jax.tree_util`` key path into an ``nnx.State`` as a plain tuple, e.g.
    ``("layers", 0, "mlp", "gate_proj")`` (the variables' trailing ``.value`` dropped)."""
    out = tuple(_key(k) for k in path)
    return out[:-1] if out and out[-1] == "value" else out


def _abstract(config: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(params=0)))
    return nnx.split(model, nnx.Param)


def _abstract_shapes(config: ModelConfig) -> dict[Path_, tuple[int, ...]]:
    _, state = _abstract(config)
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return {param_path(p): tuple(leaf.shape) for p, leaf in leaves}


# ----------------------------------------------------------------------------- loading


def _tensor_files(path: Path) -> dict[str, str]:
    """Tensor name → shard file name, from the index if present, else the single file."""
    safe_open, _ = _import_safetensors()
    index = path / INDEX_FILE
    if index.exists():
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, Mapping):
            raise ValueError(f"{index} has no 'weight_map' object")
        missing = sorted({v for v in weight_map.values() if not (path / v).exists()})
        if missing:
            raise FileNotFoundError(f"{index} lists shard files that do not exist: {missing}")
        return dict(weight_map)
    single = path / SINGLE_FILE
    if not single.exists():
        raise FileNotFoundError(f"{path} holds neither {INDEX_FILE} nor {SINGLE_FILE}")
    with safe_open(str(single), framework="numpy") as f:
        return {name: SINGLE_FILE for name in f.keys()}


def _name_list(names, limit: int = 8) -> str:
    names = sorted(names)
    more = f" … and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _check_names(config: ModelConfig, files: Mapping[str, str], where: Path) -> None:
    expected = {n for e in _layout(config) for n in e.names}
    found = {n for n in files if not _IGNORED_RE.search(n)}
    if config.tie_embeddings:
        found.discard("lm_head.weight")  # some tied checkpoints store the copy anyway
    missing, unexpected = expected - found, found - expected
    if missing:
        raise ValueError(
            f"checkpoint {where} is missing {len(missing)} tensor(s) the config needs: "
            f"{_name_list(missing)}"
        )
    if unexpected:
        raise ValueError(
            f"checkpoint {where} holds {len(unexpected)} unexpected tensor(s) (not part of a "
            f"{config.num_layers}-layer model with this config): {_name_list(unexpected)}"
        )


class _Reader:
    """Opens each shard once (memory-mapped) and reads tensors by name, checking their shapes."""

    def __init__(self, path: Path, files: Mapping[str, str], stack: ExitStack):
        self._safe_open, _ = _import_safetensors()
        self.path, self.files, self.stack = path, files, stack
        self.handles: dict[str, Any] = {}

    def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        file = self.files[name]
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(
                self._safe_open(str(self.path / file), framework="numpy")
            )
        handle = self.handles[file]
        got = tuple(handle.get_slice(name).get_shape())
        if got != tuple(shape):
            raise ValueError(f"tensor {name} in {file} has shape {got}, expected {tuple(shape)}")
        return handle.get_tensor(name)


def load_hf(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
    mesh_axes: tuple[str | None, str | None, str | None] = ("data", "expert", "model"),
    **overrides: Any,
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """Load a local Hugging Face Qwen3-MoE / Qwen3 checkpoint directory into the NNX model.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` or sharded files + index.
      dtype: compute dtype of the returned config / graphdef (the model casts parameters at use).
      param_dtype: dtype the parameters are stored in (float32 for training; bfloat16 halves memory
        for an engine-only copy). Conversion happens tensor by tensor.
      mesh: place each parameter directly with ``NamedSharding(mesh, spec)``, specs from
        ``sharding_rules`` (expert parallel + model parallel); None puts them on the default device.
      mesh_axes: (data, expert, model) axis names of ``mesh``, as in ``sharding_rules``.
      **overrides: ``ModelConfig`` fields to override (see ``config_from_hf``).
    Returns:
      ``(config, graphdef, params)``: ``nnx.merge(graphdef, params)`` is the model.
    Raises:
      FileNotFoundError: no config.json or no weights.
      ValueError: naming the field or tensor, for an unsupported architecture or option, missing
        or unexpected tensors, or a tensor of the wrong shape.
    """
    path = Path(path)
    cfg_file = path / CONFIG_FILE
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} has no {CONFIG_FILE}")
    with open(cfg_file) as f:
        config = config_from_hf(json.load(f), dtype=dtype, **overrides)
    pdt = _float_dtype("param_dtype", param_dtype)
    files = _tensor_files(path)
    _check_names(config, files, path)
    graphdef, abstract = _abstract(config)
    entries = {e.path: e for e in _layout(config)}
    specs = None
    if mesh is not None:
        from sat_jax.models.sharding import sharding_rules

        specs = {
            param_path(p): s
            for p, s in jax.tree_util.tree_flatten_with_path(
                sharding_rules(abstract, mesh_axes=mesh_axes, mesh=mesh)
            )[0]
        }

    with ExitStack() as stack:
        reader = _Reader(path, files, stack)

        def fill(key_path, leaf):
            p = param_path(key_path)
            entry = entries[p]
            hf_shape = _hf_shape(entry, leaf.shape)
            if entry.kind == "experts":
                host = np.empty(leaf.shape, pdt)
                for e, name in enumerate(entry.names):
                    host[e] = reader.read(name, hf_shape).T
            else:
                host = reader.read(entry.names[0], hf_shape)
                host = host.T if entry.kind == "linear" else host
                host = np.ascontiguousarray(host, dtype=pdt)
            sharding = None
            if specs is not None:
                sharding = jax.sharding.NamedSharding(mesh, specs[p])
            # The host copy is dropped when this returns: one parameter in host memory at a time.
            return jax.device_put(host, sharding)

        params = jax.tree_util.tree_map_with_path(fill, abstract)
    return config, graphdef, params


# ----------------------------------------------------------------------------- saving


def _parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB", "500MB", "20KB" (decimal units, as HF)."""
    if isinstance(size, int):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
        if not m:
            raise ValueError(f"max_shard_size must be an int or like '5GB', got {size!r}")
        units = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                 "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
        n = int(float(m.group(1)) * units[(m.group(2) or "B").upper()])
    if n <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return n


def _tensors_for_save(
    config: ModelConfig, params: nnx.State
) -> Iterator[tuple[str, tuple[int, ...], Any, str, int | None]]:
    """(name, hf shape, leaf, kind, expert index or None) per HF tensor, in checkpoint order."""
    leaves = {
        param_path(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    entries = _layout(config)
    expected = {e.path for e in entries}
    if set(leaves) != expected:
        missing, extra = expected - set(leaves), set(leaves) - expected
        raise ValueError(
            "params do not match config: "
            f"missing {_name_list(map(str, missing))}; unexpected {_name_list(map(str, extra))}"
        )
    for entry in entries:
        leaf = leaves[entry.path]
        hf_shape = _hf_shape(entry, leaf.shape)
        for e, name in enumerate(entry.names):
            yield name, hf_shape, leaf, entry.kind, (e if entry.kind == "experts" else None)


def save_hf(
    path: str | os.PathLike,
    config: ModelConfig,
    params: nnx.State,
    *,
    max_shard_size: int | str = "5GB",
    dtype=None,
    hf_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``params`` as a Hugging Face checkpoint that ``transformers`` and ``load_hf`` read.

    Writes ``config.json`` (``config_to_hf(config, base=hf_config)``) and either
    ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` shards of at most
    ``max_shard_size`` bytes each (a single larger tensor gets a shard of its own) plus
    ``model.safetensors.index.json``. Old weight files of those names in ``path`` are removed first
    so a stale index cannot shadow the new shards. Host memory peaks at one shard plus one
    parameter.

    Args:
      path: output directory (created).
      config: the model's ``ModelConfig``.
      params: its parameter ``nnx.State`` (any float dtype; sharded arrays are gathered per leaf).
      max_shard_size: bytes per shard, an int or a string such as ``"5GB"`` / ``"20KB"``.
      dtype: on-disk dtype (``"bfloat16"``, ``jnp.float32`` ...); default: each parameter's own.
      hf_config: the source checkpoint's ``config.json`` dict, to keep fields sat_jax does not model
        (token ids, ``max_position_embeddings``).
    Returns:
      ``path``.
    """
    _, save_file = _import_safetensors()
    path = Path(path)
    limit = _parse_size(max_shard_size)
    out_dtype = None if dtype is None else _float_dtype("dtype", dtype)
    tensors = list(_tensors_for_save(config, params))

    def nbytes(shape, leaf):
        return math.prod(shape) * (out_dtype or jnp.dtype(leaf.dtype)).itemsize

    shards: list[list[tuple]] = [[]]
    size = 0
    for t in tensors:
        n = nbytes(t[1], t[2])
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    total = sum(nbytes(t[1], t[2]) for t in tensors)
    disk_dtype = out_dtype or jnp.dtype(tensors[0][2].dtype)
    torch_dtype = next(k for k, v in _FLOAT_DTYPES.items() if v == disk_dtype) \
        if disk_dtype in _FLOAT_DTYPES.values() else "float32"

    path.mkdir(parents=True, exist_ok=True)
    for old in path.iterdir():
        if old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(old.name):
            old.unlink()
    with open(path / CONFIG_FILE, "w") as f:
        json.dump(config_to_hf(config, base=hf_config, torch_dtype=torch_dtype), f, indent=2,
                  sort_keys=True)

    n_shards = len(shards)
    weight_map: dict[str, str] = {}
    cached_leaf, cached_host = None, None
    for s, shard in enumerate(shards):
        file = SINGLE_FILE if n_shards == 1 else f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        arrays = {}
        for name, _, leaf, kind, expert in shard:
            if leaf is not cached_leaf:  # one parameter on host at a time (experts share a leaf)
                cached_leaf, cached_host = leaf, np.asarray(jax.device_get(leaf))
            host = cached_host if expert is None else cached_host[expert]
            if kind != "copy":
                host = host.T  # linear and expert kernels are stored [out, in]
            arrays[name] = np.ascontiguousarray(host, dtype=out_dtype or host.dtype)
            weight_map[name] = file
        save_file(arrays, str(path / file), metadata={"format": "pt"})
        del arrays
    if n_shards > 1:
        with open(path / INDEX_FILE, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return path
