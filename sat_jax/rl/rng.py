"""Named random streams: every key of a run is ``key(seed, stream, *indices)``.

    key(seed, "rollout", step, process)   the training rollouts of step ``step`` on ``process``
    key(seed, "eval", step)               the held-out evaluation of the parameters at ``step``
    key(seed, "stream", batch)            the stream mode's ``batch``-th rollout batch

``"rollout"`` is the root stream ``fold_in(fold_in(key(seed), step), process)`` (the derivation
runs have always used, so a checkpoint resumes into the same samples). Every other name is first
folded in as a 31-bit hash of the name plus 2³¹, a value no step count (int32) reaches, so named
streams never meet the rollout stream or each other's indices. Because the evaluation key depends
only on (seed, step), ``sat-jax eval`` of a checkpoint samples exactly as the in-training
evaluation of that step did.
"""

from __future__ import annotations

import zlib

import jax

ROOT = "rollout"
_INDEX_LIMIT = 2**31


def stream_id(name: str) -> int:
    """The 32-bit value folded in for stream ``name`` (never below 2³¹)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"stream name must be a non-empty str, got {name!r}")
    return _INDEX_LIMIT + zlib.crc32(name.encode()) % _INDEX_LIMIT


def key(seed: int, stream: str, *indices: int) -> jax.Array:
    """The PRNG key of ``stream`` at ``indices`` (each an int in [0, 2³¹)) for run ``seed``."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    k = jax.random.key(seed)
    if stream != ROOT:
        k = jax.random.fold_in(k, stream_id(stream))
    for i in indices:
        if isinstance(i, bool) or not 0 <= int(i) < _INDEX_LIMIT:
            raise ValueError(f"stream indices must be ints in [0, 2**31), got {i!r}")
        k = jax.random.fold_in(k, int(i))
    return k
