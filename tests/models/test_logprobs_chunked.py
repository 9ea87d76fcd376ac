"""Chunked log-probs (``chunked_logprobs``, ``token_logprobs(chunk_size=)``): equal to the full
[B, T, V] computation in values, entropies and gradients, with and without support replay, at a
temperature ≠ 1; bfloat16 hidden states scored with float32 accumulation; compiled temp memory far
below B·T·V·4 bytes; bad chunk sizes rejected."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sat_jax.models import (
    ModelConfig,
    apply_support_cutoff,
    chunked_logprobs,
    graphdef_for,
    init_model,
    scale_logits,
    token_logprobs,
)
from sat_jax.sampling.truncation import support_cutoff

TEMP = 0.7


def full_logprobs(hidden, w, targets, cutoffs, temperature):
    """The reference: all [B, n, V] logits at once, as ``token_logprobs``' full path."""
    scaled = scale_logits(jnp.einsum("bnd,dv->bnv", hidden, w), temperature)
    if cutoffs is not None:
        scaled = apply_support_cutoff(scaled, cutoffs, keep=targets)
    log_probs = jax.nn.log_softmax(scaled, axis=-1)
    logp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    p = jnp.exp(log_probs)
    return logp, -jnp.sum(p * jnp.where(p > 0, log_probs, 0.0), axis=-1)


def weighted(fn):
    """A scalar touching every output with distinct weights, so gradients see logp and entropy."""

    def loss(hidden, w, *args):
        logp, ent = fn(hidden, w, *args)
        a = jnp.linspace(0.5, 1.5, logp.size).reshape(logp.shape)
        return jnp.sum(a * logp) + 0.3 * jnp.sum(a[::-1] * ent)

    return loss


@pytest.fixture(scope="module")
def core_inputs():
    b, n, d, v = 2, 9, 16, 50
    k = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(k[0], (b, n, d))
    w = 0.5 * jax.random.normal(k[1], (d, v))
    targets = jax.random.randint(k[2], (b, n), 0, v)
    # Top-p 0.8 cut-offs of the very logits being scored, as the sampler records them.
    cutoffs = support_cutoff(scale_logits(jnp.einsum("bnd,dv->bnv", hidden, w), TEMP), top_p=0.8)
    assert bool(jnp.all(jnp.isfinite(cutoffs)))  # truncation is active at every position
    return hidden, w, targets, cutoffs


def test_hand_computed_values():
    # W = I: logits are the hidden states. Scaled by T = 2: ℓ̃ = [0, 0, ln 2], π = [¼, ¼, ½].
    hidden = jnp.array([[[0.0, 0.0, 2 * math.log(2)]] * 2])  # [1, 2, 3]
    w = jnp.eye(3)
    targets = jnp.array([[2, 0]])
    logp, ent = chunked_logprobs(hidden, w, targets, temperature=2.0, chunk_size=1)
    np.testing.assert_allclose(logp, [[math.log(0.5), math.log(0.25)]], rtol=1e-6)
    np.testing.assert_allclose(ent, [[1.5 * math.log(2)] * 2], rtol=1e-6)
    # Cut-off ½ ln 2 keeps {2}; position 1's target 0 is kept as well: π = [⅓, 0, ⅔] there.
    cut = jnp.full((1, 2), 0.5 * math.log(2))
    logp, ent = chunked_logprobs(hidden, w, targets, cutoffs=cut, temperature=2.0, chunk_size=1)
    np.testing.assert_allclose(logp, [[0.0, math.log(1 / 3)]], atol=1e-6)
    np.testing.assert_allclose(ent, [[0.0, math.log(3) - 2 / 3 * math.log(2)]], atol=1e-6)


