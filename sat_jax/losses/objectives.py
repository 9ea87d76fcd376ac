"""Policy objectives: SAT (Eqs. 13–20) and the baselines of the paper's Appendix E.

Every objective has the signature

    NAME(logp, behavior_logp, advantages, mask, *, <hyper-parameters>,
         aggregation="token-mean", token_weights=None, axis_name=None) -> LossOutput

* ``logp`` ``[B, T]``: log π_θ of the sampled tokens; the only differentiable input.
* ``behavior_logp`` ``[B, T]``: the ratio denominator, log μ (Eq. 51), detached.
* ``advantages`` ``[B]`` (broadcast over the response) or ``[B, T]``, detached.
* ``mask`` ``[B, T]``: active response tokens T_act (bool or 0/1).
* ``token_weights`` ``[B, T]``: detached per-token weights (e.g. from :func:`tis`) applied to S.
* ``axis_name``: the ``shard_map``/``pmap`` axis; every batch statistic (means, counts, SAT's
  quantile) is then global, so the result equals the unsharded result on the whole batch.

The surrogate S is maximised; ``loss = −aggregate(w·S)``. Inputs are computed in float32; masked
positions may hold anything (``inf``, ``NaN``) without reaching the loss or its gradient.

Under ``shard_map`` the loss is replicated and ``jax.grad`` gives each shard the exact gradient of
the global loss. Under ``pmap``, JAX transposes ``psum`` to ``psum``, so per-device gradients of a
global loss carry a factor of the device count: take ``lax.pmean`` of gradients over the axis, as
usual.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sat_jax.losses import _base
from sat_jax.losses.diagnostics import _mismatch_from_log_ratio, clip_split
from sat_jax.losses.quantile import quantile

Kernel = Callable[[jax.Array, jax.Array], jax.Array]
_ONE = 1.0  # c± when SAT's gate is off; the radii are then ε·1 = ε exactly.


# ----------------------------------------------------------------------------------------------
# Shared pieces.
# ----------------------------------------------------------------------------------------------


def hill_kernel(u: jax.Array, q: jax.Array, exponent: float = 2.0) -> jax.Array:
    """Hill kernel ψ(u; q) = 1 / (1 + (u/q)^p) of Eq. (15): ψ(0)=1, ψ(q)=½, decreasing in u."""
    x = u / q
    if isinstance(exponent, int) or (isinstance(exponent, float) and exponent.is_integer()):
        # Integer p (the paper's p = 2) is a few multiplies, not exp(p·log x).
        return 1.0 / (1.0 + jax.lax.integer_pow(x, int(exponent)))
    return 1.0 / (1.0 + jnp.power(x, exponent))


def _check_clip(eps_low, eps_high, dual_clip=None):
    # ε_low < 1 keeps the lower edge 1 − ε_low positive.
    _base.check_hparam("eps_low", eps_low, low=0.0, high=1.0, high_open=True)
    _base.check_hparam("eps_high", eps_high, low=0.0)
    if dual_clip is not None:
        _base.check_hparam("dual_clip", dual_clip, low=1.0, low_open=True)


def _check_sat(alpha, hill_exponent, kernel):
    if isinstance(alpha, (bool, np.bool_)) or not isinstance(alpha, (int, float, np.number)):
        raise TypeError(
            f"`alpha` must be a Python or NumPy float (it fixes a rank), got {alpha!r}."
        )
    _base.check_hparam("alpha", alpha, low=0.0, high=1.0, low_open=True)
    _base.check_hparam("hill_exponent", hill_exponent, low=0.0, low_open=True)
    if kernel is not None and not callable(kernel):
        raise TypeError(f"`kernel` must be a callable ψ(u, q), got {type(kernel).__name__}.")


def _clip_surrogate(ratio, adv, lo, hi, dual_clip):
    """S = min(r·A, clip(r, lo, hi)·A); optional dual clip S = max(S, c·A) for A < 0 (Eq. 11)."""
    s = jnp.minimum(ratio * adv, jnp.clip(ratio, lo, hi) * adv)
    if dual_clip is not None:
        s = jnp.where(adv < 0, jnp.maximum(s, dual_clip * adv), s)
    return s


def _clip_indicators(ratio, adv, lo, hi, dual_clip) -> dict[str, jax.Array]:
    """Per-token indicators of the clipped (zero-gradient) branches, for clip fractions."""
    ratio = jax.lax.stop_gradient(ratio)
    upper = (adv > 0) & (ratio > hi)
    lower = (adv < 0) & (ratio < lo)
    out = {"clip_frac_upper": upper, "clip_frac_lower": lower, "clip_frac": upper | lower}
    if dual_clip is not None:
        out["dual_clip_frac"] = (adv < 0) & (ratio > dual_clip)
    return out


def _sat_contraction(
    d, mask, alpha, hill_exponent, kernel, axis_name, quantile_method, weights=None
):
    """q (Eq. 14), the gate and the contraction factors c± (Eqs. 15–16) from a detached score d.

    ``weights`` (integer multiplicities) lets a per-sequence score count once per active token.
    """
    d = jax.lax.stop_gradient(d)
    a = jnp.abs(d)
    q = quantile(a, mask, alpha, weights=weights, axis_name=axis_name, method=quantile_method)
    gated = mask & (q > 0) & (a > q)
    q_safe = jnp.where(q > 0, q, 1.0)  # the q > 0 branch of Eq. (16): never divide by zero
    psi = kernel if kernel is not None else functools.partial(hill_kernel, exponent=hill_exponent)
    # Sign split: u± = max(±d, 0), so a gated token's u on its own side is |d|; only that side
    # contracts and the other keeps ε exactly (ψ is evaluated once per token).
    c = psi(a, q_safe)
    c_plus = jnp.where(gated & (d > 0), c, _ONE)
    c_minus = jnp.where(gated & (d < 0), c, _ONE)
    return q, gated, c_minus, c_plus


def _clip_objective(
    prep: _base.Prepared,
    clip_log_ratio: jax.Array,
    *,
    eps_low,
    eps_high,
    dual_clip,
    aggregation,
    axis_name,
    contraction=None,
    keep=None,
    extra_metrics=None,
) -> _base.LossOutput:
    """Every clipped objective in one place: PPO/GRPO, GSPO(-token), SeqClip, DPPO and SAT.

    Args:
      clip_log_ratio: log of the clipped quantity (token ratio or broadcast sequence ratio).
      contraction: None, or SAT's (q, gated, c−, c+) from :func:`_sat_contraction`, each
        broadcastable to ``[B, T]``.
      keep: optional detached ``[B, T]`` bool; S is zeroed where it is False (SeqClip, DPPO).
    """
    adv, mask = prep.advantages, prep.mask
    token_lr = _base.log_ratio(prep.logp, prep.behavior_logp)
    metrics = _mismatch_from_log_ratio(token_lr, mask, axis_name)
    c_minus = c_plus = jnp.float32(_ONE)
    if contraction is not None:
        q, gated, c_minus, c_plus = contraction
        gated = mask & gated
    ratio = jnp.exp(clip_log_ratio)
    lo = 1.0 - eps_low * c_minus
    hi = 1.0 + eps_high * c_plus
    surrogate = _clip_surrogate(ratio, adv, lo, hi, dual_clip)
    indicators = _clip_indicators(ratio, adv, lo, hi, dual_clip)
    if keep is not None:
        surrogate = jnp.where(keep, surrogate, 0.0)
    means = {k: v.astype(jnp.float32) for k, v in indicators.items()}
    means.update(clip_split(ratio, adv, lo, hi))
    means["ratio_mean"] = jax.lax.stop_gradient(ratio)
    if contraction is not None:
        r = jax.lax.stop_gradient(ratio)
        # Where SAT's gradient differs from PPO's: the newly clipped outward band of Eq. (21).
        binding = ((adv > 0) & (r > hi) & (r < 1.0 + eps_high)) | (
            (adv < 0) & (r < lo) & (r > 1.0 - eps_low)
        )
        means.update(
            {
                "sat/eps_low_mean": eps_low * c_minus,
                "sat/eps_high_mean": eps_high * c_plus,
                "sat/gate_rate": gated.astype(jnp.float32),
                "sat/binding_rate": binding.astype(jnp.float32),
            }
        )
        c_min = jnp.min(jnp.where(mask, jnp.minimum(c_minus, c_plus), 1.0))
        metrics["sat/c_min"] = _base.pmin(c_min, axis_name)
        metrics["sat/q"] = q
    for name, value in (extra_metrics or {}).items():
        means[name] = value
    metrics.update(_base.masked_means(means, mask, axis_name))
    return _base.finish(surrogate, prep, metrics, aggregation, axis_name)


def _check_seq_cap(seq_log_ratio_cap):
    _base.check_hparam("seq_log_ratio_cap", seq_log_ratio_cap, low=0.0, low_open=True)


def _cap(log_ratio: jax.Array, cap) -> jax.Array:
    """``min(log_ratio, cap)``; ``cap=None`` leaves it as is. Zero gradient above the cap."""
    return log_ratio if cap is None else jnp.minimum(log_ratio, cap)


def _uncapped_sequence_scores(prep: _base.Prepared) -> jax.Array:
    """mean_t of the ±20-clamped token log-ratios, ``[B]`` (differentiable), before the cap."""
    return _base.sequence_log_ratio(_base.log_ratio(prep.logp, prep.behavior_logp), prep.mask)


def _sequence_scores(prep: _base.Prepared, cap) -> jax.Array:
    """log ρ_b of Eq. (20), capped above at ``cap``, ``[B]`` (differentiable)."""
    return _cap(_uncapped_sequence_scores(prep), cap)


def _per_token(seq: jax.Array, prep: _base.Prepared) -> jax.Array:
    """A per-sequence ``[B]`` value broadcast over the response, ``[B, T]``."""
    return jnp.broadcast_to(seq[:, None], prep.logp.shape)


def _sequence_log_ratio(prep: _base.Prepared, cap) -> jax.Array:
    """Capped log ρ_b of Eq. (20) broadcast to ``[B, T]`` (differentiable)."""
    return _per_token(_sequence_scores(prep, cap), prep)


def _zero_with_unit_grad(logp: jax.Array) -> jax.Array:
    """``logp − sg(logp)``: 0 in value, derivative 1; 0 with no gradient where logp is ±inf.

    A sampled token with log π = −inf would otherwise give ``−inf − (−inf) = NaN``.
    """
    finite = jnp.isfinite(jax.lax.stop_gradient(logp))
    return jnp.where(finite, logp - jax.lax.stop_gradient(logp), 0.0)


def _policy_gradient(prep, weight, axis_name, aggregation, extra):
    """S = sg(weight)·A·(1 + logp − sg(logp)): value weight·A, gradient weight·A·∇log π."""
    lr = _base.log_ratio(prep.logp, prep.behavior_logp)
    surrogate = weight * prep.advantages * (1.0 + _zero_with_unit_grad(prep.logp))
    metrics = _mismatch_from_log_ratio(lr, prep.mask, axis_name)
    r = jnp.exp(jax.lax.stop_gradient(lr))
    metrics.update(_base.masked_means({"ratio_mean": r, **extra(r)}, prep.mask, axis_name))
    return _base.finish(surrogate, prep, metrics, aggregation, axis_name)


# ----------------------------------------------------------------------------------------------
# Token-ratio objectives.
# ----------------------------------------------------------------------------------------------


def ppo(
    logp,
    behavior_logp,
    advantages,
    mask,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
    token_weights=None,
    axis_name=None,
) -> _base.LossOutput:
    """PPO / GRPO token-level clipped surrogate (Eq. 11).

        r = exp(logp − behavior_logp),  S = min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A)

    With ``dual_clip=c`` (> 1), negative-advantage tokens are also bounded below, S = max(S, c·A)
    for A < 0 (Ye et al. 2020), the one baseline that bounds large ratios on negative advantages.
    Defaults ε = 0.2/0.2 as in the paper; DAPO's clip-higher is 0.2/0.28. verl's ``vanilla`` loss
    always applies the dual clip (``clip_ratio_c=3``): pass ``dual_clip=3.0`` to reproduce it;
    tunix's ``grpo`` applies it only when ``epsilon_c`` is set (docs/losses.md).

    Metrics: mismatch (d̄_π), k1, k3, log_ratio_var, mismatch_max, clip_frac(_upper/_lower),
    ratio_mean (and dual_clip_frac), and the four cells of ``diagnostics.clip_split``
    (``clip/pos_high``, ``clip/pos_low``, ``clip/neg_low``, ``clip/neg_high``).

    Example:
      >>> out = ppo(jnp.log(jnp.array([[1.5]])), jnp.zeros((1, 1)), jnp.array([1.0]),
      ...           jnp.array([[True]]))
      >>> float(out.loss)  # −min(1.5·1, 1.2·1)
      -1.2000000476837158
    """
    _check_clip(eps_low, eps_high, dual_clip)
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    return _clip_objective(
        prep,
        _base.log_ratio(prep.logp, prep.behavior_logp),
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=dual_clip,
        aggregation=aggregation,
        axis_name=axis_name,
    )


def sat(
    logp,
    behavior_logp,
    advantages,
    mask,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    alpha: float = 0.9,
    hill_exponent: float = 2.0,
    kernel: Kernel | None = None,
    dual_clip: float | None = None,
    quantile_method: str = "auto",
    aggregation: str = "token-mean",
    token_weights=None,
    axis_name=None,
) -> _base.LossOutput:
    """SAT-GRPO: the staleness-adaptive trust region on the token ratio (Eqs. 13–19).

        d = sg(log r)                                        (13)
        q = ⌈α·n⌉-th smallest |d| over active tokens, sg     (14)
        c± = ψ(u±; q) if q > 0 and |d| > q else 1,  u± = max(±d, 0),  ψ(u; q) = 1/(1 + (u/q)^p)
        S = min(r·A, clip(r, 1 − ε_low·c−, 1 + ε_high·c+)·A)          (17)–(19)

    Only the top (1 − α) share of tokens by mismatch is gated, and only on the side that moves r
    away from 1, so pull-back gradients are PPO's. With the gate off (c± = 1, e.g. ``alpha=1``) the
    result is bit-identical to :func:`ppo`. Proposition 4.1: the SAT interval lies inside PPO's,
    S_SAT ≤ S_PPO, and gradients differ exactly on the newly clipped outward band (Eq. 21).

    Operating range: a gated token already has r outside [e^−q, e^q]. Once q ≥ log(1 + ε_high)
    (q ≥ −log(1 − ε_low) for the lower side) the contraction cannot bind and SAT's gradient equals
    PPO's; watch ``sat/binding_rate`` and ``sat/q`` next to ``mismatch``.

    Args:
      alpha: quantile level of Eq. (14), a Python float in (0, 1] (paper: 0.9).
      hill_exponent: p of the Hill kernel (paper: 2).
      kernel: optional ψ(u, q) replacing the Hill kernel; any monotone ψ with ψ(0)=1, ψ(q)=½.
      dual_clip: optional dual-clip constant, as in :func:`ppo`.
      quantile_method: ``"auto"``, ``"radix"`` or ``"bisect"`` (see :func:`quantile`).

    Metrics: those of :func:`ppo` plus Table 10's ``sat/eps_low_mean``, ``sat/eps_high_mean``,
    ``sat/gate_rate``, ``sat/c_min``, ``sat/q``, and ``sat/binding_rate``: the share of active
    tokens whose gradient SAT changes relative to PPO.
    """
    _check_clip(eps_low, eps_high, dual_clip)
    _check_sat(alpha, hill_exponent, kernel)
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    clip_lr = _base.log_ratio(prep.logp, prep.behavior_logp)
    return _clip_objective(
        prep,
        clip_lr,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=dual_clip,
        aggregation=aggregation,
        axis_name=axis_name,
        contraction=_sat_contraction(
            clip_lr, prep.mask, float(alpha), hill_exponent, kernel, axis_name, quantile_method
        ),
    )


def dppo(
    logp,
    behavior_logp,
    advantages,
    mask,
    *,
    delta: float | None = None,
    divergence: str = "tv",
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    variant: str = "paper",
    ratio_cap: float = 20.0,
    aggregation: str = "token-mean",
    token_weights=None,
    axis_name=None,
) -> _base.LossOutput:
    """DPPO: policy gradient with outward moves dropped where the sampled divergence exceeds δ.

        outward = sign(A·(r − 1)) > 0
        TV:  D = μ·|r − 1| = |π − μ| of the sampled token (Eq. 45)
        KL:  D = Bernoulli KL(μ‖π) of the sampled token's probability
        keep = ¬(outward ∧ D > δ)                                   (the mask of Eq. 47)

    Two readings of Eq. (47), chosen by ``variant``:

    * ``"paper"`` (default): S = keep · min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A), the mask
      multiplying PPO's clip. This is what the paper ran (Appendix F: "DPPO multiplies the GRPO
      clip by a hard mask"; Table 9: DPPO-DTV, δ = 1e-3, ε = 0.2/0.2).
    * ``"verl"``: the mask replaces the clip, with a detached importance weight capped at
      ``ratio_cap`` (verl's ``dppo_tv``/``dppo_kl``, whose ``clip_ratio_c`` defaults to 20):
      S = keep · sg(min(r, C)) · A · (1 + logp − sg(logp)). Its gradient, keep·min(r, C)·A per
      token, is verl's; its value keep·min(r, C)·A is on the scale of the other surrogates,
      whereas verl's reported loss is −A·sg(min(r, C))·log π (same gradient, different value).
      ε is not used.

    Args:
      delta: threshold δ; None means the paper's 1e-3 for ``"tv"`` and verl's 0.05 for ``"kl"``.
      divergence: ``"tv"`` (the paper's DPPO-DTV) or ``"kl"``.
      variant: ``"paper"`` or ``"verl"``, as above.
      ratio_cap: C > 0 of the ``"verl"`` variant (unused by ``"paper"``).

    Metrics: those of :func:`ppo` (``"paper"``) or mismatch metrics and ``ratio_mean``
    (``"verl"``), plus ``dppo/masked_frac``, the share of active tokens zeroed, and for
    ``"verl"`` ``dppo/ratio_capped_frac``, the share of kept tokens with r > C.
    """
    if divergence not in ("tv", "kl"):
        raise ValueError(f"`divergence` must be 'tv' or 'kl', got {divergence!r}.")
    if variant not in ("paper", "verl"):
        raise ValueError(f"`variant` must be 'paper' or 'verl', got {variant!r}.")
    if delta is None:
        delta = 1e-3 if divergence == "tv" else 0.05
    _base.check_hparam("delta", delta, low=0.0, low_open=True)
    _base.check_hparam("ratio_cap", ratio_cap, low=0.0, low_open=True)
    _check_clip(eps_low, eps_high)
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    lr = _base.log_ratio(prep.logp, prep.behavior_logp)
    r = jnp.exp(jax.lax.stop_gradient(lr))
    outward = prep.advantages * (r - 1.0) > 0
    if divergence == "tv":
        disc = jnp.exp(prep.behavior_logp) * jnp.abs(r - 1.0)
    else:
        disc = bernoulli_kl(prep.behavior_logp, jax.lax.stop_gradient(prep.logp))
    dropped = prep.mask & outward & (disc > delta)
    if variant == "paper":
        return _clip_objective(
            prep,
            lr,
            eps_low=eps_low,
            eps_high=eps_high,
            dual_clip=None,
            aggregation=aggregation,
            axis_name=axis_name,
            keep=~dropped,
            extra_metrics={"dppo/masked_frac": dropped.astype(jnp.float32)},
        )
    weight = jnp.minimum(r, ratio_cap)  # detached: r is computed from sg(log r)
    surrogate = weight * prep.advantages * (1.0 + _zero_with_unit_grad(prep.logp))
    surrogate = jnp.where(dropped, 0.0, surrogate)
    metrics = _mismatch_from_log_ratio(lr, prep.mask, axis_name)
    metrics.update(
        _base.masked_means(
            {
                "ratio_mean": r,
                "dppo/masked_frac": dropped.astype(jnp.float32),
                "dppo/ratio_capped_frac": (~dropped & (r > ratio_cap)).astype(jnp.float32),
            },
            prep.mask,
            axis_name,
        )
    )
    return _base.finish(surrogate, prep, metrics, aggregation, axis_name)


def bernoulli_kl(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
    """KL(Bern(p)‖Bern(q)) = p·log(p/q) + (1−p)·log((1−p)/(1−q)) from log-probabilities (Eq. 43).

    Computed with log1p(−e^x) for the complements; +inf where q = 1 ≠ p (never NaN).
    """
    p = jnp.exp(log_p)
    log1m_p = jnp.log1p(-jnp.minimum(p, 1.0))
    log1m_q = jnp.log1p(-jnp.minimum(jnp.exp(log_q), 1.0))
    comp = jnp.where(p < 1.0, (1.0 - p) * (log1m_p - log1m_q), 0.0)
    return p * (log_p - log_q) + comp


def _quadratic(prep, weight, aggregation, axis_name) -> _base.LossOutput:
    """S = r·A − |A|·weight·(r − 1)² (SPO with weight 1/(2ε), DRPO with μ/(2δ))."""
    lr = _base.log_ratio(prep.logp, prep.behavior_logp)
    r = jnp.exp(lr)
    adv = prep.advantages
    surrogate = r * adv - jnp.abs(adv) * weight * jnp.square(r - 1.0)
    metrics = _mismatch_from_log_ratio(lr, prep.mask, axis_name)
    metrics.update(
        _base.masked_means({"ratio_mean": jax.lax.stop_gradient(r)}, prep.mask, axis_name)
    )
    return _base.finish(surrogate, prep, metrics, aggregation, axis_name)


def spo(
    logp,
    behavior_logp,
    advantages,
    mask,
    *,
    eps: float = 0.2,
    aggregation: str = "token-mean",
    token_weights=None,
    axis_name=None,
) -> _base.LossOutput:
    """SPO: clipping replaced by a quadratic penalty (Eq. 48).

    S = r·A − |A|/(2ε)·(r − 1)²,   stationary at r* = 1 + sign(A)·ε (PPO's edge).
    """
    _base.check_hparam("eps", eps, low=0.0, low_open=True)
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    return _quadratic(prep, 1.0 / (2.0 * eps), aggregation, axis_name)


def drpo(
    logp,
    behavior_logp,
    advantages,
    mask,
    *,
    delta: float = 1e-3,
    aggregation: str = "token-mean",
    token_weights=None,
    axis_name=None,
) -> _base.LossOutput:
    """DRPO: SPO's penalty in DPPO's sampled-TV geometry (Eq. 49).

    S = r·A − |A|/(2δ)·μ·(r − 1)²,   μ = exp(behavior_logp).
    """
    _base.check_hparam("delta", delta, low=0.0, low_open=True)
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    weight = jnp.exp(prep.behavior_logp) / (2.0 * delta)
    return _quadratic(prep, weight, aggregation, axis_name)


def tis_pg(
    logp,
    behavior_logp,
    advantages,
    mask,
    *,
    cap: float = 2.0,
    aggregation: str = "token-mean",
    token_weights=None,
    axis_name=None,
) -> _base.LossOutput:
    """Truncated-IS policy gradient: importance-weighted REINFORCE with no trust region.

        w = min(r, C) (detached),  S = w·A·(1 + logp − sg(logp)),  ∇S = min(r, C)·A·∇log π

    Each token's policy-gradient term is weighted by its truncated importance ratio (IMPALA's
    ρ̄-truncation, Espeholt et al. 2018; the "no clip" baseline of M2PO and of NeMo-RL's
    asynchronous GRPO). Unlike the clipped objectives nothing stops a token whose ratio has
    already moved away from 1 from being pushed further (only C bounds the weight), so it is the
    study's collapse-prone arm: stable on-policy (r = 1: plain REINFORCE with group advantages),
    increasingly unstable as stale rollouts widen the ratios. The value is min(r, C)·A, on the
    scale of the other surrogates; C = ∞ gives the unclipped surrogate r·A's gradient.

    Args:
      cap: C > 0 (default 2, as :func:`~sat_jax.losses.tis`).

    Metrics: mismatch metrics, ``ratio_mean`` and ``tis_pg/truncated_frac``, the share of active
    tokens with r > C.

    Example:
      >>> out = tis_pg(jnp.log(jnp.array([[3.0, 0.5]])), jnp.zeros((1, 2)), jnp.array([1.0]),
      ...              jnp.array([[True, True]]))
      >>> float(out.loss)  # −(min(3, 2)·1 + 0.5·1) / 2
      -1.25
    """
    _base.check_hparam("cap", cap, low=0.0, low_open=True)
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    r = jnp.exp(jax.lax.stop_gradient(_base.log_ratio(prep.logp, prep.behavior_logp)))
    return _policy_gradient(
        prep,
        jnp.minimum(r, cap),
        axis_name,
        aggregation,
        lambda r: {"tis_pg/truncated_frac": (r > cap).astype(jnp.float32)},
    )


# ----------------------------------------------------------------------------------------------
# Sequence-ratio objectives.
# ----------------------------------------------------------------------------------------------


def gspo(
    logp,
    behavior_logp,
    advantages,
    mask,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    seq_log_ratio_cap: float | None = _base.SEQ_LOG_RATIO_CAP,
    aggregation: str = "token-mean",
    token_weights=None,
    axis_name=None,
) -> _base.LossOutput:
    """GSPO: the clipped surrogate on the length-normalised sequence ratio (Eqs. 20, 37–38).

        log ρ_b = min(mean_t clip(log r_bt, ±20), cap),
        S_bt = min(ρ_b·A, clip(ρ_b, 1 − ε_low, 1 + ε_high)·A)

    ρ_b is broadcast to the response's active tokens. Defaults are the GSPO paper's 3e-4/4e-4; the
    SAT paper ran 0.2/0.2. ``mismatch`` metrics use token ratios (Eq. 52), as for every method.

    Args:
      seq_log_ratio_cap: upper cap on log ρ_b after averaging (default 10, as tunix's
        ``gspo-token`` and verl's ``gspo``), so ρ_b ≤ e^10 ≈ 2.2e4 and a response above the cap
        has no gradient; None disables it (then ρ_b ≤ e^20 from the token clamp alone). Below
        the cap the loss is unchanged. With tokens clamped at ±20 first, ρ_b ≥ e^−20.
    """
    _check_clip(eps_low, eps_high)
    _check_seq_cap(seq_log_ratio_cap)
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    return _clip_objective(
        prep,
        _sequence_log_ratio(prep, seq_log_ratio_cap),
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=None,
        aggregation=aggregation,
        axis_name=axis_name,
    )


def gspo_token(
    logp,
    behavior_logp,
    advantages,
    mask,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    seq_log_ratio_cap: float | None = _base.SEQ_LOG_RATIO_CAP,
    aggregation: str = "token-mean",
    token_weights=None,
    axis_name=None,
) -> _base.LossOutput:
    """GSPO-token: GSPO's value with per-token gradients (GSPO paper, Eq. 13 there).

        log s_bt = min(sg(mean_t clip(log r_bt, ±20)) + logp_t − sg(logp_t), cap)

    Numerically s_bt = ρ_b (capped as in :func:`gspo`), but ∂s_bt/∂logp_t = ρ_b for that token
    alone, so per-token advantages ``[B, T]`` act on their own token. The cap is applied after
    the sum, as tunix and verl do, so a response above it has no gradient, like :func:`gspo`.

    With sequence advantages ``[B]`` its gradient equals :func:`gspo`'s, value and gradient, in
    every aggregation mode: d/dlogp_bt of GSPO is f'(ρ_b)·ρ_b·(1/T_b)·(sum of the row's T_b
    token weights), and every mode weighs a row's tokens equally, so the T_b cancels. The one
    exception is a token with |log r| > 20, whose gradient the token clamp removes in
    :func:`gspo` but not here.
    """
    _check_clip(eps_low, eps_high)
    _check_seq_cap(seq_log_ratio_cap)
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    seq = jax.lax.stop_gradient(_per_token(_uncapped_sequence_scores(prep), prep))
    clip_lr = _cap(seq + _zero_with_unit_grad(prep.logp), seq_log_ratio_cap)
    return _clip_objective(
        prep,
        clip_lr,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=None,
        aggregation=aggregation,
        axis_name=axis_name,
    )


def sat_gspo(
    logp,
    behavior_logp,
    advantages,
    mask,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    alpha: float = 0.9,
    hill_exponent: float = 2.0,
    kernel: Kernel | None = None,
    quantile_method: str = "auto",
    seq_log_ratio_cap: float | None = _base.SEQ_LOG_RATIO_CAP,
    aggregation: str = "token-mean",
    token_weights=None,
    axis_name=None,
) -> _base.LossOutput:
    """SAT-GSPO: SAT's radii on the sequence ratio (Eq. 20 with Eqs. 13–19).

    The clipped quantity and the staleness score are both ρ_b (d = sg(log ρ_b)), broadcast to the
    response's active tokens; the quantile is over active tokens, so long responses weigh more.
    With the gate off it is bit-identical to :func:`gspo` at the same ε and cap. Defaults are the
    paper's (ε = 0.2/0.2, α = 0.9, Hill p = 2). Metrics as :func:`sat`.

    ``seq_log_ratio_cap`` caps log ρ_b as in :func:`gspo` (default 10), for the clipped quantity
    and the score alike. Capping cannot change q unless q ≥ cap, where SAT cannot bind anyway.
    """
    _check_clip(eps_low, eps_high)
    _check_sat(alpha, hill_exponent, kernel)
    _check_seq_cap(seq_log_ratio_cap)
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    seq_lr = _sequence_scores(prep, seq_log_ratio_cap)
    # The score is constant over a response, so the token-level quantile is a quantile of the B
    # sequence scores weighted by their active-token counts: one pass over [B], not [B, T].
    counts = jnp.sum(prep.mask.astype(jnp.int32), axis=1)
    q, gated, c_minus, c_plus = _sat_contraction(
        seq_lr,
        counts > 0,
        float(alpha),
        hill_exponent,
        kernel,
        axis_name,
        quantile_method,
        weights=counts,
    )
    return _clip_objective(
        prep,
        _per_token(seq_lr, prep),
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=None,
        aggregation=aggregation,
        axis_name=axis_name,
        contraction=(q, gated[:, None], c_minus[:, None], c_plus[:, None]),
    )


def seqclip(
    logp,
    behavior_logp,
    advantages,
    mask,
    *,
    low: float = 0.995,
    high: float = 1.005,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    seq_log_ratio_cap: float | None = _base.SEQ_LOG_RATIO_CAP,
    aggregation: str = "token-mean",
    token_weights=None,
    axis_name=None,
) -> _base.LossOutput:
    """SeqClip: GSPO with a hard response-level gate (Eq. 39).

        S_bt = 1[low ≤ ρ_b ≤ high] · min(ρ_b·A, clip(ρ_b, 1 − ε_low, 1 + ε_high)·A)

    Responses whose sequence ratio leaves [low, high] are dropped whole. ε defaults and
    ``seq_log_ratio_cap`` (on log ρ_b, default 10) follow :func:`gspo`. Metrics add
    ``seqclip/kept_frac`` (share of active tokens kept).
    """
    _base.check_hparam("low", low, low=0.0, low_open=True)
    _base.check_hparam("high", high, low=low if isinstance(low, (int, float)) else None)
    _check_clip(eps_low, eps_high)
    _check_seq_cap(seq_log_ratio_cap)
    prep = _base.prepare(logp, behavior_logp, advantages, mask, token_weights, aggregation)
    seq = _sequence_log_ratio(prep, seq_log_ratio_cap)
    rho = jnp.exp(jax.lax.stop_gradient(seq))
    keep = (rho >= low) & (rho <= high)
    return _clip_objective(
        prep,
        seq,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=None,
        aggregation=aggregation,
        axis_name=axis_name,
        keep=keep,
        extra_metrics={"seqclip/kept_frac": keep.astype(jnp.float32)},
    )
