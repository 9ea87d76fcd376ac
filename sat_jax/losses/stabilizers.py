"""The field's stabilizers beside SAT: M2PO, BAPO and the age-aware clip (token and GSPO forms),
CISPO, SAPO and decoupled PPO (with A-3PO).

Each has the one signature of :mod:`sat_jax.losses.objectives`
(``NAME(logp, behavior_logp, advantages, mask, *, ..., aggregation, token_weights, axis_name)``)
and its guarantees: every aggregation, float32 compute, masked ``inf``/``NaN`` never reaching the
loss or its gradient, and every batch statistic (M2PO's selection, BAPO's bound search) global
over ``axis_name`` through scalar collectives, with no token-sized all-gather.

The GSPO forms apply the stabilizer to the quantity GSPO clips, the length-normalised sequence
ratio ρ_b (capped at ``seq_log_ratio_cap`` as in :func:`~sat_jax.losses.gspo`), broadcast to the
response's active tokens, as :func:`~sat_jax.losses.sat_gspo` does with SAT's radii: statistics
over tokens then weigh a response by its length. docs/losses.md gives each reading and the peer
setting that reproduces it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sat_jax.losses import _base
from sat_jax.losses.diagnostics import _mismatch_from_log_ratio
from sat_jax.losses.objectives import (
    _check_clip,
    _check_seq_cap,
    _clip_objective,
    _per_token,
    _policy_gradient,
    _sequence_log_ratio,
)
from sat_jax.losses.quantile import METHODS as SELECTION_METHODS
from sat_jax.losses.quantile import mean_bounded_keep

ArrayLike = _base.ArrayLike
M2PO_VARIANTS = ("paper", "trust_region")
SEQ_AGES = ("mean", "max")


# ----------------------------------------------------------------------------------------------
# M2PO.
# ----------------------------------------------------------------------------------------------


def _check_m2po(tau, variant, eps_low, eps_high, selection_method):
    _base.check_hparam("tau", tau, low=0.0, low_open=True)
    if selection_method not in SELECTION_METHODS:
        raise ValueError(
            f"`selection_method` must be one of {SELECTION_METHODS}, got {selection_method!r}."
        )
    if variant not in M2PO_VARIANTS:
        raise ValueError(f"`variant` must be one of {M2PO_VARIANTS}, got {variant!r}.")
    if (eps_low is None) != (eps_high is None):
        raise ValueError(
            f"`eps_low` and `eps_high` must both be None (no clip) or both be set, got "
            f"{eps_low!r} and {eps_high!r}."
        )
    if eps_low is not None:
        _check_clip(eps_low, eps_high)


def _m2po(
    prep, clip_lr, *, tau, variant, eps_low, eps_high, selection_method, aggregation, axis_name
):
    """M2PO's mask on the log of the clipped quantity ``clip_lr`` (token or broadcast sequence)."""
    mask, adv = prep.mask, prep.advantages
    d = jax.lax.stop_gradient(clip_lr)
    m2 = jnp.square(d)
    # The authors' code considers only moves away from 1 in the advantage's direction.
    candidates = mask if variant == "paper" else mask & (adv * d > 0)
    keep = mean_bounded_keep(m2, mask, candidates, float(tau), axis_name, method=selection_method)
    sums = _base.psum(
        tuple(jnp.sum(jnp.where(m, v, 0.0)) for m, v in ((mask, m2), (keep, m2), (keep, 1.0))),
        axis_name,
    )
    m2_all, m2_kept, n_kept = sums
    n = _base.psum(jnp.sum(mask.astype(jnp.float32)), axis_name)
    extra = {
        "m2po/m2_before": m2_all / jnp.maximum(n, 1.0),
        "m2po/m2_after": m2_kept / jnp.maximum(n_kept, 1.0),
    }
    dropped = {"m2po/masked_frac": (mask & ~keep).astype(jnp.float32)}
    if eps_low is not None:
        out = _clip_objective(
            prep,
            clip_lr,
            eps_low=eps_low,
            eps_high=eps_high,
            dual_clip=None,
            aggregation=aggregation,
            axis_name=axis_name,
            keep=keep,
            extra_metrics=dropped,
        )
        return out._replace(metrics={**out.metrics, **extra})
    ratio = jnp.exp(clip_lr)
    surrogate = jnp.where(keep, ratio * adv, 0.0)
    token_lr = _base.log_ratio(prep.logp, prep.behavior_logp)
    metrics = _mismatch_from_log_ratio(token_lr, mask, axis_name)
    metrics.update(extra)
    metrics.update(_base.masked_means({"ratio_mean": jnp.exp(d), **dropped}, mask, axis_name))
    return _base.finish(surrogate, prep, metrics, aggregation, axis_name)


