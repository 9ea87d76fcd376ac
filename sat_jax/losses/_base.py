"""Shared machinery of every loss: input checks, the ratio, global reductions, aggregation.

One helper for each of these, so that a new objective is a small function and not a copy:

* :func:`prepare` checks the public arguments and returns float32 arrays whose masked positions are
  zeroed, so that ``inf``/``NaN`` padding can never reach the loss or its gradient.
* :func:`psum` / :func:`pmax` / :func:`pmin` make a statistic global over the data-parallel axis.
* :func:`masked_mean` and :func:`aggregate` are the only reductions over tokens.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sat_jax import _checks

Array = jax.Array
ArrayLike = jax.typing.ArrayLike

#: Log-ratios are clamped to this magnitude before ``exp`` (SPEC: "clamped to ±20").
LOG_RATIO_CLAMP = 20.0

#: Default upper cap on the sequence log-ratio log ρ_b of the GSPO family, applied after averaging
#: the (±20-clamped) token log-ratios: the value tunix's ``gspo-token`` and verl's ``gspo`` use.
SEQ_LOG_RATIO_CAP = 10.0

#: Supported aggregation modes (SPEC, "Conventions"; docs/losses.md maps each to verl and tunix).
#: The last two are the other Dr.GRPO divisors found in the peers, offered by name.
AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "seq-mean-token-sum-norm-active",
    "seq-sum-token-sum-norm",
)


class LossOutput(NamedTuple):
    """What every objective returns.

    Attributes:
      loss: scalar float32 to minimise, ``-aggregate(surrogate)``.
      metrics: flat mapping from name to scalar float32 diagnostic. All are global over
        ``axis_name`` when one is given.
    """

    loss: Array
    metrics: Mapping[str, Array]


class Prepared(NamedTuple):
    """Validated, float32, masked-to-zero inputs of an objective (internal)."""

    logp: Array  # [B, T], differentiable, 0 where masked.
    behavior_logp: Array  # [B, T], detached, 0 where masked.
    advantages: Array  # [B, T], detached, 0 where masked.
    mask: Array  # [B, T] bool.
    weights: Array | None  # [B, T], detached, 0 where masked.


# ----------------------------------------------------------------------------------------------
# Argument checks. Errors name the argument and say what was expected.
# ----------------------------------------------------------------------------------------------


def _as_array(name: str, x: Any) -> Array:
    if x is None:
        raise ValueError(f"`{name}` is required, got None.")
    try:
        return jnp.asarray(x)
    except TypeError as e:  # e.g. a string or an object.
        raise TypeError(f"`{name}` must be an array, got {type(x).__name__}.") from e


def check_float(name: str, x: Any, shape: tuple[int, ...] | None = None, rank: int | None = None):
    """Returns ``x`` as a float32 array after checking its dtype, rank and shape."""
    x = _as_array(name, x)
    _checks.check_floating(name, x)
    if rank is not None:
        _checks.check_rank(name, x, rank)
    if shape is not None:
        _check_shape(name, x, shape)
    return x.astype(jnp.float32)


def _check_shape(name: str, x: Array, shape: tuple[int, ...]) -> None:
    _checks.check_shape(name, x, shape)


def check_mask(mask: Any, shape: tuple[int, ...], name: str = "mask") -> Array:
    """Returns a bool mask of ``shape``; accepts bool or 0/1 numeric masks."""
    mask = _as_array(name, mask)
    _check_shape(name, mask, shape)
    if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.number)):
        raise TypeError(f"`{name}` must be bool or 0/1 numeric, got {mask.dtype}.")
    return mask if mask.dtype == jnp.bool_ else mask != 0


def check_logps(name: str, logp: Any, other_name: str, other: Any) -> tuple[Array, Array]:
    """Checks a pair of ``[B, T]`` log-prob arrays of the same shape."""
    logp = check_float(name, logp, rank=2)
    other = check_float(other_name, other, shape=logp.shape)
    return logp, other


def check_hparam(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Range-checks a concrete Python/NumPy scalar; traced values (e.g. under vmap) pass through."""
    if isinstance(value, jax.core.Tracer) or value is None:
        return
    if isinstance(value, (np.ndarray, jax.Array)):
        if np.ndim(value) != 0:
            return  # A stacked hyper-parameter for vmap; checked elementwise by the caller's data.
        value = float(value)
    if not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number, got {type(value).__name__}.")
    if not np.isfinite(value):
        raise ValueError(f"`{name}` must be finite, got {value}.")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"`{name}` must be {'>' if low_open else '>='} {low}, got {value}.")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"`{name}` must be {'<' if high_open else '<='} {high}, got {value}.")


