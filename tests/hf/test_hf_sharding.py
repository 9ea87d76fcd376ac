"""sharding_rules on 8 fake CPU devices (tests/conftest.py): a (data 2, expert 2, model 2) mesh,
parameters placed with the rules, forward pass equal to the unsharded one; load_hf(mesh=...) places
parameters directly with the same specs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from sat_jax.models import ModelConfig, Transformer, init_model, param_path, sharding_rules

CFG = ModelConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(1,),
    intermediate_size=24,
)
AXES = ("data", "expert", "model")


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return jax.make_mesh((2, 2, 2), AXES, axis_types=(AxisType.Auto,) * 3)


def _abstract_params(config):
    """Parameter shapes only: the rules read nothing else, and nothing is allocated."""
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(params=0)))
    return nnx.state(model, nnx.Param)


def _specs(tree):
    return {param_path(p): s for p, s in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_rules_per_parameter(mesh):
    params = _abstract_params(CFG)
    specs = _specs(sharding_rules(params, mesh=mesh))
    assert specs[("embed_tokens",)] == P("model", None)
    assert specs[("lm_head", "kernel")] == P(None, "model")
    assert specs[("layers", 0, "self_attn", "q_proj", "kernel")] == P(None, "model")
    assert specs[("layers", 0, "self_attn", "o_proj", "kernel")] == P("model", None)
    assert specs[("layers", 0, "self_attn", "q_norm", "weight")] == P(None)
    assert specs[("layers", 0, "mlp", "gate", "kernel")] == P(None, None)  # router replicated
    assert specs[("layers", 0, "mlp", "gate_proj")] == P("expert", None, "model")
    assert specs[("layers", 0, "mlp", "up_proj")] == P("expert", None, "model")
    assert specs[("layers", 0, "mlp", "down_proj")] == P("expert", "model", None)
    assert specs[("layers", 1, "mlp", "up_proj", "kernel")] == P(None, "model")  # dense block
    assert specs[("layers", 1, "mlp", "down_proj", "kernel")] == P("model", None)
    # Without the mesh nothing is checked; a role can be dropped; sizes the mesh does not divide
    # stay unsplit.
    no_expert = _specs(sharding_rules(params, mesh_axes=("data", None, "model")))
    assert no_expert[("layers", 0, "mlp", "gate_proj")] == P(None, None, "model")
    odd = _abstract_params(CFG.replace(num_experts=3, vocab_size=63))
    odd_specs = _specs(sharding_rules(odd, mesh=mesh))
    assert odd_specs[("layers", 0, "mlp", "gate_proj")] == P(None, None, "model")
    assert odd_specs[("embed_tokens",)] == P(None, None)
    with pytest.raises(ValueError, match="mesh_axes"):
        sharding_rules(params, mesh_axes=("data", "model"))


def test_sharded_forward_matches_unsharded(mesh):
    graphdef, params = init_model(CFG, seed=1)
    # Larger weights so that activations and routing are far from trivial.
    params = jax.tree.map(lambda x: x * 5.0 if x.ndim > 1 else x, params)
    specs = sharding_rules(params, mesh=mesh)
    sharded = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    experts = sharded["layers"][0]["mlp"]["gate_proj"][...]
    assert experts.addressable_shards[0].data.shape == (2, 32, 8)  # E/2 experts, f/2 wide
    tokens = jax.random.randint(jax.random.key(0), (4, 10), 0, CFG.vocab_size)
    mask = jnp.ones((4, 10), bool).at[1, :3].set(False)

    fwd = jax.jit(lambda p, t, m: nnx.merge(graphdef, p)(t, input_mask=m))
    want = fwd(params, tokens, mask)
    batch = NamedSharding(mesh, P("data"))
    got = fwd(sharded, jax.device_put(tokens, batch), jax.device_put(mask, batch))
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), atol=2e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(got.routing), np.asarray(want.routing))


def test_load_hf_places_on_the_mesh(mesh, tmp_path):
    pytest.importorskip("safetensors", reason="load_hf needs safetensors (sat_jax[hf])")
    from sat_jax.models import load_hf, save_hf

    graphdef, params = init_model(CFG, seed=2)
    save_hf(tmp_path, CFG, params)
    _, _, placed = load_hf(tmp_path, mesh=mesh)
    want = _specs(sharding_rules(params, mesh=mesh))
    for path, leaf in jax.tree_util.tree_flatten_with_path(placed)[0]:
        p = param_path(path)
        assert leaf.sharding == NamedSharding(mesh, want[p]), p
    tokens = jnp.arange(20, dtype=jnp.int32).reshape(2, 10)
    fwd = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t).logits)
    np.testing.assert_allclose(np.asarray(fwd(placed, tokens)), np.asarray(fwd(params, tokens)),
                               atol=1e-5, rtol=0)
