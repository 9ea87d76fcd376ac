"""Hugging Face checkpoints: load a Qwen3-MoE (or dense Qwen3) directory into the NNX model and save
it back in the same format.

A checkpoint directory holds ``config.json`` and either one ``model.safetensors`` or shards
``model-0000i-of-0000n.safetensors`` listed by ``model.safetensors.index.json`` (``{"metadata":
{"total_size": bytes}, "weight_map": {tensor name: shard file}}``), as written by ``transformers``'
``save_pretrained`` and published for Qwen3-30B-A3B(-Base). Everything here reads and writes local
paths only.

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

import ctypes
import dataclasses
import errno
import itertools
import json
import math
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sat_jax.models.config import ModelConfig
from sat_jax.models.hf_config import SUPPORTED_MODEL_TYPES, config_from_hf, config_to_hf
from sat_jax.models.sharding import param_path
from sat_jax.models.transformer import abstract_params, graphdef_for, param_shardings

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "config_from_hf",
    "config_to_hf",
    "hf_tensor_shapes",
    "load_hf",
    "param_path",
    "save_hf",
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
_WEIGHT_DTYPES = ("F64", "F32", "F16", "BF16")


def _shard_file(index: Path, name: Any, file: Any) -> str:
    """``file`` of weight_map entry ``name`` if it is a relative path inside the checkpoint."""
    entry = f"{index}: weight_map entry {name!r}: {file!r}"
    if not isinstance(file, str) or not file:
        raise ValueError(f"{entry} is not a file name")
    # Lexical: a symlinked checkpoint (the Hugging Face cache's snapshots) stays loadable.
    parts = Path(os.path.normpath(file)).parts
    if os.path.isabs(file) or not parts or parts[0] == ".." or ".." in parts:
        raise ValueError(f"{entry} points outside the checkpoint directory {index.parent}")
    return file


def _tensor_files(path: Path) -> dict[str, str]:
    """Tensor name → shard file name, from the index if present, else the single file."""
    safe_open, _ = _import_safetensors()
    index = path / INDEX_FILE
    if index.exists():
        try:
            with open(index) as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{index} is not valid JSON ({e})") from None
        weight_map = data.get("weight_map") if isinstance(data, Mapping) else None
        if not isinstance(weight_map, Mapping):
            raise ValueError(f"{index} has no 'weight_map' object")
        weight_map = {name: _shard_file(index, name, v) for name, v in weight_map.items()}
        missing = sorted({v for v in weight_map.values() if not (path / v).is_file()})
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

    def _slice(self, name: str):
        file = self.files[name]
        if file not in self.handles:
            self.handles[file] = self.stack.enter_context(
                self._safe_open(str(self.path / file), framework="numpy")
            )
        return self.handles[file].get_slice(name)

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        sl = self._slice(name)
        got = tuple(sl.get_shape())
        if got != tuple(shape):
            raise ValueError(
                f"tensor {name} in {self.files[name]} has shape {got}, expected {tuple(shape)}"
            )
        if sl.get_dtype() not in _WEIGHT_DTYPES:
            raise ValueError(
                f"tensor {name} in {self.files[name]} has dtype {sl.get_dtype()}; weights must be "
                f"floating point ({', '.join(_WEIGHT_DTYPES)})"
            )

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The part ``index`` (slices in the file's own layout) of tensor ``name``.

        Raises:
          ValueError: naming the tensor, if the part holds a NaN or an infinity.
        """
        part = np.asarray(self._slice(name)[index])
        if not np.isfinite(part).all():
            bad = int(np.size(part) - np.count_nonzero(np.isfinite(part)))
            raise ValueError(
                f"tensor {name} in {self.files[name]} holds {bad} non-finite value(s) (NaN or "
                "inf); a checkpoint with them would train on garbage"
            )
        return part


def _concrete(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(n)) for s, n in zip(index, shape, strict=True))