def m2po(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    tau: float = 0.04,
    variant: str = "paper",
    selection_method: str = "auto",
    aggregation: str = "token-mean",
    token_weights: ArrayLike | None = None,
    axis_name=None,
) -> _base.LossOutput:
    """M2PO: mask the tokens of largest (log r)² until the batch's second moment is ≤ τ.

    Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale
    Data on LLMs?", https://arxiv.org/abs/2510.01161 (Alg. 1)::

        M2_t = (sg log r_t)²,   keep = the tokens left after dropping the largest M2 one by
        one until mean(M2 over the kept) ≤ τ;   S = keep · r · A   (no clip)

    The mean is over every active token of the global batch (under ``axis_name``), the drop an
    exact threshold on M2 (``quantile.mean_bounded_keep``: tokens tied at the threshold are
    kept or dropped together). Dropped tokens stay in the aggregation's count. AReaL's
    ``m2_threshold`` differs (per micro-batch, mean < τ, the kept tokens as the count):
    docs/losses.md.

    Args:
      tau: τ > 0 (the paper's 0.04 throughout).
      variant: ``"paper"`` (any token may be dropped) or ``"trust_region"`` (only the tokens
        moving away from 1 in the advantage's direction, A > 0 with r > 1 or A < 0 with r < 1,
        may be dropped, as in the authors' verl code; the moment is still over all tokens).
      selection_method: ``"auto"``, ``"radix"`` or ``"bisect"``: how the exact threshold is
        found (``quantile.mean_bounded_keep``; ``"auto"``: bisection on TPU, radix elsewhere).

    Metrics: mismatch metrics, ``ratio_mean``, ``m2po/masked_frac`` (share of active tokens
    dropped), ``m2po/m2_before`` and ``m2po/m2_after`` (the second moment over all active and
    over the kept tokens; ``m2_after`` ≤ τ unless the ``trust_region`` variant runs out of
    candidates).

    Example:
      >>> lp = jnp.log(jnp.array([[1.0, 1.1, 3.0]]))   # (log r)² = 0, 0.0091, 1.2069
      >>> out = m2po(lp, jnp.zeros((1, 3)), jnp.array([1.0]), jnp.ones((1, 3), bool))
      >>> round(float(out.metrics["m2po/masked_frac"]), 4)   # the r = 3 token is dropped
      0.3333
      >>> round(float(out.loss), 4)   # −(1.0 + 1.1 + 0) / 3
      -0.7
    """
    _check_m2po(tau, variant, None, None, selection_method)
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    return _m2po(
        prep,
        _base.log_ratio(prep.logp, prep.behavior_logp),
        tau=tau,
        variant=variant,
        eps_low=None,
        eps_high=None,
        selection_method=selection_method,
        aggregation=aggregation,
        axis_name=axis_name,
    )


