"""Shared prompts (``shared_prefix=(G, P)``): each group of G rows runs its common first P
positions once. The layout maps by hand; the model, ``token_logprobs`` (values, gradients, R3,
support replay, chunked, dense blocks) and the sampler's grouped prefill against the plain
path; the batch check; bad input."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sat_jax.models import ModelConfig, graphdef_for, init_model, token_logprobs
from sat_jax.models.transformer import expand_rows, unique_rows
from sat_jax.rl.batch import RolloutBatch
from sat_jax.sampling import Sampler, SamplingParams

G, PROMPTS, P, N = 4, 2, 5, 3  # 2 prompts × 4 samples; 5 prompt slots, 3 response tokens
B, T = G * PROMPTS, P + N


@pytest.fixture(scope="module", params=["moe", "with_dense_block"])
def model(request):
    over = {} if request.param == "moe" else {"mlp_only_layers": (1,)}
    cfg = ModelConfig.tiny(num_layers=2, **over)
    return cfg, *init_model(cfg, seed=0)


def _grouped_batch(cfg, seed=0):
    """Two prompts (the second left-padded by 2 slots) × G samples with different responses."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    prompts = np.asarray(jax.random.randint(k1, (PROMPTS, P), 2, cfg.vocab_size))
    prompt_mask = np.ones((PROMPTS, P), bool)
    prompt_mask[1, :2] = False
    prompts = np.where(prompt_mask, prompts, 0)
    responses = np.asarray(jax.random.randint(k2, (B, N), 2, cfg.vocab_size))
    tokens = np.concatenate([np.repeat(prompts, G, axis=0), responses], axis=1)
    mask = np.concatenate([np.repeat(prompt_mask, G, axis=0), np.ones((B, N), bool)], axis=1)
    mask[B - 1, T - 1] = False  # one response ends early
    return jnp.asarray(np.where(mask, tokens, 0)), jnp.asarray(mask)


def test_layout_by_hand():
    # B 4 = 2 groups of 2, T 3, P 2: row r holds 10·r + t.
    a = jnp.arange(4)[:, None] * 10 + jnp.arange(3)[None, :]
    u = unique_rows(a, (2, 2))
    np.testing.assert_array_equal(u, [[0, 1, 2, 12], [20, 21, 22, 32]])
    back = expand_rows(u, (2, 2), 3)
    np.testing.assert_array_equal(back, [[0, 1, 2], [0, 1, 12], [20, 21, 22], [20, 21, 32]])
    # Trailing axes ride along; the transpose of the expansion sums the group's prefix cotangents.
    v = jnp.ones((2, 4, 3))
    g = jax.grad(lambda v: jnp.sum(expand_rows(v, (2, 2), 3) * jnp.arange(4.0)[:, None, None]))(v)
    chex.assert_trees_all_equal(g[0, :2], 0.0 + 1.0)  # rows 0 and 1 of group 0: weights 0 + 1
    chex.assert_trees_all_equal(g[1, :2], 2.0 + 3.0)
    np.testing.assert_array_equal(g[:, 2, 0], [0.0, 2.0])
    np.testing.assert_array_equal(g[:, 3, 0], [1.0, 3.0])


