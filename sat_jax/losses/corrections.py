"""Token-level importance corrections (Appendix E.3): detached weights for ``token_weights=``.

Each returns a ``[B, T]`` float32 array, zero on masked positions, with no gradient. Compose with
any objective: ``losses.ppo(..., token_weights=losses.tis(old_logp, behavior_logp, mask))``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sat_jax.losses import _base
from sat_jax.losses.objectives import bernoulli_kl

ArrayLike = _base.ArrayLike


def _inputs(name_a, a, name_b, b, mask):
    a, b = _base.check_logps(name_a, a, name_b, b)
    mask = _base.check_mask(mask, a.shape)
    a = jnp.where(mask, jax.lax.stop_gradient(a), 0.0)
    b = jnp.where(mask, jax.lax.stop_gradient(b), 0.0)
    return a, b, mask


def _engine_ratio(old_logp, behavior_logp):
    """k = μ̃/μ: trainer-side recomputation of the behaviour policy over the engine's log-prob."""
    return jnp.exp(_base.log_ratio(old_logp, behavior_logp))


def tis(old_logp, behavior_logp, mask, cap: float = 2.0) -> jax.Array:
    """Truncated importance sampling weight (Eq. 41): w = min(μ̃/μ, C).

    verl: ``rollout_is="token"`` with ``rollout_is_threshold=C`` gives the same weight (both clamp
    log k at ±20 first); tunix passes precomputed ``sampler_is_weights`` the same way.

    Args:
      old_logp: ``[B, T]`` trainer-side log-probs of the behaviour version (μ̃).
      behavior_logp: ``[B, T]`` rollout-engine log-probs (μ).
      mask: ``[B, T]`` active tokens.
      cap: C > 0 (default 2).
    """
    _base.check_hparam("cap", cap, low=0.0, low_open=True)
    old_logp, behavior_logp, mask = _inputs(
        "old_logp", old_logp, "behavior_logp", behavior_logp, mask
    )
    w = jnp.minimum(_engine_ratio(old_logp, behavior_logp), cap)
    return jnp.where(mask, w, 0.0)


def icepop(
    old_logp, behavior_logp, mask, low: float = 0.5, high: float = 5.0, binary: bool = False
) -> jax.Array:
    """IcePop two-sided gate (Eq. 42): w = k·1[low ≤ k ≤ high], k = μ̃/μ; ``binary`` drops the k.

    Bounds are on k itself, inclusive, with log k clamped at ±20 as in :func:`tis`. verl spells
    the same gate two ways (docs/losses.md):

    * as an importance weight, ``rollout_is="token"``, ``rollout_is_threshold="low_high"``: the
      weight above (``binary=False``), applied through ``token_weights``, so a rejected token
      still counts in the aggregation's denominator;
    * as rejection, ``rollout_rs="token_k1"``: its statistic is −log k and its threshold
      ``"a_b"`` keeps log a ≤ −log k ≤ log b, i.e. 1/b ≤ k ≤ 1/a, so ``icepop(0.5, 5)`` is its
      ``"0.2_2"``. A rejected token leaves verl's response mask, hence the denominator too: pass
      ``mask & (icepop(..., binary=True) > 0)`` as the objective's ``mask`` to reproduce it.
    """
    _base.check_hparam("low", low, low=0.0)
    _base.check_hparam("high", high, low=low if isinstance(low, (int, float)) else None)
    old_logp, behavior_logp, mask = _inputs(
        "old_logp", old_logp, "behavior_logp", behavior_logp, mask
    )
    k = _engine_ratio(old_logp, behavior_logp)
    keep = mask & (k >= low) & (k <= high)
    return jnp.where(keep, 1.0 if binary else k, 0.0)


def kpop(logp, behavior_logp, mask, phi: float) -> jax.Array:
    """KPop Bernoulli-KL gate (Eq. 43) on the sampled token's probabilities p_π and p_μ.

        w = 1[KL_B(p_π‖p_μ) ≤ φ] · 1[KL_B(p_μ‖p_π) ≤ φ]

    Args:
      logp: ``[B, T]`` trainer log-probs (detached here).
      behavior_logp: ``[B, T]`` rollout log-probs.
      mask: ``[B, T]`` active tokens.
      phi: threshold φ > 0 (required: the paper gives no default).
    """
    _base.check_hparam("phi", phi, low=0.0, low_open=True)
    logp, behavior_logp, mask = _inputs("logp", logp, "behavior_logp", behavior_logp, mask)
    keep = (bernoulli_kl(logp, behavior_logp) <= phi) & (bernoulli_kl(behavior_logp, logp) <= phi)
    return jnp.where(mask & keep, 1.0, 0.0)


# Sequence-level rejection (verl's rollout correction; DeepSeek-V3.2's off-policy sequence mask).
# Each statistic is a sum over one response's own tokens, so no batch statistic is involved and
# the weights are the same sharded or not.


def _sequence_log_ratio_sum(a, b, mask):
    """Σ_t clip(log a − log b, ±20) over each response's active tokens, and its token count."""
    lr = jnp.where(mask, _base.log_ratio(a, b), 0.0)
    return jnp.sum(lr, axis=1), jnp.sum(mask.astype(jnp.float32), axis=1)