def m2po_gspo(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    tau: float = 0.04,
    variant: str = "paper",
    eps_low: float | None = 0.2,
    eps_high: float | None = 0.2,
    seq_log_ratio_cap: float | None = _base.SEQ_LOG_RATIO_CAP,
    selection_method: str = "auto",
    aggregation: str = "token-mean",
    token_weights: ArrayLike | None = None,
    axis_name=None,
) -> _base.LossOutput:
    """M2PO's mask on the GSPO sequence ratio (https://arxiv.org/abs/2510.01161 on GSPO's base).

        M2_b = (sg log ρ_b)²,  counted once per active token (long responses weigh more), the
        largest dropped (whole responses) until the token mean of M2 is ≤ τ;
        S_bt = keep_b · min(ρ_b·A, clip(ρ_b, 1 − ε_low, 1 + ε_high)·A)

    ε defaults to 0.2/0.2, :func:`~sat_jax.losses.sat_gspo`'s, so the two differ only in the
    stabilizer; ``eps_low=eps_high=None`` drops the clip (S = keep_b·ρ_b·A). Other arguments and
    metrics as :func:`m2po`; ``seq_log_ratio_cap`` as :func:`~sat_jax.losses.gspo`.

    Example:
      >>> lp = jnp.log(jnp.array([[1.0, 1.0], [3.0, 3.0]]))
      >>> out = m2po_gspo(lp, jnp.zeros((2, 2)), jnp.array([1.0, 1.0]), jnp.ones((2, 2), bool))
      >>> float(out.metrics["m2po/masked_frac"])   # the second response (ρ = 3) is dropped
      0.5
    """
    _check_m2po(tau, variant, eps_low, eps_high, selection_method)
    _check_seq_cap(seq_log_ratio_cap)
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    return _m2po(
        prep,
        _sequence_log_ratio(prep, seq_log_ratio_cap),
        tau=tau,
        variant=variant,
        eps_low=eps_low,
        eps_high=eps_high,
        selection_method=selection_method,
        aggregation=aggregation,
        axis_name=axis_name,
    )


# ----------------------------------------------------------------------------------------------
# BAPO.
# ----------------------------------------------------------------------------------------------


def _check_bapo(rho_target, low_range, high_range, step_high, step_low, dual_clip):
    _base.check_hparam("rho_target", rho_target, low=0.0, high=1.0)
    for name, rng, lo in (("low_range", low_range, 0.0), ("high_range", high_range, 1.0)):
        if not isinstance(rng, (tuple, list)) or len(rng) != 2:
            raise TypeError(f"`{name}` must be a pair (start, max), got {rng!r}.")
        _base.check_hparam(f"{name}[0]", rng[0], low=lo, low_open=True)
        _base.check_hparam(f"{name}[1]", rng[1], low=float(rng[0]))
    if float(low_range[1]) >= 1.0:
        raise ValueError(f"`low_range` must stay below 1, got {tuple(low_range)}.")
    _base.check_hparam("step_high", step_high, low=0.0, low_open=True)
    _base.check_hparam("step_low", step_low, low=0.0, low_open=True)
    if dual_clip is not None:
        _base.check_hparam("dual_clip", dual_clip, low=1.0, low_open=True)


def _steps(start, stop, step) -> int:
    """How many steps of ``step`` fit from ``start`` to ``stop`` (the bound stays ≤ ``stop``)."""
    return int((float(stop) - float(start)) / float(step) + 1e-6)


def _bapo_bounds(
    ratio, adv, mask, rho_target, low_range, high_range, step_high, step_low, axis_name
):
    """BAPO's per-batch bound search (Alg. 1): raise c_high, then c_low, until ρ ≥ ρ₀.

    ρ(c_low, c_high) = P / (P + N), the positive-advantage share of the gradient-carrying
    contributions |r·A|: P over A > 0 with r ≤ c_high, N over A < 0 with r ≥ c_low (the tokens
    the clip leaves a gradient). Both moves only raise ρ. Returns (c_low, c_high, ρ, steps).
    """
    r = jax.lax.stop_gradient(ratio)
    contrib = jnp.where(mask, jnp.abs(r * adv), 0.0)
    pos, neg = mask & (adv > 0), mask & (adv < 0)
    n_high = _steps(high_range[0], high_range[1], step_high)
    n_low = _steps(low_range[0], low_range[1], step_low)

    def bounds(k_high, k_low):
        # From integer step counts, so that no rounding accumulates over the search.
        return (
            low_range[0] + k_low.astype(jnp.float32) * step_low,
            high_range[0] + k_high.astype(jnp.float32) * step_high,
        )

    def share(k_high, k_low):
        c_low, c_high = bounds(k_high, k_low)
        p = jnp.sum(jnp.where(pos & (r <= c_high), contrib, 0.0))
        n = jnp.sum(jnp.where(neg & (r >= c_low), contrib, 0.0))
        p, n = _base.psum((p, n), axis_name)
        return jnp.where(p + n > 0, p / jnp.maximum(p + n, 1e-30), 1.0)

    def cond(state):
        k_high, k_low, rho = state
        return (rho < rho_target) & ((k_high < n_high) | (k_low < n_low))

    def body(state):
        k_high, k_low, _ = state
        up = k_high < n_high
        k_high, k_low = jnp.where(up, k_high + 1, k_high), jnp.where(up, k_low, k_low + 1)
        return k_high, k_low, share(k_high, k_low)

    zero = jnp.int32(0)
    k_high, k_low, rho = jax.lax.while_loop(cond, body, (zero, zero, share(zero, zero)))
    c_low, c_high = bounds(k_high, k_low)
    return c_low, c_high, rho, (k_high + k_low).astype(jnp.float32)