def test_forward_equals_plain_layout(model):
    cfg, graphdef, params = model
    tokens, mask = _grouped_batch(cfg)
    m = nnx.merge(graphdef, params)
    fresh = m(tokens, input_mask=mask)
    shared = m(tokens, input_mask=mask, shared_prefix=(G, P))
    chex.assert_trees_all_close(shared.logits, fresh.logits, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_equal(shared.routing, fresh.routing)
    chex.assert_trees_all_close(shared.load_balancing_loss, fresh.load_balancing_loss, rtol=1e-5)
    # Replaying the captured routing (R3) through the shared layout: the same logits again.
    replay = m(tokens, input_mask=mask, routing=fresh.routing, shared_prefix=(G, P))
    chex.assert_trees_all_close(replay.logits, fresh.logits, rtol=1e-5, atol=1e-5)
    # Attention in chunks of 2 queries (the 5 prefix and 3 own positions both padded).
    chunked = nnx.merge(graphdef_for(cfg.replace(attention_chunk=2)), params)
    chex.assert_trees_all_close(
        chunked(tokens, input_mask=mask, shared_prefix=(G, P)).logits,
        fresh.logits,
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_token_logprobs_values_and_gradients(model, chunk_size):
    cfg, graphdef, params = model
    tokens, mask = _grouped_batch(cfg, seed=1)
    m = nnx.merge(graphdef, params)
    routing = m(tokens[:, :-1], input_mask=mask[:, :-1]).routing
    # Support replay: a cut-off midway between the 20th and 21st largest logit of the plain pass
    # (not at a logit, which float rounding would put on either side).
    logits = jnp.sort(m(tokens[:, :-1], input_mask=mask[:, :-1], logits_from=P - 1).logits, -1)
    cutoffs = 0.5 * (logits[..., -20] + logits[..., -21])

    def loss(p, shared_prefix):
        logp, ent, _ = token_logprobs(
            graphdef,
            p,
            tokens,
            input_mask=mask,
            response_start=P,
            routing=routing,
            cutoffs=cutoffs,
            chunk_size=chunk_size,
            shared_prefix=shared_prefix,
        )
        w = mask[:, P:]
        return jnp.sum(jnp.where(w, logp, 0.0)) + 0.1 * jnp.sum(jnp.where(w, ent, 0.0)), logp

    # Jitted: op by op, two backward passes through the MoE take most of a minute on CPU.
    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (l0, lp0), g0 = grad(params, None)
    (l1, lp1), g1 = grad(params, (G, P))
    chex.assert_trees_all_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(l1, l0, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        scale = float(jnp.max(jnp.abs(b))) + 1e-12
        chex.assert_trees_all_close(a / scale, b / scale, rtol=1e-7, atol=2e-5)
    # Every parameter receives gradient in both layouts (the router too).
    assert all(float(jnp.max(jnp.abs(a))) > 0 for a in jax.tree.leaves(g1))


def test_bad_shared_prefix(model):
    cfg, graphdef, params = model
    tokens, mask = _grouped_batch(cfg)
    m = nnx.merge(graphdef, params)
    for bad, match in [
        ((3, P), "divisor of the batch"),
        ((G, T + 1), r"prefix_len must lie"),
        ([G, P], "tuple"),
        ((G, 2.0), "tuple"),
        ((0, P), "divisor"),
    ]:
        with pytest.raises(ValueError, match=match):
            m(tokens, input_mask=mask, shared_prefix=bad)
    # (1, P) and (G, 0) share nothing: the plain path.
    plain = m(tokens, input_mask=mask).logits
    chex.assert_trees_all_equal(m(tokens, input_mask=mask, shared_prefix=(1, P)).logits, plain)
    chex.assert_trees_all_equal(m(tokens, input_mask=mask, shared_prefix=(G, 0)).logits, plain)


def _batch(tokens, mask, routing):
    n = tokens.shape[1] - P
    z = np.zeros((tokens.shape[0], n), np.float32)
    return RolloutBatch(
        tokens=np.asarray(tokens),
        input_mask=np.asarray(mask),
        response_mask=np.asarray(mask)[:, P:],
        behavior_logp=z,
        cutoffs=z,
        routing=np.asarray(routing),
        versions=z.astype(np.int32),
        advantages=z[:, 0],
        rewards=z[:, 0],
    )


def test_batch_shares_prompt(model):
    cfg, graphdef, params = model
    tokens, mask = _grouped_batch(cfg)
    routing = nnx.merge(graphdef, params)(tokens[:, :-1], input_mask=mask[:, :-1]).routing
    batch = _batch(tokens, mask, routing)
    assert batch.shares_prompt(G, P)
    assert not batch.shares_prompt(3, P)  # 8 rows are not groups of 3
    assert not batch.shares_prompt(G, T)  # the last token is never fed
    assert not batch.shares_prompt(2 * G, P)  # the two prompts differ
    assert batch.shares_prompt(G, P + 1) is False  # responses differ at slot P
    flipped = np.asarray(routing).copy()
    flipped[0, 1, P - 1, 0] = (flipped[0, 1, P - 1, 0] + 1) % cfg.num_experts
    assert not _batch(tokens, mask, flipped).shares_prompt(G, P)
    assert _batch(tokens, mask, flipped).shares_prompt(G, P, routing=False)
    other = np.asarray(tokens).copy()
    other[G + 1, P - 1] += 1  # a prompt token of row 1 of group 1
    assert not _batch(other, mask, routing).shares_prompt(G, P)


def test_sampler_grouped_prefill():
    cfg = ModelConfig.tiny(num_layers=2)
    _, params = init_model(cfg, seed=1)
    sampler = Sampler(cfg, max_prompt_len=P, max_new_tokens=N, eos_id=1)  # float32 engine
    prompts = np.asarray(jax.random.randint(jax.random.key(2), (PROMPTS, P), 2, cfg.vocab_size))
    lengths = np.array([P, P - 2])
    rows, row_lengths = np.repeat(prompts, G, axis=0), np.repeat(lengths, G)
    key, sp = jax.random.key(5), SamplingParams(1.0, top_p=0.9)
    plain = sampler.generate(params, rows, row_lengths, key, sp)
    grouped = sampler.generate(params, rows, row_lengths, key, sp, group_size=G)
    chex.assert_trees_all_equal(grouped.tokens, plain.tokens)
    chex.assert_trees_all_equal(grouped.routing, plain.routing)
    chex.assert_trees_all_close(grouped.behavior_logp, plain.behavior_logp, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(grouped.cutoffs, plain.cutoffs, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="must divide"):
        sampler.init(params, rows, row_lengths, key, sp, group_size=3)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        sampler.init(params, rows, row_lengths, key, sp, group_size=0)
    mixed = rows.copy()
    mixed[G + 2, 0] += 1
    with pytest.raises(ValueError, match=rf"rows {G}\.\.{2 * G - 1} of prompts"):
        sampler.init(params, mixed, row_lengths, key, sp, group_size=G)
