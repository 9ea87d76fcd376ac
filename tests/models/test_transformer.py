"""The NNX MoE decoder: KV cache vs full forward, routing capture/replay (R3), token_logprobs
alignment, padding invariance, gradients to the router, one compile per shape, bad input."""

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from sat_jax.models import (
    ModelConfig,
    init_cache,
    init_model,
    param_count,
    positions_from_mask,
    token_logprobs,
)

B, T = 2, 10


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.tiny(num_layers=2)


@pytest.fixture(scope="module")
def model(cfg):
    return init_model(cfg, seed=0)


@pytest.fixture(scope="module")
def batch(cfg):
    tokens = jax.random.randint(jax.random.key(3), (B, T), 2, cfg.vocab_size)
    # Row 1 is left-padded by 3 slots (pad id 0), as the sampler lays prompts out.
    mask = jnp.ones((B, T), bool).at[1, :3].set(False)
    tokens = jnp.where(mask, tokens, 0)
    return tokens, mask


@pytest.fixture(scope="module")
def forward():
    @jax.jit
    def fwd(graphdef, params, tokens, mask, routing=None):
        return nnx.merge(graphdef, params)(tokens, input_mask=mask, routing=routing)

    return fwd


@pytest.fixture(scope="module")
def logprobs_jit():
    return jax.jit(token_logprobs, static_argnames=("response_start",))


def test_tiny_preset_size():
    _, params = init_model(ModelConfig.tiny())
    d, h, kv, hd, e, f, v, layers = 128, 4, 2, 32, 32, 32, 128, 4
    attention = d * h * hd + 2 * d * kv * hd + h * hd * d + 2 * hd  # q, k, v, o; q/k norms
    moe = d * e + 3 * e * d * f  # router; gate, up, down of every expert
    block = attention + moe + 2 * d  # and the two RMSNorms
    assert param_count(params) == layers * block + 2 * v * d + d == 1_820_032  # untied; final norm
    chex.assert_type(jax.tree.leaves(params), jnp.float32)


def test_kv_cache_decoding_matches_full_forward(cfg, model, batch, forward):
    graphdef, params = model
    tokens, mask = batch
    full = forward(graphdef, params, tokens, mask)

    @jax.jit
    def cached(params, tokens, positions, cache, index):
        out = nnx.merge(graphdef, params)(
            tokens, positions=positions, cache=cache, cache_index=index, kv_mask=mask
        )
        return out.logits, out.routing, out.cache

    positions = positions_from_mask(mask)
    split = 6
    logits, routing, cache = cached(
        params, tokens[:, :split], positions[:, :split], init_cache(cfg, B, T), 0
    )
    got_logits, got_routing = [logits], [routing]
    for t in range(split, T):  # one compile for every single-token step
        logits, routing, cache = cached(
            params, tokens[:, t : t + 1], positions[:, t : t + 1], cache, jnp.int32(t)
        )
        got_logits.append(logits)
        got_routing.append(routing)
    got = jnp.concatenate(got_logits, axis=1)
    rows = mask[..., None]
    chex.assert_trees_all_close(
        jnp.where(rows, got, 0), jnp.where(rows, full.logits, 0), rtol=1e-5, atol=1e-5
    )
    chex.assert_trees_all_equal(
        jnp.where(mask[None, ..., None], jnp.concatenate(got_routing, axis=2), 0),
        jnp.where(mask[None, ..., None], full.routing, 0),
    )


