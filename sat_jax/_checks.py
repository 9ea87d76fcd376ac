"""Input checks at the library's public boundaries, shared by the losses, models and samplers.

One wording and one exception type per fault, whichever layer finds it: a wrong shape or rank is a
``ValueError``, a wrong dtype a ``TypeError``, and each message names the argument in backticks::

    `logp` must have shape (4, 8), got (4, 7).

Shape checks use chex. Value checks (token-id ranges) need concrete arrays, so they are skipped for
tracers: inside ``jax.jit`` only shapes and dtypes are checked. Depends on jax, numpy and chex only,
so the bottom of the library (``sat_jax.losses``) can import it.
"""

from __future__ import annotations

from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np


def check_shape(name: str, x: chex.Array, shape: Sequence[int | None]) -> None:
    """Raises ValueError naming ``name`` unless ``x.shape`` matches ``shape`` (None = any)."""
    try:
        chex.assert_shape(x, tuple(shape))
    except AssertionError as e:
        # chex's own message names no argument.
        raise ValueError(f"`{name}` must have shape {tuple(shape)}, got {np.shape(x)}.") from e


def check_rank(name: str, x: chex.Array, rank: int) -> None:
    """Raises ValueError naming ``name`` unless ``x`` has ``rank`` dimensions."""
    try:
        chex.assert_rank(x, rank)
    except AssertionError as e:
        raise ValueError(f"`{name}` must have rank {rank}, got shape {np.shape(x)}.") from e


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def check_floating(name: str, x: chex.Array) -> None:
    """Raises TypeError naming ``name`` unless ``x`` has a floating dtype."""
    if not jnp.issubdtype(_dtype(x), jnp.floating):  # NumPy's misses bfloat16.
        raise TypeError(f"`{name}` must have a floating dtype, got {_dtype(x)}.")


def check_integer(name: str, x: chex.Array) -> None:
    """Raises TypeError naming ``name`` unless ``x`` has an integer dtype."""
    if not jnp.issubdtype(_dtype(x), jnp.integer):
        raise TypeError(f"`{name}` must have an integer dtype, got {_dtype(x)}.")


def is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_token_ids(name: str, tokens: chex.Array, vocab_size: int, where=None) -> None:
    """Raises ValueError if a (selected) id of a concrete ``tokens`` is outside [0, vocab_size)."""
    if not is_concrete(tokens) or (where is not None and not is_concrete(where)):
        return
    t = np.asarray(tokens)
    if where is not None:
        t = t[np.asarray(where, dtype=bool)]
    if t.size and (t.min() < 0 or t.max() >= vocab_size):
        raise ValueError(
            f"`{name}` holds token ids outside [0, {vocab_size}): min {t.min()}, max {t.max()}."
        )


def first_differing_group(a, group_size: int) -> int | None:
    """The index of the first group of ``group_size`` consecutive rows (axis 0) of host array
    ``a`` whose rows are not all equal to the group's first row; None when every group's are.
    ``a.shape[0]`` must be a multiple of ``group_size``."""
    a = np.asarray(a)
    grouped = a.reshape((a.shape[0] // group_size, group_size) + a.shape[1:])
    differs = (grouped != grouped[:, :1]).reshape(grouped.shape[0], -1).any(axis=1)
    bad = np.flatnonzero(differs)
    return int(bad[0]) if bad.size else None