def _read_shard(reader: _Reader, entry: _Entry, shape, index, dtype) -> np.ndarray:
    """The device shard ``index`` of the parameter of ``entry`` (full shape ``shape``), read
    from just the HF tensors and slices it covers."""
    index = _concrete(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape)
    nl = len(entry.lead)
    lead_ix, inner_ix = index[:nl], index[nl:]
    hf_ix = inner_ix if entry.kind == "copy" else inner_ix[::-1]
    out = np.empty(
        tuple(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True)), dtype
    )
    strides = [math.prod(entry.lead[j + 1 :]) for j in range(nl)]
    for pos in itertools.product(
        *(range(*s.indices(n)) for s, n in zip(lead_ix, entry.lead, strict=True))
    ):
        flat = sum(p * st for p, st in zip(pos, strides, strict=True))
        part = reader.read(entry.names[flat], hf_ix)
        part = part if entry.kind == "copy" else part.T
        rel = tuple(p - s.start for p, s in zip(pos, lead_ix, strict=True))
        out[rel] = part.astype(dtype, copy=False)
    return out


def load_hf(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
    **overrides: Any,
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """Load a local Hugging Face Qwen3-MoE / Qwen3 checkpoint directory into the NNX model.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` or sharded files + index.
      dtype: compute dtype of the returned config / graphdef (the model casts parameters at use).
      param_dtype: dtype the parameters are stored in (``ModelConfig.param_dtype``: float32 for
        training; bfloat16 halves memory for an engine-only copy). Conversion happens per shard.
      mesh: place each parameter directly in ``param_shardings(config, mesh)`` (the table of
        ``sat_jax.models.sharding``), each device's shard read from the files on its own; None
        puts them on the default device.
      **overrides: ``ModelConfig`` fields to override (see ``config_from_hf``).
    Returns:
      ``(config, graphdef, params)``: ``nnx.merge(graphdef, params)`` is the model.
    Raises:
      FileNotFoundError: no config.json or no weights.
      ValueError: naming the field or tensor, for an unsupported architecture or option, missing
        or unexpected tensors, a tensor of the wrong shape, a non-float dtype or with NaN / inf
        values, a malformed index or one whose entries leave the directory; naming the mesh axis
        and the dimension for a mesh that does not divide the model.
    """
    path = Path(path)
    cfg_file = path / CONFIG_FILE
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} has no {CONFIG_FILE}")
    pdt = _float_dtype("param_dtype", param_dtype)
    try:
        with open(cfg_file) as f:
            hf = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file} is not valid JSON ({e})") from None
    config = config_from_hf(hf, dtype=dtype, **{"param_dtype": pdt, **overrides})
    files = _tensor_files(path)
    _check_names(config, files, path)
    graphdef = graphdef_for(config)
    abstract = abstract_params(config)
    shardings = None
    if mesh is not None:
        shardings = {
            param_path(p): s
            for p, s in jax.tree_util.tree_flatten_with_path(param_shardings(config, mesh))[0]
        }
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    entries = {e.path: e for e in _layout(config)}

    with ExitStack() as stack:
        reader = _Reader(path, files, stack)

        def fill(key_path, leaf):
            p = param_path(key_path)
            entry = entries[p]
            shape = tuple(leaf.shape)
            hf_shape = _hf_shape(entry, shape)
            for _, name in entry.indexed():
                reader.check(name, hf_shape)
            seen: dict[tuple, np.ndarray] = {}  # replicas of one shard are read once

            def shard(index):
                key = tuple(
                    (s.start, s.stop, s.step)
                    for s in _concrete(
                        tuple(index) + (slice(None),) * (len(shape) - len(index)), shape
                    )
                )
                if key not in seen:
                    seen[key] = _read_shard(reader, entry, shape, index, pdt)
                return seen[key]

            sharding = device if shardings is None else shardings[p]
            return jax.make_array_from_callback(shape, sharding, shard)

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
        units = {
            "B": 1,
            "KB": 10**3,
            "MB": 10**6,
            "GB": 10**9,
            "TB": 10**12,
            "KIB": 2**10,
            "MIB": 2**20,
            "GIB": 2**30,
            "TIB": 2**40,
        }
        n = int(float(m.group(1)) * units[(m.group(2) or "B").upper()])
    if n <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return n


