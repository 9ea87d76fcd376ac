"""Mismatch diagnostics (Eq. 52, Table 8), the shape of the mismatch, and the low-variance KL
regulariser.

The mean d̄_π says how large the training–inference mismatch is; a quantile gate such as SAT's
reacts to its tail. :func:`mismatch_shape` reports that tail (exact order statistics of |log r|,
the largest per-sequence log-ratio, the effective sample size of the ratios) and
:func:`mismatch_decomposition` splits log r = log(π_θ/π_θv) + log(π_θv/μ) into its staleness and
engine parts, each with the same statistics. :func:`clip_split` classifies each token by the sign
of its advantage and the side of the trust region its ratio lies on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sat_jax.losses import _base
from sat_jax.losses.quantile import quantile

#: The percentiles of |log r| that :func:`mismatch_shape` reports: (name, level α).
PERCENTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


def _mismatch_from_log_ratio(d: jax.Array, mask: jax.Array, axis_name=None) -> dict[str, jax.Array]:
    """Diagnostics of a detached, clamped token log-ratio ``d = log π − log μ`` (internal)."""
    d = jax.lax.stop_gradient(d)
    means = _base.masked_means(
        {"mismatch": jnp.abs(d), "k1": -d, "k3": jnp.expm1(d) - d, "d": d, "d2": d * d},
        mask,
        axis_name,
    )
    var = jnp.maximum(means.pop("d2") - jnp.square(means["d"]), 0.0)
    means.pop("d")
    max_abs = _base.pmax(jnp.max(jnp.where(mask, jnp.abs(d), 0.0)), axis_name)
    return {**means, "log_ratio_var": var, "mismatch_max": max_abs}


def mismatch_metrics(
    logp: _base.ArrayLike,
    behavior_logp: _base.ArrayLike,
    mask: _base.ArrayLike,
    axis_name=None,
) -> dict[str, jax.Array]:
    """Training–inference mismatch of the sampled tokens, global over ``axis_name``.

    With d = clip(log π − log μ, ±20) on active tokens (Eq. 51, token ratio for every method):

    * ``mismatch``: d̄_π = E|d| (Eq. 52), the paper's headline mismatch figure.
    * ``k1`` = E[−d] and ``k3`` = E[e^d − 1 − d]: estimators of KL(μ‖π) from samples of μ.
    * ``log_ratio_var``: Var[d] (Table 8); ``mismatch_max``: max |d|.

    All are detached scalars; an empty mask gives zeros.

    Example:
      >>> m = mismatch_metrics(jnp.log(jnp.array([[0.5, 0.2]])), jnp.log(jnp.array([[0.5, 0.1]])),
      ...                      jnp.array([[1, 1]]))
      >>> round(float(m["mismatch"]), 4)  # (|log 1| + |log 2|) / 2
      0.3466
    """
    logp, behavior_logp = _base.check_logps("logp", logp, "behavior_logp", behavior_logp)
    mask = _base.check_mask(mask, logp.shape)
    d = _base.log_ratio(jnp.where(mask, logp, 0.0), jnp.where(mask, behavior_logp, 0.0))
    return _mismatch_from_log_ratio(d, mask, axis_name)


def _shape_from_log_ratio(
    d: jax.Array, mask: jax.Array, axis_name=None, quantile_method: str = "auto"
) -> dict[str, jax.Array]:
    """Shape statistics of a detached, clamped token log-ratio ``d`` on active tokens (internal)."""
    d = jax.lax.stop_gradient(jnp.where(mask, d, 0.0))
    a = jnp.abs(d)
    out = {
        name: quantile(a, mask, alpha, axis_name, method=quantile_method)
        for name, alpha in PERCENTILES
    }
    out["max"] = _base.pmax(jnp.max(a, initial=0.0), axis_name)
    # Σ_t log r over a response: the log of the sequence's importance weight (0 for empty rows).
    out["seq_sum_max"] = _base.pmax(jnp.max(jnp.abs(jnp.sum(d, axis=1)), initial=0.0), axis_name)
    # Kish's effective sample size of the token weights w = r, as a share of the n active tokens:
    # (Σw)² / (n·Σw²) = mean(w)² / mean(w²), in (0, 1]; 1 when every ratio is equal.
    w = jnp.exp(d)
    means = _base.masked_means({"w": w, "w2": w * w}, mask, axis_name)
    out["ess"] = jnp.where(means["w2"] > 0, jnp.square(means["w"]) / means["w2"], 0.0)
    return out


def mismatch_shape(
    logp: _base.ArrayLike,
    behavior_logp: _base.ArrayLike,
    mask: _base.ArrayLike,
    axis_name=None,
    *,
    quantile_method: str = "auto",
) -> dict[str, jax.Array]:
    """The distribution of the token mismatch over active tokens, global over ``axis_name``.

    With d = clip(log π − log μ, ±20) on the n active tokens (the token ratio, for every method):

    * ``p50``, ``p90``, ``p99``: exact lower empirical quantiles of |d|, the ⌈α·n⌉-th smallest
      value (:func:`sat_jax.losses.quantile`, the order statistic SAT's gate uses);
    * ``max``: max |d|;
    * ``seq_sum_max``: max over sequences of |Σ_t d_t|, the log of the largest (or smallest)
      sequence importance weight in the batch;
    * ``ess``: the effective sample size of the token weights w = e^d normalised by the count,
      (Σw)² / (n·Σw²) ∈ (0, 1] (Kish); 1 when all ratios are equal, about 1/n when one dominates.

    All are detached float32 scalars; an empty mask gives zeros.

    Example:
      >>> m = mismatch_shape(jnp.log(jnp.array([[2.0, 1.0]])), jnp.zeros((1, 2)),
      ...                    jnp.array([[1, 1]]))
      >>> round(float(m["ess"]), 4)  # (2 + 1)² / (2 · (4 + 1))
      0.9
    """
    logp, behavior_logp = _base.check_logps("logp", logp, "behavior_logp", behavior_logp)
    mask = _base.check_mask(mask, logp.shape)
    d = _base.log_ratio(jnp.where(mask, logp, 0.0), jnp.where(mask, behavior_logp, 0.0))
    return _shape_from_log_ratio(d, mask, axis_name, quantile_method)


def mismatch_decomposition(
    logp: _base.ArrayLike,
    old_logp: _base.ArrayLike,
    behavior_logp: _base.ArrayLike,
    mask: _base.ArrayLike,
    axis_name=None,
    *,
    quantile_method: str = "auto",
) -> dict[str, jax.Array]:
    """Splits the token log-ratio into its staleness and engine parts, with the same statistics.

        log r = log π_θ − log μ = [log π_θ − log π_θv] + [log π_θv − log μ]
                                    staleness              engine

    where π_θv (``old_logp``) is the behaviour version's policy recomputed by the trainer: the
    staleness part is what the policy moved since that version, the engine part what the rollout
    engine's numerics (dtype, routing) add at equal parameters. Each part's log-ratio is clamped
    to ±20 on its own, so the parts add up to log r exactly whenever no clamp binds.

    Returns ``staleness/<stat>`` and ``engine/<stat>`` for ``mean`` (d̄ of that part, Eq. 52),
    and every statistic of :func:`mismatch_shape`; detached, global over ``axis_name``.
    """
    logp, old_logp = _base.check_logps("logp", logp, "old_logp", old_logp)
    behavior_logp = _base.check_float("behavior_logp", behavior_logp, shape=logp.shape)
    mask = _base.check_mask(mask, logp.shape)
    logp, old_logp, behavior_logp = (
        jnp.where(mask, jax.lax.stop_gradient(x), 0.0) for x in (logp, old_logp, behavior_logp)
    )
    out = {}
    for part, d in (
        ("staleness", _base.log_ratio(logp, old_logp)),
        ("engine", _base.log_ratio(old_logp, behavior_logp)),
    ):
        out[f"{part}/mean"] = _base.masked_mean(jnp.abs(d), mask, axis_name)
        for name, value in _shape_from_log_ratio(d, mask, axis_name, quantile_method).items():
            out[f"{part}/{name}"] = value
    return out


def clip_split(ratio: jax.Array, advantages: jax.Array, lo, hi) -> dict[str, jax.Array]:
    """Per-token indicators of where a ratio lies against the trust region [lo, hi], by the sign
    of the advantage (float32 ``[B, T]``, to be averaged over active tokens by the caller).

    * ``clip/pos_high``: A > 0, r > hi: clipped (PPO's zero-gradient branch).
    * ``clip/pos_low``: A > 0, r < lo: outside, not clipped (the min keeps r·A: pull-back).
    * ``clip/neg_low``: A < 0, r < lo: clipped.
    * ``clip/neg_high``: A < 0, r > hi: outside, not clipped; bounded only by a dual clip.

    ``lo``/``hi`` broadcast to ``ratio`` (SAT's contracted edges are per token).
    """
    r = jax.lax.stop_gradient(ratio)
    pos, neg = advantages > 0, advantages < 0
    cells = {
        "clip/pos_high": pos & (r > hi),
        "clip/pos_low": pos & (r < lo),
        "clip/neg_low": neg & (r < lo),
        "clip/neg_high": neg & (r > hi),
    }
    return {k: v.astype(jnp.float32) for k, v in cells.items()}


def low_var_kl(
    logp: _base.ArrayLike,
    ref_logp: _base.ArrayLike,
    mask: _base.ArrayLike,
    *,
    clamp: float = 10.0,
    aggregation: str = "token-mean",
    axis_name=None,
) -> _base.LossOutput:
    """Low-variance (k3) KL penalty to a reference policy, as a loss to add with a coefficient.

    Per token, with x = log π_ref − log π clamped to ±``clamp`` (as verl does, for stability):

        k3 = e^x − 1 − x   ≥ 0,   an unbiased estimator of KL(π‖π_ref) under samples of π.

    The paper uses it with coefficient 1e-3 (Appendix F). ``loss`` is the aggregated k3 (to be
    *added*, times the coefficient, to a policy loss); ``metrics["kl"]`` is its token mean.

    Args:
      logp: ``[B, T]`` log-probs under the policy being trained (differentiable).
      ref_logp: ``[B, T]`` log-probs under the reference policy (detached).
      mask: ``[B, T]`` active tokens.
      clamp: bound on |x| before the exponential.
      aggregation: one of ``AGGREGATIONS``.
      axis_name: data-parallel axis for global reductions.
    """
    _base.check_aggregation(aggregation)
    _base.check_hparam("clamp", clamp, low=0.0, low_open=True)
    logp, ref_logp = _base.check_logps("logp", logp, "ref_logp", ref_logp)
    mask = _base.check_mask(mask, logp.shape)
    x = jnp.where(mask, jax.lax.stop_gradient(ref_logp), 0.0) - jnp.where(mask, logp, 0.0)
    x = jnp.clip(x, -clamp, clamp)
    k3 = jnp.expm1(x) - x
    loss = _base.aggregate(k3, mask, aggregation, axis_name)
    kl = _base.masked_mean(jax.lax.stop_gradient(k3), mask, axis_name)
    return _base.LossOutput(loss=loss, metrics={"kl": kl})