def test_a_per_query_cache_mask_is_taken_as_given(cfg, model, batch):
    """A [B, 1, S] kv_mask that marks exactly the past slots decodes as the [B, S] mask with the
    causal rule; slots after the query are then seen when the mask marks them (no causal rule),
    and a mask of another shape is refused."""
    graphdef, params = model
    tokens, mask = batch
    positions = positions_from_mask(mask)

    @jax.jit
    def step(cache, t, kv_mask):
        out = nnx.merge(graphdef, params)(
            jax.lax.dynamic_slice_in_dim(tokens, t, 1, 1),
            positions=jax.lax.dynamic_slice_in_dim(positions, t, 1, 1),
            cache=cache,
            cache_index=t,
            kv_mask=kv_mask,
        )
        return out.logits

    # The cache after a full prefix: every slot holds its token's keys and values.
    model_ = nnx.merge(graphdef, params)
    cache = model_(tokens, positions=positions, cache=init_cache(cfg, B, T), kv_mask=mask).cache
    t = jnp.int32(7)
    past = mask & (jnp.arange(T) <= t)[None]
    want = step(cache, t, mask)
    chex.assert_trees_all_close(step(cache, t, past[:, None]), want, rtol=1e-6, atol=1e-6)
    # Marking the later slots too: a different output, since the mask is not made causal.
    later = step(cache, t, mask[:, None])
    assert float(jnp.max(jnp.abs(later - want))) > 1e-4
    with pytest.raises(ValueError, match="kv_mask"):
        step(cache, t, jnp.stack([past, past], axis=1))


def test_routing_capture_and_replay(cfg, model, batch, forward):
    graphdef, params = model
    tokens, mask = batch
    fresh = forward(graphdef, params, tokens, mask)
    chex.assert_shape(fresh.routing, (cfg.num_moe_layers, B, T, cfg.num_experts_per_tok))
    chex.assert_type(fresh.routing, jnp.int32)
    # Replaying the pass's own choice reproduces it exactly.
    replayed = forward(graphdef, params, tokens, mask, fresh.routing)
    chex.assert_trees_all_equal(replayed.logits, fresh.logits)
    # Replaying another choice is obeyed and changes the output.
    other = (fresh.routing + 1) % cfg.num_experts
    forced = forward(graphdef, params, tokens, mask, other)
    chex.assert_trees_all_equal(forced.routing, other)
    assert float(jnp.max(jnp.abs(forced.logits - fresh.logits))) > 1e-4


def test_left_padding_does_not_change_real_tokens(model, batch, logprobs_jit):
    graphdef, params = model
    tokens, mask = batch
    lp_padded, _, _ = logprobs_jit(graphdef, params, tokens, input_mask=mask, response_start=3)
    # Row 1 without its three pad slots, scored from the same real token on.
    lp_plain, _, _ = logprobs_jit(graphdef, params, tokens[1:, 3:], response_start=1)
    chex.assert_trees_all_close(lp_padded[1, 1:], lp_plain[0], rtol=1e-7, atol=1e-5)


def test_token_logprobs_alignment(model, batch, logprobs_jit, forward):
    graphdef, params = model
    tokens, mask = batch
    lp1, ent1, aux = logprobs_jit(graphdef, params, tokens, input_mask=mask, response_start=1)
    chex.assert_shape([lp1, ent1], (B, T - 1))
    assert aux["routing"].shape[2] == T - 1
    lp4, _, _ = logprobs_jit(graphdef, params, tokens, input_mask=mask, response_start=4)
    chex.assert_trees_all_close(lp4, lp1[:, 3:], rtol=1e-7, atol=1e-6)
    # Column j of the default layout is log softmax(logits after reading tokens[:j+1])[tokens[j+1]].
    logits = forward(graphdef, params, tokens, mask).logits
    manual = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1)
    chex.assert_trees_all_close(lp1, manual[..., 0], rtol=1e-7, atol=1e-5)
    # Temperature divides the logits; a −∞ cut-off is a no-op.
    lp_t, _, _ = logprobs_jit(
        graphdef,
        params,
        tokens,
        input_mask=mask,
        response_start=1,
        temperature=0.5,
        cutoffs=jnp.full((B, T - 1), -jnp.inf),
    )
    manual_t = jnp.take_along_axis(
        jax.nn.log_softmax(logits[:, :-1] / 0.5), tokens[:, 1:, None], -1
    )
    chex.assert_trees_all_close(lp_t, manual_t[..., 0], rtol=1e-7, atol=1e-5)
    assert bool(jnp.all(ent1 > 0)) and bool(jnp.all(ent1 <= jnp.log(128.0) + 1e-4))


