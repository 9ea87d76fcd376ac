"""Mismatch diagnostics (Eq. 52, Table 8) and the low-variance KL regulariser."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sat_jax.losses import _base


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