def _bapo(
    prep,
    clip_lr,
    *,
    rho_target,
    low_range,
    high_range,
    step_high,
    step_low,
    dual_clip,
    aggregation,
    axis_name,
):
    ratio = jnp.exp(jax.lax.stop_gradient(clip_lr))
    c_low, c_high, rho, steps = _bapo_bounds(
        ratio,
        prep.advantages,
        prep.mask,
        float(rho_target),
        tuple(map(float, low_range)),
        tuple(map(float, high_range)),
        float(step_high),
        float(step_low),
        axis_name,
    )
    out = _clip_objective(
        prep,
        clip_lr,
        eps_low=1.0 - c_low,
        eps_high=c_high - 1.0,
        dual_clip=dual_clip,
        aggregation=aggregation,
        axis_name=axis_name,
    )
    bapo = {"bapo/c_low": c_low, "bapo/c_high": c_high, "bapo/rho": rho, "bapo/steps": steps}
    return out._replace(metrics={**out.metrics, **bapo})


def bapo(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    rho_target: float = 0.4,
    low_range: tuple[float, float] = (0.6, 0.9),
    high_range: tuple[float, float] = (1.2, 3.0),
    step_high: float = 0.05,
    step_low: float = 0.02,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
    token_weights: ArrayLike | None = None,
    axis_name=None,
) -> _base.LossOutput:
    """BAPO: per-batch adaptive clip bounds that rebalance positive and negative advantages.

    Xi et al. 2025, "BAPO: Stabilizing Off-Policy Reinforcement Learning for LLMs via Balanced
    Policy Optimization with Adaptive Clipping", https://arxiv.org/abs/2510.18927 (Eq. 8,
    Alg. 1)::

        start c_low = a⁻, c_high = a⁺; while ρ < ρ₀: raise c_high by δ₁ while ≤ b⁺,
        else c_low by δ₂ while ≤ b⁻;   S = min(r·A, clip(r, c_low, c_high)·A)

    ρ is read as the positive-advantage share of the gradient-carrying contributions,
    ρ = P / (P + N), P = Σ_{A>0, r ≤ c_high} |r·A|, N = Σ_{A<0, r ≥ c_low} |r·A| (a token the
    clip stops contributes no gradient). Raising c_high lets more positive tokens through and
    raising c_low stops more negative ones, so each step raises ρ. The sums are global over
    ``axis_name`` (two scalars per step), so every device picks the same bounds.

    Args:
      rho_target: ρ₀ in [0, 1] (SPEC: 0.4; the authors' README 0.5).
      low_range: (a⁻, b⁻), the lower bound's start and maximum, in (0, 1).
      high_range: (a⁺, b⁺), the upper bound's start and maximum, > 1.
      step_high, step_low: δ₁ and δ₂.
      dual_clip: optional dual clip for A < 0, as :func:`~sat_jax.losses.ppo` (the authors'
        verl recipe applies 3).

    Metrics: those of :func:`~sat_jax.losses.ppo` plus ``bapo/c_low``, ``bapo/c_high``,
    ``bapo/rho`` (ρ at the chosen bounds) and ``bapo/steps`` (search steps taken).

    Example:
      >>> lp = jnp.log(jnp.array([[1.1, 1.0]]))
      >>> out = bapo(lp, jnp.zeros((1, 2)), jnp.array([[1.0, -1.0]]), jnp.ones((1, 2), bool))
      >>> round(float(out.metrics["bapo/rho"]), 4)   # 1.1 / (1.1 + 1.0) ≥ 0.4: no search
      0.5238
    """
    _check_bapo(rho_target, low_range, high_range, step_high, step_low, dual_clip)
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    return _bapo(
        prep,
        _base.log_ratio(prep.logp, prep.behavior_logp),
        rho_target=rho_target,
        low_range=low_range,
        high_range=high_range,
        step_high=step_high,
        step_low=step_low,
        dual_clip=dual_clip,
        aggregation=aggregation,
        axis_name=axis_name,
    )


