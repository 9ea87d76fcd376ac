"""Saving the NNX model as a Hugging Face checkpoint, swapped in atomically (the format and name
map: ``sat_jax.models.hf``)."""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sat_jax.models import hf
from sat_jax.models.config import ModelConfig
from sat_jax.models.hf import (
    _FLOAT_DTYPES,
    _SHARD_RE,
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    _abstract_shapes,
    _checkpoint_order,
    _float_dtype,
    _hf_shape,
    _layout,
    _name_list,
)
from sat_jax.models.hf_config import config_to_hf
from sat_jax.models.sharding import param_path

__all__ = ["save_hf"]


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
) -> Path | str:
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

    Into a symlink to a directory the checkpoint replaces the link's target. Temporary siblings
    that a killed save left behind are deleted by the next save beside them.

    To a ``gs://`` URL (the ``gcs`` extra) the checkpoint is written locally and uploaded, the
    index and ``config.json`` last; an object store cannot swap directories, so a reader during
    the upload may see the old files with some new ones.

    Args:
      path: output directory (created), or a ``gs://`` URL.
      config: the model's ``ModelConfig``.
      params: its parameter ``nnx.State`` (any float dtype; sharded arrays are gathered per leaf).
      max_shard_size: bytes per shard, an int or a string such as ``"5GB"`` / ``"20KB"``.
      dtype: on-disk dtype (``"bfloat16"``, ``jnp.float32`` ...); default: each parameter's own.
      hf_config: the source checkpoint's ``config.json`` dict, to keep fields sat_jax does not model
        (token ids, ``max_position_embeddings``).
    Returns:
      ``path`` (a ``Path``; the URL string for a URL).
    """
    _, save_file = hf._import_safetensors()
    path_arg = url = path
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

    if "://" in str(url):
        # An object store has no directory to swap: the checkpoint is written locally, then
        # uploaded (weights first, the index and config.json last), and weight files of an
        # earlier save that the new one lacks are deleted after.
        with tempfile.TemporaryDirectory(prefix="sat_jax-save_hf-") as tmp:
            local = Path(tmp) / "ckpt"
            local.mkdir()
            _write_hf(
                local, None, config, hf_config, torch_dtype, shards, out_dtype, total, save_file
            )
            _upload(local, url)
        return url
    # Into a symlinked directory: its target is replaced, and the link keeps pointing at it.
    final = Path(os.path.realpath(path))
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(final)
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
    return Path(path_arg)


def _remove_abandoned(final: Path) -> None:
    """Deletes the temporary siblings (``.<name>.saving-<pid>``, ``.<name>.old-<pid>``) that a
    save killed before it could clean up left beside ``final``; a live process's are kept."""
    pattern = re.compile(rf"^\.{re.escape(final.name)}\.(?:saving|old)-(\d+)$")
    for sibling in final.parent.iterdir():
        m = pattern.match(sibling.name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(sibling, ignore_errors=True)
        except PermissionError:
            pass  # another user's live process


def _upload(local: Path, url: str) -> None:
    """Copies the checkpoint in ``local`` to the URL directory ``url`` (``gs://`` through
    ``etils.epath``, which needs the ``gcs`` extra there)."""
    from etils import epath

    dest = epath.Path(url)
    dest.mkdir(parents=True, exist_ok=True)
    names = sorted(p.name for p in local.iterdir())
    last = [n for n in (INDEX_FILE, CONFIG_FILE) if n in names]
    for name in [n for n in names if n not in last] + last:
        (dest / name).write_bytes((local / name).read_bytes())
    for old in dest.iterdir():
        stale = old.name == SINGLE_FILE or _SHARD_RE.match(old.name) or old.name == INDEX_FILE
        if stale and old.name not in names:
            old.unlink()


def _write_hf(path, final, config, hf_config, torch_dtype, shards, out_dtype, total, save_file):
    """Writes the checkpoint into the empty directory ``path``, with ``final``'s other files."""
    if final is not None and final.is_dir():
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
