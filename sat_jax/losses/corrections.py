"""Token-level importance corrections (Appendix E.3): detached weights for ``token_weights=``.

Each returns a ``[B, T]`` float32 array, zero on masked positions, with no gradient. Compose with
any objective: ``losses.ppo(..., token_weights=losses.tis(old_logp, behavior_logp, mask))``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sat_jax.losses import _base
from sat_jax.losses.objectives import bernoulli_kl


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