def check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"`aggregation` must be one of {AGGREGATIONS}, got {aggregation!r}.")


def prepare(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    token_weights: ArrayLike | None = None,
    aggregation: str = "token-mean",
) -> Prepared:
    """Checks the common arguments of an objective and zeroes every masked position.

    ``jnp.where`` (not multiplication) is what keeps ``inf``/``NaN`` padding out: the gradient of
    the unselected branch of a select is exactly zero, whereas ``0 * inf`` is ``NaN``.
    """
    check_aggregation(aggregation)
    logp, behavior_logp = check_logps("logp", logp, "behavior_logp", behavior_logp)
    shape = tuple(logp.shape)
    mask = check_mask(mask, shape)
    adv = check_float("advantages", advantages)
    if adv.shape == shape[:1]:
        adv = jnp.broadcast_to(adv[:, None], shape)
    elif tuple(adv.shape) != shape:
        raise ValueError(
            f"`advantages` must have shape {shape[:1]} (per sequence) or {shape} (per token), "
            f"got {tuple(adv.shape)}."
        )
    weights = None
    if token_weights is not None:
        weights = check_float("token_weights", token_weights, shape=shape)
        weights = jnp.where(mask, jax.lax.stop_gradient(weights), 0.0)
    return Prepared(
        logp=jnp.where(mask, logp, 0.0),
        behavior_logp=jnp.where(mask, jax.lax.stop_gradient(behavior_logp), 0.0),
        advantages=jnp.where(mask, jax.lax.stop_gradient(adv), 0.0),
        mask=mask,
        weights=weights,
    )


# ----------------------------------------------------------------------------------------------
# Ratios.
# ----------------------------------------------------------------------------------------------