@pytest.mark.parametrize("replay", [False, True], ids=["no-cutoff", "top-p"])
def test_core_equals_full_values_and_gradients(core_inputs, replay):
    hidden, w, targets, cutoffs = core_inputs
    cutoffs = cutoffs if replay else None
    ref = full_logprobs(hidden, w, targets, cutoffs, TEMP)
    ref_grads = jax.grad(weighted(full_logprobs), argnums=(0, 1))(hidden, w, targets, cutoffs, TEMP)
    chex.assert_tree_all_finite(ref_grads)
    for chunk in (1, 4, 32):  # 4 does not divide n = 9; 32 ≥ n is one chunk

        def chunked(h, w_, y, cut, t, chunk=chunk):
            return chunked_logprobs(h, w_, y, cutoffs=cut, temperature=t, chunk_size=chunk)

        def both(*args, chunked=chunked):
            return weighted(chunked)(*args), chunked(*args)

        (_, got), grads = jax.jit(jax.value_and_grad(both, argnums=(0, 1), has_aux=True))(
            hidden, w, targets, cutoffs, TEMP
        )
        chex.assert_trees_all_close(got + grads, ref + ref_grads, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def lm():
    cfg = ModelConfig.tiny(num_layers=1)
    graphdef, params = init_model(cfg, seed=1)
    # Sharper logits than the 0.02 init gives, so that top-p actually truncates.
    params["lm_head"]["kernel"] = nnx.Param(params["lm_head"]["kernel"][...] * 50.0)
    tokens = jax.random.randint(jax.random.key(5), (2, 12), 0, cfg.vocab_size)
    mask = jnp.ones(tokens.shape, bool).at[1, :2].set(False)  # row 1 left-padded
    tokens = jnp.where(mask, tokens, 0)
    return cfg, graphdef, params, tokens, mask


def test_return_hidden_and_head_weight_give_the_logits(lm):
    cfg, graphdef, params, tokens, mask = lm

    @jax.jit
    def run(params):
        model = nnx.merge(graphdef, params)
        full = model(tokens, input_mask=mask, logits_from=3)
        out = model(tokens, input_mask=mask, logits_from=3, return_hidden=True)
        return full, out, model.lm_head_weight()

    full, out, w = run(params)
    assert out.logits is None and full.hidden is None
    chex.assert_shape(out.hidden, (2, 9, cfg.hidden_size))
    chex.assert_type(out.hidden, jnp.float32)
    chex.assert_shape(w, (cfg.hidden_size, cfg.vocab_size))
    chex.assert_trees_all_equal(w, params["lm_head"]["kernel"][...])
    chex.assert_trees_all_close(out.hidden @ w, full.logits, rtol=1e-7, atol=1e-5)
    chex.assert_trees_all_equal(out.routing, full.routing)
    # Tied embeddings: the head is embed_tokensᵀ (the same parameters, less lm_head).
    tied_params = nnx.State({k: v for k, v in params.items() if k != "lm_head"})
    tied = nnx.merge(graphdef_for(cfg.replace(tie_embeddings=True)), tied_params)
    chex.assert_trees_all_equal(tied.lm_head_weight(), params["embed_tokens"][...].T)
    # The hidden states come in the compute dtype.
    bf16 = jax.eval_shape(
        lambda p: (
            nnx.merge(graphdef_for(cfg.replace(dtype=jnp.bfloat16)), p)(
                tokens, return_hidden=True
            ).hidden
        ),
        params,
    )
    chex.assert_shape(bf16, (2, 12, cfg.hidden_size))
    chex.assert_type(bf16, jnp.bfloat16)


def test_token_logprobs_chunked_equals_full_in_params_gradient(lm):
    cfg, graphdef, params, tokens, mask = lm
    s = 3
    n = tokens.shape[1] - s
    logits = nnx.merge(graphdef, params)(
        tokens[:, :-1], input_mask=mask[:, :-1], logits_from=s - 1
    ).logits
    cutoffs = support_cutoff(scale_logits(logits, TEMP), top_p=0.8)
    chex.assert_tree_all_finite(cutoffs)

    def loss(p, chunk_size):
        logp, ent, _ = token_logprobs(
            graphdef,
            p,
            tokens,
            input_mask=mask,
            response_start=s,
            cutoffs=cutoffs,
            temperature=TEMP,
            chunk_size=chunk_size,
        )
        a = jnp.linspace(0.5, 1.5, logp.size).reshape(logp.shape)
        return jnp.sum(a * logp) + 0.3 * jnp.sum(ent), (logp, ent)

    run = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, ref), ref_grads = run(params, None)
    chex.assert_shape(ref[0], (2, n))
    for chunk in (4, 64):  # non-dividing, and one chunk bigger than n
        (_, got), grads = run(params, chunk)
        chex.assert_trees_all_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
        chex.assert_trees_all_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
        chex.assert_trees_all_close(grads, ref_grads, rtol=1e-4, atol=1e-6)


