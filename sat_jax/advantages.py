"""Group advantages for GRPO-style training, from rewards shaped ``[num_groups, group_size]``.

Each group holds the G samples of one prompt. Results have the rewards' shape; flatten them
(row-major) to the ``[B]`` sequence advantages the losses broadcast over the response.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def _check(rewards, min_group: int = 1) -> jax.Array:
    rewards = jnp.asarray(rewards)
    if not jnp.issubdtype(rewards.dtype, jnp.floating) and not jnp.issubdtype(
        rewards.dtype, jnp.integer
    ):
        raise TypeError(f"`rewards` must be numeric, got {rewards.dtype}.")
    if rewards.ndim != 2:
        raise ValueError(
            f"`rewards` must have shape [num_groups, group_size], got {tuple(rewards.shape)}."
        )
    if rewards.shape[1] < min_group:
        raise ValueError(
            f"`rewards` needs group_size >= {min_group} for this estimator, got {rewards.shape[1]}."
        )
    return rewards.astype(jnp.float32)


def grpo(rewards, *, eps: float = 1e-6) -> jax.Array:
    """GRPO group normalisation: (R − mean_g) / (std_g + eps), std unbiased (ddof = 1).

    A group whose rewards are all equal gets advantage 0.
    """
    r = _check(rewards, min_group=2)
    centered = r - jnp.mean(r, axis=1, keepdims=True)
    return centered / (jnp.std(r, axis=1, ddof=1, keepdims=True) + eps)


def dr_grpo(rewards) -> jax.Array:
    """Dr.GRPO (Liu et al. 2025): R − mean_g, without the std normalisation.

    A group of one sample has advantage 0 whatever its reward, so group_size 1 is refused.
    """
    r = _check(rewards, min_group=2)
    return r - jnp.mean(r, axis=1, keepdims=True)


def rloo(rewards) -> jax.Array:
    """RLOO: R_i − mean_{j≠i} R_j  =  G/(G−1) · (R_i − mean_g)."""
    r = _check(rewards, min_group=2)
    g = r.shape[1]
    return (r - jnp.mean(r, axis=1, keepdims=True)) * (g / (g - 1))


_ESTIMATORS: dict[str, Callable[..., jax.Array]] = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo}


def names() -> tuple[str, ...]:
    return tuple(sorted(_ESTIMATORS))


def get(name: str) -> Callable[..., jax.Array]:
    """The estimator registered as ``name`` ("grpo", "dr_grpo" or "rloo")."""
    if name not in _ESTIMATORS:
        raise KeyError(f"unknown advantage estimator {name!r}; known: {names()}.")
    return _ESTIMATORS[name]