def seq_mis(
    old_logp: ArrayLike,
    behavior_logp: ArrayLike,
    mask: ArrayLike,
    cap: float = 2.0,
    low: float = 0.5,
    high: float = 2.0,
) -> jax.Array:
    """Sequence importance weight min(Π_t ρ_t, C), zero outside [low, high]; ρ = μ̃/μ.

    verl's sequence-level rollout correction: ``rollout_is="sequence"`` with threshold C, and
    ``rollout_rs="seq_sum_k1"`` with threshold ``"{1/high}_{1/low}"`` (it bounds −Σ log ρ; the
    defaults are its ``"0.5_2.0"`` preset; the earlier ``rollout_rs="sequence"`` bounded Π ρ by
    ``low``/``high`` directly): the weight of Eq. (41) on the whole response's ratio, computed in
    log space with each token's log ρ clamped at ±20 (verl's weight clamps the sum). A rejected
    response keeps its tokens in the aggregation's denominator (a weight, like :func:`icepop`).

    Example:
      >>> w = seq_mis(jnp.log(jnp.array([[1.5, 1.2], [3.0, 1.0]])), jnp.zeros((2, 2)),
      ...             jnp.ones((2, 2), bool))
      >>> w.round(4).tolist()   # Π = 1.8 kept; Π = 3 rejected (> 2)
      [[1.7999999523162842, 1.7999999523162842], [0.0, 0.0]]
    """
    _base.check_hparam("cap", cap, low=0.0, low_open=True)
    _base.check_hparam("low", low, low=0.0, low_open=True)
    _base.check_hparam("high", high, low=low if isinstance(low, (int, float)) else None)
    old_logp, behavior_logp, mask = _inputs(
        "old_logp", old_logp, "behavior_logp", behavior_logp, mask
    )
    s, _ = _sequence_log_ratio_sum(old_logp, behavior_logp, mask)
    keep = (s >= jnp.log(low)) & (s <= jnp.log(high))
    w = jnp.where(keep, jnp.exp(jnp.minimum(s, jnp.log(cap))), 0.0)
    return jnp.where(mask, w[:, None], 0.0)


def geo_rs(
    old_logp: ArrayLike,
    behavior_logp: ArrayLike,
    mask: ArrayLike,
    low: float = 0.999,
    high: float = 1.001,
) -> jax.Array:
    """Geometric-mean rejection: 1 unless exp(mean_t log ρ_t) ∉ [low, high]; ρ = μ̃/μ.

    verl's ``rollout_rs="seq_mean_k1"`` with threshold ``"{1/high}_{1/low}"`` (it bounds
    −mean log ρ; its ``"0.999_1.001"`` preset is the band [1/1.001, 1/0.999], within 1e-6 of the
    default here); bounds are compared in log space, inclusive. A binary weight: pass
    ``mask & (geo_rs(...) > 0)`` as the objective's mask to remove rejected responses from the
    denominator as verl does.

    Example:
      >>> geo_rs(jnp.array([[0.0, 0.001], [0.01, 0.0]]), jnp.zeros((2, 2)),
      ...        jnp.ones((2, 2), bool)).tolist()
      [[1.0, 1.0], [0.0, 0.0]]
    """
    _base.check_hparam("low", low, low=0.0, low_open=True)
    _base.check_hparam("high", high, low=low if isinstance(low, (int, float)) else None)
    old_logp, behavior_logp, mask = _inputs(
        "old_logp", old_logp, "behavior_logp", behavior_logp, mask
    )
    s, n = _sequence_log_ratio_sum(old_logp, behavior_logp, mask)
    mean = s / jnp.maximum(n, 1.0)
    keep = (mean >= jnp.log(low)) & (mean <= jnp.log(high))
    return jnp.where(mask & keep[:, None], 1.0, 0.0)


def opsm(
    logp: ArrayLike, behavior_logp: ArrayLike, mask: ArrayLike, advantages: ArrayLike, delta: float
) -> jax.Array:
    """Off-policy sequence mask: 0 for a response with Â < 0 and mean_t log(μ/π_θ) > δ, else 1.

    DeepSeek-AI 2025, "DeepSeek-V3.2", https://arxiv.org/abs/2512.02556: negative samples the
    current policy already finds much less likely than the rollout did are dropped. Masked tokens
    stay in the aggregation's denominator (a weight of 0, not a removal). δ is required: the
    paper gives none (slime uses 1e-4, Trinity 0.1).

    Args:
      logp: ``[B, T]`` current policy log-probs (detached here).
      behavior_logp: ``[B, T]`` rollout log-probs.
      mask: ``[B, T]`` active tokens.
      advantages: ``[B]`` or ``[B, T]``; a response is negative when the mean of its active
        tokens' advantages is < 0.
      delta: δ ≥ 0.

    Example:
      >>> opsm(jnp.log(jnp.array([[0.5, 0.5], [0.5, 0.5]])), jnp.zeros((2, 2)),
      ...      jnp.ones((2, 2), bool), jnp.array([-1.0, 1.0]), delta=0.1).tolist()
      [[0.0, 0.0], [1.0, 1.0]]
    """
    _base.check_hparam("delta", delta, low=0.0)
    logp, behavior_logp, mask = _inputs("logp", logp, "behavior_logp", behavior_logp, mask)
    adv = _base.check_float("advantages", advantages)
    if adv.shape == mask.shape[:1]:
        adv = jnp.broadcast_to(adv[:, None], mask.shape)
    elif adv.shape != mask.shape:
        raise ValueError(
            f"`advantages` must have shape {mask.shape[:1]} or {mask.shape}, got {adv.shape}."
        )
    adv = jnp.where(mask, jax.lax.stop_gradient(adv), 0.0)
    s, n = _sequence_log_ratio_sum(behavior_logp, logp, mask)
    negative = jnp.sum(adv, axis=1) < 0
    drop = negative & (s / jnp.maximum(n, 1.0) > delta)
    return jnp.where(mask & ~drop[:, None], 1.0, 0.0)