def log_ratio(logp: Array, denominator: Array) -> Array:
    """``clip(logp - denominator, -20, 20)``: the log of r in Eq. (51), safe to exponentiate."""
    return jnp.clip(logp - denominator, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def sequence_log_ratio(token_log_ratio: Array, mask: Array) -> Array:
    """Length-normalised sequence log-ratio ``log ρ_b = mean_t log r_bt`` of Eq. (20), ``[B]``.

    A sequence with no active token gets 0 (ρ = 1).
    """
    m = mask.astype(jnp.float32)
    return jnp.sum(token_log_ratio * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)


# ----------------------------------------------------------------------------------------------
# Global reductions over the data-parallel axis.
# ----------------------------------------------------------------------------------------------


def psum(x, axis_name):
    """``lax.psum`` over ``axis_name``; the identity when it is None. Works on pytrees."""
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def pmax(x, axis_name):
    return x if axis_name is None else jax.lax.pmax(x, axis_name)


def pmin(x, axis_name):
    return x if axis_name is None else jax.lax.pmin(x, axis_name)


def masked_means(values: Mapping[str, Array], mask: Array, axis_name=None) -> dict[str, Array]:
    """Global masked means of several ``[B, T]`` arrays with one collective.

    Each mean is ``Σ m·x / max(Σ m, 1)``, so an empty mask gives 0, never NaN.
    """
    m = mask.astype(jnp.float32)
    sums = {k: jnp.sum(jnp.where(mask, v, 0.0)) for k, v in values.items()}
    sums, count = psum((sums, jnp.sum(m)), axis_name)
    count = jnp.maximum(count, 1.0)
    return {k: s / count for k, s in sums.items()}


def masked_mean(x: Array, mask: Array, axis_name=None) -> Array:
    return masked_means({"x": x}, mask, axis_name)["x"]


def aggregate(
    values: ArrayLike,
    mask: ArrayLike,
    mode: str = "token-mean",
    axis_name: Any = None,
) -> Array:
    """Reduces per-token values ``[B, T]`` to a scalar, globally over ``axis_name``.

    Modes (SPEC, "Conventions"), with m the active-token mask, B the global number of rows,
    B_act the global number of rows with an active token and T the padded length:

    * ``token-mean``: ``Σ m·x / Σ m`` over the whole batch.
    * ``seq-mean-token-mean``: mean over the B_act rows of ``Σ_t m·x / Σ_t m``.
    * ``seq-mean-token-sum``: mean over the B_act rows of ``Σ_t m·x``.
    * ``seq-mean-token-sum-norm`` (Dr.GRPO, ours): ``Σ m·x / (B · T)``; empty rows count in B.
    * ``seq-mean-token-sum-norm-active``: ``Σ m·x / (B_act · T)``: tunix's
      ``sequence-mean-token-scale`` and the later verl's ``seq-mean-token-sum-norm``.
    * ``seq-sum-token-sum-norm``: ``Σ m·x / T``, no division by the number of rows: the earlier
      verl's ``seq-mean-token-sum-norm`` (its loss grows with the batch size).

    Every count (Σ m, B, B_act) is psum'd over ``axis_name``, so a sharded batch gives the
    unsharded result. Empty masks give 0. Positions where ``mask`` is off never reach the result
    or its gradient.
    """
    check_aggregation(mode)
    values = check_float("values", values, rank=2)
    mask = check_mask(mask, values.shape)
    x = jnp.where(mask, values, 0.0)
    m = mask.astype(jnp.float32)
    seq_count = jnp.sum(m, axis=1)
    n_active = jnp.sum((seq_count > 0).astype(jnp.float32))
    # (count, scale): the divisor is psum(count)·scale; a None count divides by the scale alone.
    count, scale = {
        "token-mean": (jnp.sum(seq_count), 1.0),
        "seq-mean-token-mean": (n_active, 1.0),
        "seq-mean-token-sum": (n_active, 1.0),
        "seq-mean-token-sum-norm": (jnp.float32(x.shape[0]), float(x.shape[1])),
        "seq-mean-token-sum-norm-active": (n_active, float(x.shape[1])),
        "seq-sum-token-sum-norm": (None, float(x.shape[1])),
    }[mode]

    def numerator(x, seq_count):
        if mode not in ("seq-mean-token-mean", "seq-mean-token-sum"):
            return jnp.sum(x)
        seq_sum = jnp.sum(x, axis=1)
        if mode == "seq-mean-token-mean":
            seq_sum = seq_sum / jnp.maximum(seq_count, 1.0)
        return jnp.sum(seq_sum)

    # XLA picks a reduction's summation order per fused computation, so the same values summed
    # inside two different programs can differ in the last bit. Summing inside a conditional (its
    # predicate is always true but only known at run time) gives the reduction a computation of
    # its own over a materialised array: SAT with the gate off then equals the base objective bit
    # for bit, as SPEC requires, at the cost of one extra pass over [B, T].
    num = jax.lax.cond(jnp.sum(seq_count) >= 0, numerator, numerator, x, seq_count)
    if count is None:
        return psum(num, axis_name) / scale
    num, count = psum((num, count), axis_name)
    den = jnp.maximum(count, 1.0)
    return num / (den if scale == 1.0 else den * scale)


def finish(
    surrogate: Array,
    prep: Prepared,
    metrics: dict[str, Array],
    aggregation: str,
    axis_name: Any,
) -> LossOutput:
    """Applies the detached token weights, aggregates and negates: ``loss = -agg(w·S)``."""
    if prep.weights is not None:
        surrogate = surrogate * prep.weights
    loss = -aggregate(surrogate, prep.mask, aggregation, axis_name)
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    return LossOutput(loss=loss, metrics=metrics)
