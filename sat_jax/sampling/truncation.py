"""Top-k / top-p truncation expressed as one cut-off per position (support replay, Eq. 50).

The kept set of a position is always "every token whose scaled logit ≥ cutoff": the sampler samples
from exactly that set and records the cutoff, and the trainer rebuilds the same set with
``sat_jax.models.apply_support_cutoff``. No [B, T, V] mask is ever stored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def support_cutoff(
    scaled_logits: jax.Array,
    top_p: float | jax.Array = 1.0,
    top_k: int | jax.Array = 0,
) -> jax.Array:
    """Cut-off c [...] such that the truncated support is T = {a : ℓ̃(a) ≥ c}.

    With ℓ̃ sorted in decreasing order ℓ̃_(1) ≥ ℓ̃_(2) ≥ … and p_(i) the softmax of the top-k entries
    (renormalised over them, as vLLM and Hugging Face apply top-k before top-p), the number kept is

        n = min(k, #{i : Σ_{j<i} p_(j) < top_p}),   c = (ℓ̃_(n) + ℓ̃_(n+1)) / 2,

    i.e. the smallest prefix whose mass reaches top_p (at least one token), never more than k, and
    c the midpoint of the gap after it, so that a replay under slightly different numerics keeps
    the same set unless a logit moves by more than half the gap. Tokens tied with ℓ̃_(n) are all
    kept (then c = ℓ̃_(n)), so T can exceed n on exact ties; the sampler and the trainer both use
    "≥ c", so they agree. Returns −∞ (no truncation) when top_p ≥ 1 and top_k is off, or when
    nothing is cut.

    Args:
      scaled_logits: [..., V] float32, logits already divided by the temperature.
      top_p: nucleus mass in (0, 1]; 1 disables it. Scalar (may be traced).
      top_k: keep at most k tokens; k ≤ 0 or k ≥ V disables it. Scalar (may be traced).
    """
    x = scaled_logits.astype(jnp.float32)
    v = x.shape[-1]
    top_p = jnp.asarray(top_p, jnp.float32)
    top_k = jnp.asarray(top_k, jnp.int32)
    k_on = (top_k > 0) & (top_k < v)
    k_eff = jnp.where(k_on, top_k, v)
    ranked = -jnp.sort(-x, axis=-1)  # decreasing
    rank = jnp.arange(v).reshape((1,) * (x.ndim - 1) + (v,))
    in_k = rank < k_eff
    probs = jax.nn.softmax(jnp.where(in_k, ranked, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(in_k & (mass_before < top_p), axis=-1), 1)
    last_kept = jnp.take_along_axis(ranked, (n_keep - 1)[..., None], axis=-1)[..., 0]
    first_dropped = jnp.take_along_axis(ranked, jnp.minimum(n_keep, v - 1)[..., None], axis=-1)[
        ..., 0
    ]
    # The midpoint of the gap, not the last kept logit itself: a trainer whose logits differ by
    # rounding (another matmul order, another dtype) then rebuilds the same set.
    cutoff = 0.5 * last_kept + 0.5 * first_dropped
    truncating = (k_on | (top_p < 1.0)) & (n_keep < v)
    return jnp.where(truncating, cutoff, -jnp.inf)
