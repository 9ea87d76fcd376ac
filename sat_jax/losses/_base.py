"""Shared machinery of every loss: input checks, the ratio, global reductions, aggregation.

One helper for each of these, so that a new objective is a small function and not a copy:

* :func:`prepare` checks the public arguments and returns float32 arrays whose masked positions are
  zeroed, so that ``inf``/``NaN`` padding can never reach the loss or its gradient.
* :func:`check_mask`, :func:`check_hparam`, :func:`check_staleness`: the input rules below.

Input rules shared by every loss (the dtype rules hold under ``jit``; value rules run only on
concrete inputs, since traced values cannot be inspected):

* An empty batch (``[0, T]`` or ``[B, 0]``) is refused, naming the argument.
* ``mask`` is bool or numeric, read as ``mask != 0`` (the one rule, also under ``jit``). A
  concrete mask holding values other than 0/1 (a 0.5 meant as a weight) is refused, pointing at
  ``token_weights``, where per-token weights belong; a traced one cannot be inspected and is
  read by the rule.
* A non-finite advantage on an active token is refused when the arguments are concrete. Under
  ``jit`` such a token's surrogate is NaN, so the loss is NaN (never a finite or ``-inf``
  value that looks like progress); the other tokens' gradients are unaffected and the trainer
  step refuses the non-finite update (``optim/nonfinite``).
* Hyper-parameters are Python or NumPy real scalars; ``bool`` is refused (``alpha=True`` is a
  mistake, not 1.0).
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
    bad_advantage: Array  # [B, T] bool: active tokens whose advantage is not finite.


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


def _concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


def check_mask(mask: Any, shape: tuple[int, ...], name: str = "mask") -> Array:
    """Returns a bool mask of ``shape`` from a bool or numeric 0/1 mask, read as ``mask != 0``.

    That reading is the one rule, also under ``jit``. A concrete mask holding values other than
    0/1 (a 0.5 meant as a weight) is refused, pointing at ``token_weights``.
    """
    mask = _as_array(name, mask)
    _check_shape(name, mask, shape)
    if mask.dtype == jnp.bool_:
        return mask
    if not jnp.issubdtype(mask.dtype, jnp.number):
        raise TypeError(f"`{name}` must be bool or 0/1 numeric, got {mask.dtype}.")
    if _concrete(mask):
        values = np.asarray(mask)
        bad = values[(values != 0) & (values != 1)]
        if bad.size:
            hint = " (pass per-token weights as `token_weights`)" if name == "mask" else ""
            raise ValueError(f"`{name}` must hold only 0 and 1, got {bad.flat[0]}{hint}.")
    return mask != 0


def check_nonempty(name: str, x: Array) -> None:
    """Refuses a ``[0, T]`` or ``[B, 0]`` batch, naming the argument."""
    if 0 in x.shape:
        raise ValueError(
            f"`{name}` must have at least one row and one token, got shape {tuple(x.shape)}."
        )


def check_staleness(staleness: Any, mask: Array, name: str = "staleness") -> Array:
    """Returns ``[B, T]`` int32 versions-behind, from an integer array of the mask's shape.

    Negative values on active tokens are refused when concrete and read as 0 when traced.
    """
    staleness = _as_array(name, staleness)
    _check_shape(name, staleness, tuple(mask.shape))
    if not jnp.issubdtype(staleness.dtype, jnp.integer):
        raise TypeError(
            f"`{name}` must be an integer array (versions behind), got {staleness.dtype}."
        )
    staleness = staleness.astype(jnp.int32)
    if _concrete(staleness, mask) and bool(jnp.any(mask & (staleness < 0))):
        raise ValueError(f"`{name}` must be >= 0 on active tokens, got {int(jnp.min(staleness))}.")
    return jnp.where(mask, jnp.maximum(staleness, 0), 0)


def check_logps(name: str, logp: Any, other_name: str, other: Any) -> tuple[Array, Array]:
    """Checks a pair of ``[B, T]`` log-prob arrays of the same shape."""
    logp = check_float(name, logp, rank=2)
    check_nonempty(name, logp)
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
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be a real number, got the bool {value}.")
    if isinstance(value, (np.ndarray, jax.Array)):
        if value.dtype == np.bool_:
            raise TypeError(f"`{name}` must be a real number, got a bool array.")
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
    if _concrete(adv, mask) and not bool(jnp.all(jnp.isfinite(adv) | ~mask)):
        row, tok = (int(i[0]) for i in np.nonzero(~np.isfinite(np.asarray(adv)) & np.asarray(mask)))
        raise ValueError(
            f"`advantages` must be finite on active tokens, got {float(adv[row, tok])} at "
            f"row {row}, token {tok}."
        )
    weights = None
    if token_weights is not None:
        weights = check_float("token_weights", token_weights, shape=shape)
        weights = jnp.where(mask, jax.lax.stop_gradient(weights), 0.0)
    return Prepared(
        logp=jnp.where(mask, logp, 0.0),
        behavior_logp=jnp.where(mask, jax.lax.stop_gradient(behavior_logp), 0.0),
        # A non-finite advantage is zeroed here (so no inf reaches a gradient) and flagged for
        # `finish`, which makes the loss NaN.
        advantages=jnp.where(mask & jnp.isfinite(adv), jax.lax.stop_gradient(adv), 0.0),
        mask=mask,
        weights=weights,
        bad_advantage=mask & ~jnp.isfinite(adv),
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
    check_nonempty("values", values)
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
    # Only reachable under jit (concrete inputs are refused in `prepare`): a NaN surrogate makes
    # the loss NaN on every device, so the step is refused rather than taken on a -inf loss.
    surrogate = jnp.where(prep.bad_advantage, jnp.nan, surrogate)
    loss = -aggregate(surrogate, prep.mask, aggregation, axis_name)
    metrics = {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}
    return LossOutput(loss=loss, metrics=metrics)