def bapo_gspo(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    rho_target: float = 0.4,
    low_range: tuple[float, float] = (0.6, 0.9),
    high_range: tuple[float, float] = (1.2, 3.0),
    step_high: float = 0.05,
    step_low: float = 0.02,
    seq_log_ratio_cap: float | None = _base.SEQ_LOG_RATIO_CAP,
    aggregation: str = "token-mean",
    token_weights: ArrayLike | None = None,
    axis_name=None,
) -> _base.LossOutput:
    """BAPO's bounds on the GSPO sequence ratio (https://arxiv.org/abs/2510.18927 on GSPO).

    As :func:`bapo` with r replaced by the broadcast ρ_b: the contributions |ρ_b·A| are summed
    over active tokens and S_bt = min(ρ_b·A, clip(ρ_b, c_low, c_high)·A). The default ranges are
    the paper's token-level ones; sequence ratios sit much closer to 1, so a study on GSPO's
    base should set its own. ``seq_log_ratio_cap`` as :func:`~sat_jax.losses.gspo`.

    Example:
      >>> lp = jnp.log(jnp.array([[1.1, 1.1], [1.0, 1.0]]))
      >>> out = bapo_gspo(lp, jnp.zeros((2, 2)), jnp.array([1.0, -1.0]), jnp.ones((2, 2), bool))
      >>> float(out.metrics["bapo/c_high"])
      1.2000000476837158
    """
    _check_bapo(rho_target, low_range, high_range, step_high, step_low, None)
    _check_seq_cap(seq_log_ratio_cap)
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    return _bapo(
        prep,
        _sequence_log_ratio(prep, seq_log_ratio_cap),
        rho_target=rho_target,
        low_range=low_range,
        high_range=high_range,
        step_high=step_high,
        step_low=step_low,
        dual_clip=None,
        aggregation=aggregation,
        axis_name=axis_name,
    )


# ----------------------------------------------------------------------------------------------
# The age-aware clip (this project's; SPEC, "The field's stabilizers").
# ----------------------------------------------------------------------------------------------


def _check_age(kappa, staleness):
    _base.check_hparam("kappa", kappa, low=0.0)
    if staleness is None:
        raise ValueError(
            "`staleness` is required: [B, T] versions behind of each token (the trainer fills "
            "it from the batch's per-token versions)."
        )


def _age_factor(age, kappa):
    """1 / (1 + κ·max(d − 1, 0)): 1 at a lag of one version (and on-policy), smaller after."""
    return 1.0 / (1.0 + kappa * jnp.maximum(age - 1.0, 0.0))


def _age_metrics(age, factor, eps_low, eps_high, mask, axis_name):
    return _base.masked_means(
        {
            "age/staleness_mean": age,
            "age/eps_low_mean": eps_low * factor,
            "age/eps_high_mean": eps_high * factor,
        },
        mask,
        axis_name,
    )


def age_clip(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    staleness: ArrayLike | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    kappa: float = 0.5,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
    token_weights: ArrayLike | None = None,
    axis_name=None,
) -> _base.LossOutput:
    """The age-aware clip: PPO's radii shrunk by each token's exact version lag.

        ε_t = ε / (1 + κ·max(d_t − 1, 0)),   S = min(r·A, clip(r, 1 − ε_low,t, 1 + ε_high,t)·A)

    on both sides, d_t = ``staleness`` (versions behind). SAT ("Stale but Stable", this
    project's paper) shrinks the radii of the tokens whose measured mismatch is largest, a proxy
    for their age; here the age itself is used. A lag of one version (the usual
    one-step-off-policy pipeline) and on-policy tokens (d = 0) keep ε, so κ = 0 is
    :func:`~sat_jax.losses.ppo` exactly. κ is to be tuned on calibration seeds (the default 0.5
    is a placeholder, not a published value).

    Args:
      staleness: ``[B, T]`` integer versions behind (required; negative values are refused
        when concrete, read as 0 when traced).
      kappa: κ ≥ 0.

    Metrics: those of :func:`~sat_jax.losses.ppo` plus ``age/staleness_mean``,
    ``age/eps_low_mean`` and ``age/eps_high_mean``.

    Example:
      >>> lp = jnp.log(jnp.array([[1.5, 1.5]]))
      >>> out = age_clip(lp, jnp.zeros((1, 2)), jnp.array([1.0]), jnp.ones((1, 2), bool),
      ...                staleness=jnp.array([[1, 3]]), kappa=1.0)
      >>> round(float(out.loss), 4)   # −(1.2 + (1 + 0.2/3)) / 2
      -1.1333
    """
    _check_clip(eps_low, eps_high, dual_clip)
    _check_age(kappa, staleness)
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    age = _base.check_staleness(staleness, prep.mask).astype(jnp.float32)
    return _age_objective(
        prep,
        _base.log_ratio(prep.logp, prep.behavior_logp),
        age,
        kappa=kappa,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=dual_clip,
        aggregation=aggregation,
        axis_name=axis_name,
    )