def test_gradients_reach_router_under_replay_and_compile_once(cfg, model, batch, logprobs_jit):
    graphdef, params = model
    tokens, mask = batch
    _, _, aux = logprobs_jit(graphdef, params, tokens, input_mask=mask, response_start=1)
    routing = aux["routing"]
    # Replay a choice the router would not make, so the gates are not the fresh ones.
    routing = (routing + 3) % cfg.num_experts

    traces = []  # appended while jax traces grad_fn, i.e. once per compiled program

    @jax.jit
    def grad_fn(params, tokens):
        traces.append(1)

        def loss(p):
            lp, _, _ = token_logprobs(graphdef, p, tokens, input_mask=mask, routing=routing)
            return -jnp.sum(lp)

        return jax.grad(loss)(params)

    grads = grad_fn(params, tokens)
    router = list(grads["moe_layers"]["mlp"]["gate"]["kernel"][...])  # stacked: one per block
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in router)
    chex.assert_tree_all_finite(grads)
    # Other parameter values and tokens of the same shapes reuse the compiled program.
    params2 = jax.tree.map(lambda x: x * 1.01, params)
    grad_fn(params2, (tokens + 1) % cfg.num_experts + 2)
    assert len(traces) == 1

    # remat changes memory, not values.
    graphdef_remat, _ = init_model(cfg.replace(remat=True), seed=0)
    grads_remat = jax.jit(
        jax.grad(
            lambda p: (
                -jnp.sum(
                    token_logprobs(graphdef_remat, p, tokens, input_mask=mask, routing=routing)[0]
                )
            )
        )
    )(params)
    chex.assert_trees_all_close(
        grads_remat["moe_layers"]["mlp"]["gate"]["kernel"][...][0], router[0], rtol=1e-4, atol=1e-7
    )


def test_bad_inputs_raise_value_errors_naming_the_argument(cfg, model, batch):
    graphdef, params = model
    tokens, mask = batch
    with pytest.raises(ValueError, match="tokens"):
        token_logprobs(graphdef, params, tokens.at[0, 5].set(cfg.vocab_size))
    with pytest.raises(ValueError, match="tokens"):
        token_logprobs(graphdef, params, tokens.at[0, -1].set(-1))
    bad_routing = jnp.zeros((cfg.num_moe_layers, B, T, cfg.num_experts_per_tok), jnp.int32)
    with pytest.raises(ValueError, match="routing"):  # one row too many: needs T − 1 fed tokens
        token_logprobs(graphdef, params, tokens, routing=bad_routing)
    with pytest.raises(ValueError, match="routing"):
        token_logprobs(graphdef, params, tokens, routing=bad_routing[:, :, 1:] + cfg.num_experts)
    with pytest.raises(ValueError, match="cutoffs"):
        token_logprobs(graphdef, params, tokens, cutoffs=jnp.zeros((B, T)))
    with pytest.raises(ValueError, match="input_mask"):
        token_logprobs(graphdef, params, tokens, input_mask=mask[:, 1:])
    with pytest.raises(ValueError, match="response_start"):
        token_logprobs(graphdef, params, tokens, response_start=T)


def test_shared_expert_and_dense_layers_build_and_run():
    cfg = ModelConfig.tiny(
        num_layers=2,
        mlp_only_layers=(0,),
        shared_expert_intermediate_size=32,
        hidden_size=32,
        head_dim=8,
        moe_intermediate_size=16,
        intermediate_size=32,
        tie_embeddings=True,
    )
    graphdef, params = init_model(cfg)
    tokens = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
    lp, ent, aux = jax.jit(token_logprobs)(graphdef, params, tokens)
    chex.assert_shape(lp, (2, 3))
    chex.assert_shape(aux["routing"], (1, 2, 3, cfg.num_experts_per_tok))
    chex.assert_tree_all_finite(lp)