def test_bfloat16_states_are_scored_with_float32_accumulation(core_inputs):
    hidden, w, targets, _ = core_inputs
    h16 = (4.0 * hidden).astype(jnp.bfloat16)  # logits of a few units, where bf16 rounds by ~1e-2
    # Same inputs (the bf16 values, the bf16-rounded head) in float32: what exact arithmetic gives.
    w16 = w.astype(jnp.bfloat16).astype(jnp.float32)
    ref = full_logprobs(h16.astype(jnp.float32), w16, targets, None, TEMP)
    got = chunked_logprobs(h16, w, targets, temperature=TEMP, chunk_size=4)
    chex.assert_trees_all_close(got[0], ref[0], rtol=1e-7, atol=1e-4)
    chex.assert_trees_all_close(got[1], ref[1], rtol=1e-7, atol=1e-4)
    # Rounding the logits to bf16 (what a bf16 head without float32 output does) is far off.
    rounded = scale_logits(jnp.einsum("bnd,dv->bnv", h16, w.astype(jnp.bfloat16)), TEMP)
    lp16 = jnp.take_along_axis(jax.nn.log_softmax(rounded), targets[..., None], -1)[..., 0]
    assert float(jnp.max(jnp.abs(lp16 - ref[0]))) > 1e-3


def test_compiled_temp_memory_is_per_chunk_not_per_sequence():
    b, n, d, v, chunk = 4, 512, 64, 32768, 16
    args = (
        jax.ShapeDtypeStruct((b, n, d), jnp.float32),
        jax.ShapeDtypeStruct((d, v), jnp.float32),
        jax.ShapeDtypeStruct((b, n), jnp.int32),
        jax.ShapeDtypeStruct((b, n), jnp.float32),
    )

    def temp_bytes(fn):
        step = jax.jit(jax.grad(weighted(fn), argnums=(0, 1)))
        return step.lower(*args).compile().memory_analysis().temp_size_in_bytes

    logits_bytes = b * n * v * 4  # one [B, n, V] float32: 256 MiB
    chunk_bytes = b * chunk * v * 4  # one [B, chunk, V] float32: 8 MiB
    full = temp_bytes(lambda h, w, y, c: full_logprobs(h, w, y, c, TEMP))
    chunked = temp_bytes(
        lambda h, w, y, c: chunked_logprobs(h, w, y, cutoffs=c, temperature=TEMP, chunk_size=chunk)
    )
    assert full >= logits_bytes
    # A few [B, chunk, V] buffers plus ∂W [d, V] (8 MiB), against several [B, n, V] for the full.
    assert chunked < 6 * chunk_bytes + 2 * d * v * 4, (chunked, full)
    assert chunked < logits_bytes / 4, (chunked, full)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "4", None])
def test_bad_chunk_size_raises_naming_it(core_inputs, lm, bad):
    hidden, w, targets, _ = core_inputs
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs(hidden, w, targets, chunk_size=bad)
    if bad is not None:  # None is the full path of token_logprobs
        _, graphdef, params, tokens, _ = lm
        with pytest.raises(ValueError, match="chunk_size"):
            token_logprobs(graphdef, params, tokens, chunk_size=bad)


def test_bad_shapes_raise_naming_the_argument(core_inputs):
    hidden, w, targets, cutoffs = core_inputs
    with pytest.raises(ValueError, match="head_weight"):
        chunked_logprobs(hidden, w[1:], targets, chunk_size=4)
    with pytest.raises(ValueError, match="targets"):
        chunked_logprobs(hidden, w, targets[:, 1:], chunk_size=4)
    with pytest.raises(ValueError, match="targets"):
        chunked_logprobs(hidden, w, targets.at[0, 0].set(w.shape[1]), chunk_size=4)
    with pytest.raises(ValueError, match="cutoffs"):
        chunked_logprobs(hidden, w, targets, cutoffs=cutoffs[:, 1:], chunk_size=4)
    with pytest.raises(ValueError, match="hidden"):
        chunked_logprobs(hidden[0], w, targets, chunk_size=4)


def test_vmaps_over_a_leading_run_axis(core_inputs):
    # The trainer vmaps its step over stacked runs; the chunked path must batch like the full one.
    hidden, w, targets, cutoffs = core_inputs
    ws = jnp.stack([w, 2.0 * w])

    def one(w_):
        return chunked_logprobs(
            hidden, w_, targets, cutoffs=cutoffs, temperature=TEMP, chunk_size=4
        )

    got = jax.vmap(one)(ws)
    for i in range(2):
        ref = full_logprobs(hidden, ws[i], targets, cutoffs, TEMP)
        chex.assert_trees_all_close(got[0][i], ref[0], rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(got[1][i], ref[1], rtol=1e-5, atol=1e-6)