def _age_objective(
    prep, log_ratio, age, *, kappa, eps_low, eps_high, dual_clip, aggregation, axis_name
) -> _base.LossOutput:
    """The clipped objective with ε shrunk by each token's ``age`` (:func:`_age_factor`), and the
    age metrics."""
    factor = _age_factor(age, kappa)
    out = _clip_objective(
        prep,
        log_ratio,
        eps_low=eps_low * factor,
        eps_high=eps_high * factor,
        dual_clip=dual_clip,
        aggregation=aggregation,
        axis_name=axis_name,
    )
    metrics = dict(out.metrics)
    metrics.update(_age_metrics(age, factor, eps_low, eps_high, prep.mask, axis_name))
    return out._replace(metrics=metrics)


def age_clip_gspo(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    staleness: ArrayLike | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    kappa: float = 0.5,
    seq_age: str = "mean",
    seq_log_ratio_cap: float | None = _base.SEQ_LOG_RATIO_CAP,
    aggregation: str = "token-mean",
    token_weights: ArrayLike | None = None,
    axis_name=None,
) -> _base.LossOutput:
    """The age-aware clip on the GSPO sequence ratio: ε_b = ε / (1 + κ·max(d_b − 1, 0)).

    d_b is the response's age from its active tokens' lags: their mean (``seq_age="mean"``,
    default, as ρ_b is the mean of the token log-ratios) or their maximum (``"max"``, the oldest
    token). S_bt = min(ρ_b·A, clip(ρ_b, 1 − ε_low,b, 1 + ε_high,b)·A). ε defaults are
    :func:`~sat_jax.losses.sat_gspo`'s 0.2/0.2; other arguments and metrics as :func:`age_clip`.

    Example:
      >>> lp = jnp.log(jnp.array([[1.5, 1.5]]))
      >>> out = age_clip_gspo(lp, jnp.zeros((1, 2)), jnp.array([1.0]), jnp.ones((1, 2), bool),
      ...                     staleness=jnp.array([[1, 3]]), kappa=1.0)   # mean age 2
      >>> round(float(out.loss), 4)   # −(1 + 0.2/2)
      -1.1
    """
    _check_clip(eps_low, eps_high)
    _check_age(kappa, staleness)
    if seq_age not in SEQ_AGES:
        raise ValueError(f"`seq_age` must be one of {SEQ_AGES}, got {seq_age!r}.")
    _check_seq_cap(seq_log_ratio_cap)
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    age = _base.check_staleness(staleness, prep.mask).astype(jnp.float32)
    if seq_age == "mean":
        seq = jnp.sum(age, axis=1) / jnp.maximum(jnp.sum(prep.mask, axis=1), 1)
    else:
        seq = jnp.max(age, axis=1)  # masked lags are 0, and lags are ≥ 0
    return _age_objective(
        prep,
        _sequence_log_ratio(prep, seq_log_ratio_cap),
        _per_token(seq, prep),
        kappa=kappa,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=None,
        aggregation=aggregation,
        axis_name=axis_name,
    )


# ----------------------------------------------------------------------------------------------
# CISPO, SAPO and decoupled PPO (A-3PO).
# ----------------------------------------------------------------------------------------------


