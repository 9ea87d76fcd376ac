"""Hugging Face checkpoints: the format and the name/layout map shared by loading
(``sat_jax.models.hf_load``) and saving (``sat_jax.models.hf_save``) a Qwen3-MoE (or dense Qwen3)
checkpoint.

A checkpoint directory holds ``config.json`` and either one ``model.safetensors`` or shards
``model-0000i-of-0000n.safetensors`` listed by ``model.safetensors.index.json`` (``{"metadata":
{"total_size": bytes}, "weight_map": {tensor name: shard file}}``), as written by ``transformers``'
``save_pretrained`` and published for Qwen3-30B-A3B(-Base). Loading reads a local directory;
saving writes one, or a ``gs://`` URL.

Name and layout map (HF tensor → ``Transformer`` parameter path and index; "ᵀ" marks a transpose
because ``torch.nn.Linear.weight`` is [out, in] while our ``Dense.kernel`` is [in, out]). Blocks
are stacked (see ``sat_jax.models.transformer``): HF block i is row m of ``moe_layers`` when it is
the m-th MoE block (``config.moe_layer_ids[m] == i``), row j of ``dense_layers`` when it is the
j-th dense block; ``S`` below is that stack and row.

===============================================  =============================================
``model.embed_tokens.weight`` [V, d]             ``embed_tokens`` [V, d]
``lm_head.weight`` [V, d]                        ``lm_head.kernel`` [d, V] ᵀ (absent when tied)
``model.norm.weight``                            ``norm.weight``
``model.layers.i.input_layernorm.weight``        ``S.input_layernorm.weight[m]``
``model.layers.i.post_attention_layernorm...``   ``S.post_attention_layernorm.weight[m]``
``model.layers.i.self_attn.{q,k,v,o}_proj...``   ``S.self_attn.{q,k,v,o}_proj.kernel[m]`` ᵀ
``model.layers.i.self_attn.{q,k}_norm.weight``   ``S.self_attn.{q,k}_norm.weight[m]``
``model.layers.i.mlp.gate.weight`` [E, d]        ``moe_layers.mlp.gate.kernel[m]`` [d, E] ᵀ
``model.layers.i.mlp.experts.e.gate_proj...``    ``moe_layers.mlp.gate_proj[m, e]`` [d, f] ᵀ
``model.layers.i.mlp.experts.e.up_proj...``      ``moe_layers.mlp.up_proj[m, e]`` [d, f] ᵀ
``model.layers.i.mlp.experts.e.down_proj...``    ``moe_layers.mlp.down_proj[m, e]`` [f, d] ᵀ
``model.layers.i.mlp.{gate,up,down}_proj...``    ``dense_layers.mlp.{gate,up,down}_proj.kernel[j]``
                                                 ᵀ (dense blocks: ``mlp_only_layers``, Qwen3)
===============================================  =============================================

Loading places every parameter straight into its sharded layout
(``sat_jax.models.sharding``): ``jax.make_array_from_callback`` asks for each device's shard,
and the callback reads exactly that slice of the HF tensors it covers from the memory-mapped
safetensors files (``get_slice``), transposed and cast to ``param_dtype``. No device holds more
than its shard; a shard replicated on several devices is read once, so host memory peaks at the
distinct shards of one parameter (one copy of it). Saving gathers one block row of one parameter
at a time (one layer's expert stack).

The numerics match ``transformers``' ``Qwen3MoeForCausalLM`` / ``Qwen3ForCausalLM`` (Yang et al.
2025, "Qwen3 Technical Report"): see ``tests/hf/test_hf_parity.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sat_jax.models.config import ModelConfig
from sat_jax.models.hf_config import SUPPORTED_MODEL_TYPES, config_from_hf, config_to_hf
from sat_jax.models.sharding import param_path
from sat_jax.models.transformer import abstract_params

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "config_from_hf",
    "config_to_hf",
    "hf_tensor_shapes",
    "param_path",
]

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
# Buffers some older checkpoints carry; recomputed from rope_theta, never parameters.
_IGNORED_RE = re.compile(r"\.rotary_emb\.inv_freq$")
_FLOAT_DTYPES = {
    "float32": jnp.dtype(jnp.float32),
    "bfloat16": jnp.dtype(jnp.bfloat16),
    "float16": jnp.dtype(jnp.float16),
}

Path_ = tuple[Any, ...]  # a parameter path in the NNX state, e.g. ("moe_layers", "mlp", "up_proj")


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


# ----------------------------------------------------------------------------- name/layout map


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One parameter: its NNX path, its HF tensor names and how the layouts relate.

    ``lead`` are the parameter's leading index dims that enumerate HF tensors (() for an
    unstacked parameter, (L,) for a stacked block parameter, (L, E) for stacked experts);
    ``names`` lists one HF tensor per index in row-major order. Each HF tensor is the parameter
    slice ``param[index]`` as is (kind "copy") or transposed (kind "linear", 2-D).
    """

    path: Path_
    names: tuple[str, ...]
    kind: str
    lead: tuple[int, ...] = ()

    def indexed(self) -> Iterator[tuple[tuple[int, ...], str]]:
        return zip(itertools.product(*(range(n) for n in self.lead)), self.names, strict=True)


