"""Trainer-side log-probabilities: the differentiable path that consumes rollout records.

One place defines how logits become a sampling distribution, and both the sampler and the trainer
call it, so that temperature and truncation are applied identically:

    ℓ̃ = logits / temperature                        (float32)
    ℓ̃(a) ← −∞  where ℓ̃(a) < cutoff                  (support replay, Eq. 50)
    π(a | s) = softmax(ℓ̃)(a)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sat_jax.models import _checks


def scale_logits(logits: jax.Array, temperature: float | jax.Array) -> jax.Array:
    """ℓ̃ = float32(logits) / temperature. The only place temperature is applied."""
    return logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)


def apply_support_cutoff(
    scaled_logits: jax.Array, cutoff: jax.Array, keep: jax.Array | None = None
) -> jax.Array:
    """Support replay (Eq. 50): ℓ̃(a) ← −∞ where ℓ̃(a) < cutoff.

    The rollout's kept set T is "all tokens whose scaled logit ≥ cutoff" (see
    ``sat_jax.sampling.support_cutoff``), so one float per position replays it exactly. A cutoff of
    −∞ keeps the whole vocabulary.

    Args:
      scaled_logits: [..., V] float32 (after temperature).
      cutoff: [...] float32.
      keep: optional int [...] token ids that stay in the support whatever their logit. The trainer
        passes the sampled token: under different numerics (bf16 engine, f32 trainer) the sampled
        token can fall a hair below the cutoff, which would otherwise give log π = −∞.
    """
    inside = scaled_logits >= cutoff[..., None]
    if keep is not None:
        vocab = jnp.arange(scaled_logits.shape[-1]).reshape((1,) * keep.ndim + (-1,))
        inside = inside | (vocab == keep[..., None])
    return jnp.where(inside, scaled_logits, -jnp.inf)


def _entropy(log_probs: jax.Array) -> jax.Array:
    p = jnp.exp(log_probs)
    # −Σ p log p with 0·(−∞) := 0 for tokens outside the support.
    return -jnp.sum(jnp.where(p > 0, p * log_probs, 0.0), axis=-1)


def token_logprobs(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokens: jax.Array,
    *,
    input_mask: jax.Array | None = None,
    response_start: int = 1,
    routing: jax.Array | None = None,
    cutoffs: jax.Array | None = None,
    temperature: float | jax.Array = 1.0,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Per-token log π(y_t | s_t) and entropies of a batch of sequences, differentiable in params.

    Alignment (exact, the trainer relies on it): with s = ``response_start`` and
    T = tokens.shape[1], the outputs have shape [B, T − s] and column j scores token
    ``tokens[:, s + j]`` given ``tokens[:, : s + j]``:

        logp[:, j] = log softmax(ℓ̃_{s+j−1})(tokens[:, s + j]),

    where ℓ̃_i are the (temperature-scaled, support-replayed) logits the model produces after
    reading tokens 0..i. The model is fed ``tokens[:, :-1]`` (T − 1 tokens; the last token is only
    scored). Default s = 1 is the plain next-token layout [B, T − 1]. With the sampler's output,
    pass ``response_start=out.prompt_width`` and the result lines up column for column with
    ``out.behavior_logp``, ``out.response_mask``, ``out.cutoffs`` and ``out.versions`` ([B, N]).

    Pure and jit/vmap/grad-friendly: ``graphdef`` is static (a pytree without leaves),
    ``response_start`` must be a Python int (mark it static under ``jax.jit``).

    Args:
      graphdef: from ``init_model`` / ``graphdef_for``; its config fixes compute dtype and remat.
      params: the float32 parameter ``nnx.State`` to differentiate.
      tokens: [B, T] int, T ≥ 2.
      input_mask: [B, T] bool, real tokens (prompt and response, not padding); default all.
      response_start: s, 1 ≤ s < T, first scored token index.
      routing: [num_moe_layers, B, T − 1, k] int expert indices to replay (R3, Eq. 40), one row per
        fed token (the sampler's ``out.routing``). None routes afresh.
      cutoffs: [B, T − s] float32 support cut-offs per scored token (Eq. 50), −∞ = no truncation.
        The scored token itself is always kept in the support.
      temperature: the sampler's temperature; logits are divided by it before everything else.
    Returns:
      logp: [B, T − s] float32.
      entropy: [B, T − s] float32, entropy of the (replayed-support) distribution at each position.
      aux: ``routing`` used [num_moe_layers, B, T − 1, k], ``load_balancing_loss`` (Switch loss on
        fresh top-k over real fed tokens) and ``aux_loss`` = router_aux_loss_coef × that loss.
    """
    _checks.check_rank("tokens", tokens, 2)
    _checks.check_integer("tokens", tokens)
    b, t = tokens.shape
    if t < 2:
        raise ValueError(f"tokens must hold at least 2 positions, got shape {tokens.shape}")
    if not isinstance(response_start, int) or not 1 <= response_start < t:
        raise ValueError(f"response_start must be a Python int in [1, {t}), got {response_start!r}")
    if input_mask is None:
        input_mask = jnp.ones((b, t), jnp.bool_)
    _checks.check_shape("input_mask", input_mask, (b, t))
    input_mask = input_mask.astype(jnp.bool_)
    n = t - response_start
    if cutoffs is not None:
        _checks.check_shape("cutoffs", cutoffs, (b, n))

    model = nnx.merge(graphdef, params)
    _checks.check_token_ids("tokens", tokens, model.config.vocab_size, where=input_mask)
    out = model(
        tokens[:, :-1],
        input_mask=input_mask[:, :-1],
        routing=routing,
        logits_from=response_start - 1,
    )
    scaled = scale_logits(out.logits, temperature)  # [B, n, V]
    targets = tokens[:, response_start:]
    if cutoffs is not None:
        scaled = apply_support_cutoff(scaled, cutoffs.astype(jnp.float32), keep=targets)
    log_probs = jax.nn.log_softmax(scaled, axis=-1)
    logp = jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    aux = {
        "routing": out.routing,
        "load_balancing_loss": out.load_balancing_loss,
        "aux_loss": model.config.router_aux_loss_coef * out.load_balancing_loss,
    }
    return logp, _entropy(log_probs), aux