def _tensors_for_save(
    config: ModelConfig, params: nnx.State
) -> Iterator[tuple[str, tuple[int, ...], Any, str, tuple[int, ...]]]:
    """(name, hf shape, leaf, kind, index into the leaf) per HF tensor, in checkpoint order."""
    leaves = {param_path(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    entries = _layout(config)
    expected = {e.path for e in entries}
    if set(leaves) != expected:
        missing, extra = expected - set(leaves), set(leaves) - expected
        raise ValueError(
            "params do not match config: "
            f"missing {_name_list(map(str, missing))}; unexpected {_name_list(map(str, extra))}"
        )
    shapes = _abstract_shapes(config)
    wrong = [
        f"{p}: {tuple(leaf.shape)}, config needs {shapes[p]}"
        for p, leaf in leaves.items()
        if tuple(leaf.shape) != shapes[p]
    ]
    if wrong:
        raise ValueError(f"params do not match config: shapes differ at {_name_list(wrong)}")
    out = []
    for entry in entries:
        leaf = leaves[entry.path]
        hf_shape = _hf_shape(entry, leaf.shape)
        for index, name in entry.indexed():
            out.append((name, hf_shape, leaf, entry.kind, index))
    out.sort(key=lambda t: _checkpoint_order(t[0]))
    yield from out


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
    ``model.safetensors.index.json``. Host memory peaks at one shard plus one parameter.

    Into an existing directory the new checkpoint is written beside it (a sibling directory that
    also takes the directory's other files, e.g. the tokenizer's, as hard links or copies) and
    then swapped in with one atomic exchange of the two directories (``renameat2`` with
    ``RENAME_EXCHANGE``; where the file system lacks it, two renames, between which a crash
    leaves the old checkpoint whole at ``.<name>.old-<pid>``). A failure while writing (disk
    full, Ctrl-C) leaves the old checkpoint as it was; old weight files the new checkpoint does
    not have (another shard count) go with the old directory, so no stale index can shadow
    them.

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
    torch_dtype = (
        next(k for k, v in _FLOAT_DTYPES.items() if v == disk_dtype)
        if disk_dtype in _FLOAT_DTYPES.values()
        else "float32"
    )

    final = path
    path.parent.mkdir(parents=True, exist_ok=True)
    path = final.parent / f".{final.name}.saving-{os.getpid()}"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir()
    try:
        _write_hf(path, final, config, hf_config, torch_dtype, shards, out_dtype, total, save_file)
        _swap_in(path, final)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return final


def _write_hf(path, final, config, hf_config, torch_dtype, shards, out_dtype, total, save_file):
    """Writes the checkpoint into the empty directory ``path``, with ``final``'s other files."""
    if final.is_dir():
        for old in final.iterdir():
            weights = old.name in (SINGLE_FILE, INDEX_FILE, CONFIG_FILE) or _SHARD_RE.match(
                old.name
            )
            if not weights:
                _link_or_copy(old, path / old.name)
    with open(path / CONFIG_FILE, "w") as f:
        json.dump(
            config_to_hf(config, base=hf_config, torch_dtype=torch_dtype),
            f,
            indent=2,
            sort_keys=True,
        )

    n_shards = len(shards)
    weight_map: dict[str, str] = {}
    cached_key, cached_host = None, None
    for s, shard in enumerate(shards):
        file = SINGLE_FILE if n_shards == 1 else f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        arrays = {}
        for name, _, leaf, kind, index in shard:
            # One block row of one parameter on host at a time (a layer's experts share it).
            key = (id(leaf), index[:1])
            if key != cached_key:
                row = leaf[index[0]] if index else leaf
                cached_key, cached_host = key, np.asarray(jax.device_get(row))
            host = cached_host[index[1:]] if index else cached_host
            if kind != "copy":
                host = host.T  # linear and expert kernels are stored [out, in]
            arrays[name] = np.ascontiguousarray(host, dtype=out_dtype or host.dtype)
            weight_map[name] = file
        save_file(arrays, str(path / file), metadata={"format": "pt"})
        del arrays
    if n_shards > 1:
        with open(path / INDEX_FILE, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _link_or_copy(src: Path, dst: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dst, copy_function=_link_or_copy_file)
    else:
        _link_or_copy_file(src, dst)


def _link_or_copy_file(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links
        shutil.copy2(src, dst)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths (Linux ``renameat2``); False where it is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


def _swap_in(new: Path, final: Path) -> None:
    """Puts the directory ``new`` at ``final``; the old ``final``, if any, is deleted."""
    if not final.exists():
        os.rename(new, final)
        return
    if _exchange(new, final):
        shutil.rmtree(new)  # now the old checkpoint
        return
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    os.rename(final, old)
    os.rename(new, final)
    shutil.rmtree(old)