def _layout(config: ModelConfig) -> list[_Entry]:
    """Every parameter of ``Transformer(config)`` with its HF tensor names."""
    entries = [_Entry(("embed_tokens",), ("model.embed_tokens.weight",), "copy")]
    for stack, ids in (
        ("moe_layers", config.moe_layer_ids),
        ("dense_layers", config.dense_layer_ids),
    ):
        if not ids:
            continue
        n = len(ids)

        def per_layer(suffix, kind, stack=stack, ids=ids, n=n):
            return (tuple(f"model.layers.{i}.{suffix}" for i in ids), kind, (n,))

        own = [
            (("input_layernorm", "weight"), *per_layer("input_layernorm.weight", "copy")),
            (
                ("post_attention_layernorm", "weight"),
                *per_layer("post_attention_layernorm.weight", "copy"),
            ),
        ]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            own.append(
                (("self_attn", proj, "kernel"), *per_layer(f"self_attn.{proj}.weight", "linear"))
            )
        for norm in ("q_norm", "k_norm"):
            own.append(
                (("self_attn", norm, "weight"), *per_layer(f"self_attn.{norm}.weight", "copy"))
            )
        if stack == "moe_layers":
            own.append((("mlp", "gate", "kernel"), *per_layer("mlp.gate.weight", "linear")))
            e = config.num_experts
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names = tuple(
                    f"model.layers.{i}.mlp.experts.{x}.{proj}.weight" for i in ids for x in range(e)
                )
                own.append((("mlp", proj), names, "linear", (n, e)))
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                own.append((("mlp", proj, "kernel"), *per_layer(f"mlp.{proj}.weight", "linear")))
        entries += [_Entry((stack,) + sub, names, kind, lead) for sub, names, kind, lead in own]
    entries.append(_Entry(("norm", "weight"), ("model.norm.weight",), "copy"))
    if not config.tie_embeddings:
        entries.append(_Entry(("lm_head", "kernel"), ("lm_head.weight",), "linear"))
    return entries


def _hf_shape(entry: _Entry, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of each HF tensor of ``entry`` given the parameter's (stacked) shape."""
    inner = tuple(shape[len(entry.lead) :])
    return inner if entry.kind == "copy" else inner[::-1]


def hf_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors (name → shape) a Hugging Face checkpoint of ``config`` holds, in order."""
    shapes = _abstract_shapes(config)
    out = {}
    for entry in _layout(config):
        for _, name in entry.indexed():
            out[name] = _hf_shape(entry, shapes[entry.path])
    return dict(sorted(out.items(), key=lambda kv: _checkpoint_order(kv[0])))


def _checkpoint_order(name: str):
    """HF tensor order: embeddings, blocks by index, final norm, head."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        return (1, int(m.group(1)), name)
    return (0 if "embed_tokens" in name else 2 if name.startswith("model.") else 3, 0, name)


def _abstract_shapes(config: ModelConfig) -> dict[Path_, tuple[int, ...]]:
    leaves = jax.tree_util.tree_flatten_with_path(abstract_params(config))[0]
    return {param_path(p): tuple(leaf.shape) for p, leaf in leaves}


# ----------------------------------------------------------------------------- loading


#: Tensor dtypes (safetensors' names) a checkpoint's weights may have; they are cast to
#: param_dtype. Integer or bool tensors are refused: a cast would make numbers of them silently.


def _name_list(names, limit: int = 8) -> str:
    names = sorted(names)
    more = f" … and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
