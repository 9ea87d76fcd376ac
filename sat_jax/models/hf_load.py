"""Loading a Hugging Face checkpoint directory into the NNX model, each parameter straight into
its sharded layout (the format and name map: ``sat_jax.models.hf``)."""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sat_jax.models import hf
from sat_jax.models.config import ModelConfig
from sat_jax.models.hf import (
    _IGNORED_RE,
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    _Entry,
    _float_dtype,
    _hf_shape,
    _layout,
    _name_list,
)
from sat_jax.models.hf_config import config_from_hf
from sat_jax.models.sharding import param_path
from sat_jax.models.transformer import abstract_params, graphdef_for, param_shardings

__all__ = ["load_hf"]


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


def _check_no_linked_dir(path: Path, file: str, index: Path) -> None:
    """Refuses a shard ``file`` reached through a symlinked directory inside the checkpoint,
    which could lead anywhere; the shard file itself may be a link (the Hugging Face cache links
    each snapshot's files to its blobs)."""
    parts = Path(os.path.normpath(file)).parts[:-1]
    for i in range(len(parts)):
        sub = path.joinpath(*parts[: i + 1])
        if sub.is_symlink():
            raise ValueError(
                f"{index}: shard {file!r} lies under {sub}, a symlink to a directory "
                f"({os.path.realpath(sub)}); a checkpoint's subdirectories must be real"
            )


def _tensor_files(path: Path) -> dict[str, str]:
    """Tensor name → shard file name, from the index if present, else the single file."""
    safe_open, _ = hf._import_safetensors()
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
        for file in set(weight_map.values()):
            _check_no_linked_dir(path, file, index)
        missing = sorted({v for v in weight_map.values() if not (path / v).is_file()})
        if missing:
            raise FileNotFoundError(f"{index} lists shard files that do not exist: {missing}")
        return dict(weight_map)
    single = path / SINGLE_FILE
    if not single.exists():
        raise FileNotFoundError(f"{path} holds neither {INDEX_FILE} nor {SINGLE_FILE}")
    with safe_open(str(single), framework="numpy") as f:
        return {name: SINGLE_FILE for name in f.keys()}


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
        self._safe_open, _ = hf._import_safetensors()
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