def cispo(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    cispo_eps_low: float = 1.0,
    cispo_eps_high: float = 4.0,
    aggregation: str = "token-mean",
    token_weights: ArrayLike | None = None,
    axis_name=None,
) -> _base.LossOutput:
    """CISPO: REINFORCE weighted by the clipped, detached importance ratio (every token learns).

    MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
    https://arxiv.org/abs/2506.13585 (§3.1)::

        ŵ = sg(clip(r, 1 − ε_low, 1 + ε_high)),   ∇S = ŵ·A·∇log π

    Unlike PPO's clip, a token past the bound keeps its gradient (with weight at the bound). The
    value is ŵ·A (as :func:`~sat_jax.losses.tis_pg`'s); the paper writes ŵ·A·log π, the same
    gradient. The hyper-parameters carry the method's name so that a run's global
    ``loss.eps_low`` (PPO's 0.2) does not set them.

    Args:
      cispo_eps_low: ε_low in [0, 1]; 1 (default) means no lower bound.
      cispo_eps_high: ε_high ≥ 0; 4 (default: ScaleRL's and SkyRL's [0, 5]; MiniMax published
        none, verl reuses PPO's 0.2, NeMo-RL uses 5 for [0, 6]).

    Metrics: mismatch metrics, ``ratio_mean``, ``cispo/clipped_frac``.

    Example:
      >>> out = cispo(jnp.log(jnp.array([[9.0, 0.5]])), jnp.zeros((1, 2)), jnp.array([1.0]),
      ...             jnp.ones((1, 2), bool))
      >>> float(out.loss)   # −(min(9, 5) + 0.5) / 2
      -2.75
    """
    _base.check_hparam("cispo_eps_low", cispo_eps_low, low=0.0, high=1.0)
    _base.check_hparam("cispo_eps_high", cispo_eps_high, low=0.0)
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    lo, hi = 1.0 - cispo_eps_low, 1.0 + cispo_eps_high
    r = jnp.exp(jax.lax.stop_gradient(_base.log_ratio(prep.logp, prep.behavior_logp)))
    return _policy_gradient(
        prep,
        jnp.clip(r, lo, hi),
        axis_name,
        aggregation,
        lambda r: {"cispo/clipped_frac": ((r < lo) | (r > hi)).astype(jnp.float32)},
    )


def sapo(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    aggregation: str = "seq-mean-token-mean",
    token_weights: ArrayLike | None = None,
    axis_name=None,
) -> _base.LossOutput:
    """SAPO: a temperature-controlled sigmoid gate in place of the hard clip.

    Gao et al. 2025, "Soft Adaptive Policy Optimization", https://arxiv.org/abs/2511.20347::

        f(r) = (4/τ)·σ(τ·(r − 1)),   S = f(r)·A,   τ = τ_pos if A > 0 else τ_neg

    f'(1) = 1, so near r = 1 the gradient is the policy gradient's; it decays smoothly as r leaves
    1 (faster for larger τ), where PPO's would drop to zero at the edge. The aggregation default
    is the paper's sequence mean of token means.

    Args:
      tau_pos, tau_neg: τ > 0 for positive and non-positive advantages (paper: 1.0 and 1.05).

    Metrics: mismatch metrics, ``ratio_mean`` and ``sapo/gate_mean``, the mean of
    f'(r)/f'(1) = 4σ(τ(r−1))(1 − σ(τ(r−1))), the share of the policy gradient kept.

    Example:
      >>> out = sapo(jnp.zeros((1, 1)), jnp.zeros((1, 1)), jnp.array([1.0]), jnp.ones((1, 1), bool))
      >>> float(out.loss)   # −(4/1)·σ(0)·1
      -2.0
    """
    _base.check_hparam("tau_pos", tau_pos, low=0.0, low_open=True)
    _base.check_hparam("tau_neg", tau_neg, low=0.0, low_open=True)
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    lr = _base.log_ratio(prep.logp, prep.behavior_logp)
    r = jnp.exp(lr)
    tau = jnp.where(prep.advantages > 0, tau_pos, tau_neg)
    z = tau * (r - 1.0)
    surrogate = (4.0 / tau) * jax.nn.sigmoid(z) * prep.advantages
    s = jax.nn.sigmoid(jax.lax.stop_gradient(z))
    metrics = _mismatch_from_log_ratio(lr, prep.mask, axis_name)
    metrics.update(
        _base.masked_means(
            {"ratio_mean": jax.lax.stop_gradient(r), "sapo/gate_mean": 4.0 * s * (1.0 - s)},
            prep.mask,
            axis_name,
        )
    )
    return _base.finish(surrogate, prep, metrics, aggregation, axis_name)


