"""Trainer-side log-probabilities: the differentiable path that consumes rollout records.

One place defines how logits become a sampling distribution, and both the sampler and the trainer
call it, so that temperature and truncation are applied identically:

    ℓ̃ = logits / temperature                        (float32)
    ℓ̃(a) ← −∞  where ℓ̃(a) < cutoff                  (support replay, Eq. 50)
    π(a | s) = softmax(ℓ̃)(a)

The log-prob of the sampled token needs only one entry of each row, so ``chunked_logprobs`` never
builds the [B, T, V] logits: it runs the LM head and the log-softmax over chunks of positions under
``lax.scan``, each chunk wrapped in ``jax.checkpoint`` so that the backward pass recomputes the
chunk's logits instead of storing them. Peak memory is O(B · chunk · V), not O(B · T · V).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sat_jax import _checks


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
    # −Σ p log p with 0·(−∞) := 0 for tokens outside the support. The −∞ is replaced before the
    # product (not after), so that its gradient is 0 rather than 0·∞ = NaN.
    return -jnp.sum(p * jnp.where(p > 0, log_probs, 0.0), axis=-1)


def _check_chunk_size(chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
        raise ValueError(f"chunk_size must be a positive Python int, got {chunk_size!r}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive Python int, got {chunk_size}")
    return int(chunk_size)


def chunked_logprobs(
    hidden: jax.Array,
    head_weight: jax.Array,
    targets: jax.Array,
    *,
    cutoffs: jax.Array | None = None,
    temperature: float | jax.Array = 1.0,
    chunk_size: int,
) -> tuple[jax.Array, jax.Array]:
    """log π(y | s) and entropy from hidden states, chunk by chunk, never holding [B, n, V].

    For each position i (h_i the final-normed hidden state, W the LM head [d, V]):

        ℓ_i = h_i · W                              (compute dtype of h, float32 accumulation)
        ℓ̃_i = scale_logits(ℓ_i, temperature), then support replay (Eq. 50) with y_i kept
        logp_i = log softmax(ℓ̃_i)(y_i),   entropy_i = −Σ_a π(a) log π(a)

    exactly as ``token_logprobs``' full path, but over chunks of ``chunk_size`` positions inside
    ``lax.scan``, each chunk under ``jax.checkpoint``: the backward pass recomputes one chunk's
    logits at a time (and accumulates ∂W in float32 across chunks), so peak memory is
    O(B · chunk_size · V) instead of O(B · n · V). Chunks run along the sequence axis and keep the
    batch axis whole, so a batch sharded over devices stays sharded. When n is not a multiple of
    ``chunk_size`` the tail is padded (zero states, −∞ cut-offs) and the padded columns dropped;
    ``chunk_size ≥ n`` is one chunk.

    Choosing ``chunk_size``: memory is a few (about 4 under ``grad``, 6 under ``value_and_grad`` on
    XLA:CPU) float32 [B, chunk_size, V] buffers plus ∂W [d, V]; every chunk also re-reads W and
    adds into ∂W, so keep B · chunk_size at a few hundred tokens or more, where that traffic is
    small next to the chunk's matmuls (``benchmarks/logprobs.py``).

    Args:
      hidden: [B, n, d] float hidden states (``Transformer(..., return_hidden=True).hidden``).
      head_weight: [d, V] float output projection (``Transformer.lm_head_weight()``); cast to
        ``hidden.dtype`` for the matmul.
      targets: [B, n] int token ids in [0, V) to score.
      cutoffs: [B, n] float32 support cut-offs per position (Eq. 50), −∞ = no truncation; None
        keeps the whole vocabulary. The target is always kept.
      temperature: logits are divided by it (as ``scale_logits``) before everything else.
      chunk_size: positions per chunk, a positive Python int.
    Returns:
      logp: [B, n] float32; entropy: [B, n] float32.
    """
    chunk_size = _check_chunk_size(chunk_size)
    _checks.check_rank("hidden", hidden, 3)
    _checks.check_rank("head_weight", head_weight, 2)
    b, n, d = hidden.shape
    if n == 0:
        raise ValueError(f"hidden must hold at least one position, got shape {hidden.shape}")
    _checks.check_shape("head_weight", head_weight, (d, None))
    _checks.check_shape("targets", targets, (b, n))
    _checks.check_integer("targets", targets)
    _checks.check_token_ids("targets", targets, head_weight.shape[1])
    if cutoffs is not None:
        _checks.check_shape("cutoffs", cutoffs, (b, n))

    c = min(chunk_size, n)
    num_chunks = -(-n // c)
    pad = num_chunks * c - n
    targets = targets.astype(jnp.int32)
    if cutoffs is not None:
        cutoffs = cutoffs.astype(jnp.float32)
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        if cutoffs is not None:
            cutoffs = jnp.pad(cutoffs, ((0, 0), (0, pad)), constant_values=-jnp.inf)

    def by_chunk(x):  # [B, num_chunks·c, ...] → [num_chunks, B, c, ...], the scan axis first
        return jnp.moveaxis(x.reshape((b, num_chunks, c) + x.shape[2:]), 1, 0)

    xs = (by_chunk(hidden), by_chunk(targets), None if cutoffs is None else by_chunk(cutoffs))
    temperature = jnp.asarray(temperature, jnp.float32)

    # prevent_cse=False: inside scan, CSE cannot merge the recomputation with the forward pass.
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one_chunk(w, temp, h, y, cut):
        # The cast sits inside the chunk, so ∂W is accumulated across chunks in W's float32.
        logits = jax.lax.dot_general(
            h, w.astype(h.dtype), (((2,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        scaled = scale_logits(logits, temp)
        if cut is not None:
            scaled = apply_support_cutoff(scaled, cut, keep=y)
        log_probs = jax.nn.log_softmax(scaled, axis=-1)
        logp = jnp.take_along_axis(log_probs, y[..., None], axis=-1)[..., 0]
        return logp, _entropy(log_probs)

    def body(carry, x):
        return carry, one_chunk(head_weight, temperature, *x)

    _, (logp, entropy) = jax.lax.scan(body, None, xs)

    def unchunk(x):  # [num_chunks, B, c] → [B, n]
        return jnp.moveaxis(x, 0, 1).reshape(b, num_chunks * c)[:, :n]

    return unchunk(logp), unchunk(entropy)


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
    chunk_size: int | None = None,
    shared_prefix: tuple[int, int] | None = None,
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
    ``response_start`` and ``chunk_size`` must be Python ints (mark them static under ``jax.jit``).

    ``chunk_size=None`` materialises the [B, T − s, V] logits (float32) and takes one log-softmax.
    An int computes the same quantities with ``chunked_logprobs`` from the model's hidden states,
    ``chunk_size`` positions at a time with recomputation in the backward pass: peak memory
    O(B · chunk_size · V). Values and gradients agree with the full path (to float32 rounding);
    in bfloat16 compute the chunked path is the more accurate one, since its head matmul
    accumulates and returns float32 where the full path rounds the logits to bfloat16.

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
      chunk_size: None (full logits) or positions per chunk, a positive Python int.
      shared_prefix: static ``(G, P)`` or None: the rows come in groups of G whose first P fed
        tokens (prompt slots, masks and replayed routing) are identical, as a GRPO batch's G
        samples of a prompt with ``P = response_start`` are; every block then runs those
        positions once per group (``Transformer.__call__``). Same values and gradients.
    Returns:
      logp: [B, T − s] float32.
      entropy: [B, T − s] float32, entropy of the (replayed-support) distribution at each position.
      aux: ``routing`` used [num_moe_layers, B, T − 1, k], ``router_top_k`` (the model's own
        top-k there, replay or not), ``load_balancing_loss`` (Switch loss on
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
    if chunk_size is not None:
        chunk_size = _check_chunk_size(chunk_size)

    model = nnx.merge(graphdef, params)
    _checks.check_token_ids("tokens", tokens, model.config.vocab_size, where=input_mask)
    out = model(
        tokens[:, :-1],
        input_mask=input_mask[:, :-1],
        routing=routing,
        logits_from=response_start - 1,
        return_hidden=chunk_size is not None,
        shared_prefix=shared_prefix,
    )
    targets = tokens[:, response_start:]
    if chunk_size is None:
        scaled = scale_logits(out.logits, temperature)  # [B, n, V]
        if cutoffs is not None:
            scaled = apply_support_cutoff(scaled, cutoffs.astype(jnp.float32), keep=targets)
        log_probs = jax.nn.log_softmax(scaled, axis=-1)
        logp = jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32), axis=-1)
        logp, entropy = logp[..., 0], _entropy(log_probs)
    else:
        # Ids under input_mask were checked above; padding slots may hold any id, so clamp them
        # rather than let chunked_logprobs' own range check reject them.
        vocab = model.config.vocab_size
        logp, entropy = chunked_logprobs(
            out.hidden,
            model.lm_head_weight(),
            jnp.clip(targets, 0, vocab - 1),
            cutoffs=cutoffs,
            temperature=temperature,
            chunk_size=chunk_size,
        )
    aux = {
        "routing": out.routing,
        "router_top_k": out.router_top_k,
        "load_balancing_loss": out.load_balancing_loss,
        "aux_loss": model.config.router_aux_loss_coef * out.load_balancing_loss,
    }
    return logp, entropy, aux
