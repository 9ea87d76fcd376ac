"""Stacked, scanned blocks and the contracts other modules build on: one block body whatever the
depth, runs of MoE / dense blocks, the hidden-state output with ``lm_head_weight``, the expert-FFN
signature, remat policies and the parameter dtype."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sat_jax.models import ModelConfig, abstract_params, graphdef_for, init_model, token_logprobs
from sat_jax.models.moe import expert_ffn

SMALL = dict(
    vocab_size=32,
    hidden_size=16,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
    intermediate_size=16,
)


def _jaxpr_dots(config) -> int:
    graphdef = graphdef_for(config)
    tokens = jax.ShapeDtypeStruct((2, 5), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p, t: nnx.merge(graphdef, p)(t).logits)(
        abstract_params(config), tokens
    )
    return str(jaxpr).count("dot_general")


def test_program_size_does_not_grow_with_depth():
    shallow = _jaxpr_dots(ModelConfig(num_layers=2, **SMALL))
    deep = _jaxpr_dots(ModelConfig(num_layers=12, **SMALL))
    assert shallow == deep  # one scanned block body
    # Mixed blocks: one body per run of one kind (here MoE, dense, MoE).
    cfg = ModelConfig(num_layers=5, mlp_only_layers=(2,), **SMALL)
    assert cfg.layer_runs == ((True, 0, 2), (False, 0, 1), (True, 2, 4))
    assert ModelConfig(num_layers=4, mlp_only_layers=(0, 3), **SMALL).layer_runs == (
        (False, 0, 1),
        (True, 0, 2),
        (False, 1, 2),
    )


def test_stacked_parameters_and_mixed_runs_route_per_layer():
    cfg = ModelConfig(num_layers=4, mlp_only_layers=(1,), init_std=0.3, **SMALL)
    graphdef, params = init_model(cfg, seed=0)
    chex.assert_shape(params["moe_layers"]["mlp"]["gate_proj"][...], (3, 4, 16, 8))
    chex.assert_shape(params["dense_layers"]["mlp"]["up_proj"]["kernel"][...], (1, 16, 16))
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, cfg.vocab_size)
    fwd = jax.jit(lambda p, t, r=None: nnx.merge(graphdef, p)(t, routing=r))
    out = fwd(params, tokens)
    chex.assert_shape(out.routing, (3, 2, 6, 2))
    # Replaying one layer's routing changes that layer only: R3 indexes layers correctly.
    forced = out.routing.at[2].set((out.routing[2] + 1) % cfg.num_experts)
    replayed = fwd(params, tokens, forced)
    chex.assert_trees_all_equal(replayed.routing, forced)
    assert float(jnp.max(jnp.abs(replayed.logits - out.logits))) > 1e-5


def test_return_hidden_and_lm_head_weight_give_the_logits():
    for tied in (False, True):
        cfg = ModelConfig(num_layers=2, tie_embeddings=tied, **SMALL)
        graphdef, params = init_model(cfg, seed=2)
        tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % cfg.vocab_size

        @jax.jit
        def both(p, t, graphdef=graphdef):
            model = nnx.merge(graphdef, p)
            full = model(t, logits_from=2)
            hid = model(t, logits_from=2, return_hidden=True)
            return full, hid, model.lm_head_weight()

        full, hid, w = both(params, tokens)
        assert hid.logits is None and full.hidden is None
        chex.assert_shape(hid.hidden, (2, 4, cfg.hidden_size))
        chex.assert_shape(w, (16, cfg.vocab_size))
        chex.assert_trees_all_close(hid.hidden @ w, full.logits, rtol=1e-7, atol=1e-6)
        chex.assert_trees_all_equal(hid.routing, full.routing)


def test_dense_expert_ffn_hand_example():
    # Two experts of width 1, d = 1: Expert_e(x) = down_e · silu(gate_e x) · (up_e x).
    x = jnp.array([[1.0], [2.0]])
    gate = jnp.array([[[1.0]], [[-1.0]]])
    up = jnp.array([[[2.0]], [[3.0]]])
    down = jnp.array([[[0.5]], [[1.0]]])
    indices = jnp.array([[0], [1]], jnp.int32)
    weights = jnp.array([[0.25], [1.0]])
    y = expert_ffn(x, indices, weights, gate, up, down, impl="dense")
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    want = np.array([0.25 * 0.5 * silu(1.0) * 2.0, 1.0 * 1.0 * silu(-2.0) * 6.0])
    chex.assert_trees_all_close(np.asarray(y)[:, 0], want, rtol=1e-6)
    with pytest.raises(ValueError, match="impl"):
        expert_ffn(x, indices, weights, gate, up, down, impl="sparse")


@pytest.mark.parametrize("policy", ["full", "dots_saveable"])
def test_remat_policies_change_memory_not_values(policy):
    cfg = ModelConfig(num_layers=2, **SMALL)
    graphdef, params = init_model(cfg, seed=3)
    remat_graphdef, _ = init_model(cfg.replace(remat=policy), seed=3)
    tokens = jnp.arange(14, dtype=jnp.int32).reshape(2, 7) % cfg.vocab_size

    def grads(g):
        return jax.jit(jax.grad(lambda p: -jnp.sum(token_logprobs(g, p, tokens)[0])))(params)

    chex.assert_trees_all_close(grads(remat_graphdef), grads(graphdef), rtol=1e-5, atol=1e-8)


def test_scan_unroll_changes_the_program_not_values():
    # 3 blocks with unroll 2: one loop step of two blocks plus a remainder block; with a dense
    # block in the middle (runs of 1, 1, 1 after mixing) the clip to the run length applies too.
    for extra in ({}, {"mlp_only_layers": (1,)}):
        cfg = ModelConfig(num_layers=3, init_std=0.3, **SMALL, **extra)
        graphdef, params = init_model(cfg, seed=5)
        unrolled, _ = init_model(cfg.replace(scan_unroll=2), seed=5)
        tokens = jnp.arange(14, dtype=jnp.int32).reshape(2, 7) % cfg.vocab_size

        def value_and_grads(g, params=params, tokens=tokens):
            return jax.jit(
                jax.value_and_grad(
                    lambda p: -jnp.sum(token_logprobs(g, p, tokens, response_start=3)[0])
                )
            )(params)

        # Equal up to float32 rounding (XLA fuses the unrolled program differently).
        chex.assert_trees_all_close(
            value_and_grads(unrolled), value_and_grads(graphdef), rtol=1e-4, atol=1e-6
        )
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="scan_unroll"):
            ModelConfig(scan_unroll=bad)


def test_config_options_and_param_dtype():
    assert ModelConfig(remat=True).remat == "full" and ModelConfig(remat=False).remat == "none"
    with pytest.raises(ValueError, match="remat"):
        ModelConfig(remat="sometimes")
    with pytest.raises(ValueError, match="moe_impl"):
        ModelConfig(moe_impl="magic")
    with pytest.raises(ValueError, match="param_dtype"):
        ModelConfig(param_dtype=jnp.int32)
    cfg = ModelConfig(num_layers=2, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, **SMALL)
    graphdef, params = init_model(cfg, seed=4)
    chex.assert_type(jax.tree.leaves(params), jnp.bfloat16)
    # Same draw as the float32 master copy, rounded.
    _, p32 = init_model(cfg.replace(param_dtype=jnp.float32), seed=4)
    chex.assert_trees_all_equal(
        np.asarray(params["embed_tokens"][...]),
        np.asarray(p32["embed_tokens"][...].astype(jnp.bfloat16)),
    )
    lp, _, _ = jax.jit(token_logprobs)(graphdef, params, jnp.ones((1, 4), jnp.int32))
    chex.assert_type(lp, jnp.float32)
    chex.assert_tree_all_finite(lp)