def decoupled_ppo(
    logp: ArrayLike,
    behavior_logp: ArrayLike,
    advantages: ArrayLike,
    mask: ArrayLike,
    *,
    prox_logp: ArrayLike | None = None,
    staleness: ArrayLike | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    behav_weight_cap: float | None = None,
    aggregation: str = "token-mean",
    token_weights: ArrayLike | None = None,
    axis_name=None,
) -> _base.LossOutput:
    """Decoupled PPO: the trust region around a proximal policy, importance-weighted to μ.

    Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for
    Language Reasoning", https://arxiv.org/abs/2505.24298::

        u = π_θ/π_prox,  w = min(π_prox/μ, cap) (detached),  S = w·min(u·A, clip(u, 1 ± ε)·A)

    ``prox_logp`` is log π_prox, the policy before this update (AReaL recomputes it with one
    more forward pass). Without it, **A-3PO** (Li et al. 2025, https://arxiv.org/abs/2512.06547)
    interpolates from each token's staleness d (versions behind, ``staleness=``, which the
    trainer fills): log π_prox = log μ + α·(sg log π_θ − log μ), α = 1 − 1/d for d > 1 and 0 for
    d ≤ 1 (π_prox = μ, so the loss is PPO's). ``prox_logp`` wins when both are given.

    Args:
      prox_logp: ``[B, T]`` log π_prox, or None for A-3PO.
      staleness: ``[B, T]`` integer versions behind (required for A-3PO).
      behav_weight_cap: optional cap C, w = min(π_prox/μ, C): AReaL's ``token_truncate`` (now
        ``rejection_sampling`` with ``action="clamp"``). AReaL's default ``token_mask`` (and its
        early ``behav_imp_weight_cap``) zeroes w > C instead (docs/losses.md). None: no cap.

    Metrics: those of :func:`~sat_jax.losses.ppo` (clip fractions on u) plus
    ``decoupled/behav_weight_mean`` (mean w).

    Example:
      >>> lp = jnp.log(jnp.array([[1.5]]))
      >>> out = decoupled_ppo(lp, jnp.zeros((1, 1)), jnp.array([1.0]), jnp.ones((1, 1), bool),
      ...                     prox_logp=jnp.log(jnp.array([[1.25]])))
      >>> round(float(out.loss), 4)   # −w·min(u, 1.2), w = 1.25, u = 1.2
      -1.5
    """
    _check_clip(eps_low, eps_high)
    if behav_weight_cap is not None:
        _base.check_hparam("behav_weight_cap", behav_weight_cap, low=0.0, low_open=True)
    if prox_logp is None and staleness is None:
        raise ValueError(
            "`prox_logp` or `staleness` is required (A-3PO interpolates the proximal policy "
            "from each token's staleness)."
        )
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    if prox_logp is not None:
        prox = _base.check_float("prox_logp", prox_logp, shape=prep.logp.shape)
        prox = jnp.where(prep.mask, jax.lax.stop_gradient(prox), 0.0)
    else:
        d = _base.check_staleness(staleness, prep.mask).astype(jnp.float32)
        alpha = jnp.where(d > 1.0, 1.0 - 1.0 / jnp.maximum(d, 1.0), 0.0)
        beh = prep.behavior_logp
        prox = beh + alpha * _base.log_ratio(jax.lax.stop_gradient(prep.logp), beh)
    w = jnp.exp(_base.log_ratio(prox, prep.behavior_logp))
    if behav_weight_cap is not None:
        w = jnp.minimum(w, behav_weight_cap)
    w = jnp.where(prep.mask, w, 0.0)
    weighted = prep._replace(weights=w if prep.weights is None else w * prep.weights)
    out = _clip_objective(
        weighted,
        _base.log_ratio(prep.logp, prox),
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=None,
        aggregation=aggregation,
        axis_name=axis_name,
    )
    extra = _base.masked_means({"decoupled/behav_weight_mean": w}, prep.mask, axis_name)
    return out._replace(metrics={**out.metrics, **extra})
