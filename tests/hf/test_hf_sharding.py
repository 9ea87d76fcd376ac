"""The sharding table on 8 fake CPU devices (tests/conftest.py): specs per parameter on a
(fsdp 2, expert 2, tensor 2) mesh, a forward pass on sharded parameters equal to the unsharded
one, and load_hf(mesh=...) placing each tensor straight into that layout."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tiny_models import mixed_moe
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sat_jax import parallel
from sat_jax.models import (
    abstract_params,
    init_model,
    param_path,
    param_shardings,
    sharding_rules,
)

CFG = mixed_moe(num_layers=3, intermediate_size=24)
FE = ("fsdp", "expert")


@pytest.fixture(scope="module")
def mesh():
    return parallel.make_mesh(num_data=1, fsdp=2, expert=2, tensor=2)


def _specs(tree):
    return {param_path(p): s for p, s in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_rules_per_parameter(mesh):
    specs = _specs(sharding_rules(abstract_params(CFG), mesh=mesh))
    assert specs[("embed_tokens",)] == P("tensor", FE)
    assert specs[("lm_head", "kernel")] == P(FE, "tensor")
    assert specs[("norm", "weight")] == P()
    # Stacked blocks: a leading, unsplit layer axis.
    assert specs[("moe_layers", "self_attn", "q_proj", "kernel")] == P(None, FE, "tensor")
    assert specs[("moe_layers", "self_attn", "k_proj", "kernel")] == P(None, FE, "tensor")
    assert specs[("moe_layers", "self_attn", "o_proj", "kernel")] == P(None, "tensor", FE)
    assert specs[("moe_layers", "self_attn", "q_norm", "weight")] == P()
    assert specs[("moe_layers", "mlp", "gate", "kernel")] == P()  # router replicated
    assert specs[("moe_layers", "mlp", "gate_proj")] == P(None, "expert", "fsdp", "tensor")
    assert specs[("moe_layers", "mlp", "up_proj")] == P(None, "expert", "fsdp", "tensor")
    assert specs[("moe_layers", "mlp", "down_proj")] == P(None, "expert", "tensor", "fsdp")
    assert specs[("dense_layers", "mlp", "up_proj", "kernel")] == P(None, FE, "tensor")
    assert specs[("dense_layers", "mlp", "down_proj", "kernel")] == P(None, "tensor", FE)
    # A data-only mesh replicates everything (plain data parallelism).
    data = _specs(sharding_rules(abstract_params(CFG), mesh=parallel.make_mesh(8)))
    assert set(data.values()) == {P()}


def test_sharded_forward_matches_unsharded(mesh):
    graphdef, params = init_model(CFG, seed=1)
    _, sharded = init_model(CFG, seed=1, mesh=mesh)
    # Same values whatever the placement; each device holds only its shard.
    chex.assert_trees_all_equal(params, sharded)
    experts = sharded["moe_layers"]["mlp"]["gate_proj"][...]
    chex.assert_shape(experts.addressable_shards[0].data, (2, 2, 16, 8))  # [L, E/2, d/2, f/2]
    tokens = jax.random.randint(jax.random.key(0), (4, 10), 0, CFG.vocab_size)
    mask = jnp.ones((4, 10), bool).at[1, :3].set(False)

    fwd = jax.jit(lambda p, t, m: nnx.merge(graphdef, p)(t, input_mask=m))
    want = fwd(params, tokens, mask)
    batch = NamedSharding(mesh, P(("data", "fsdp")))
    got = fwd(sharded, jax.device_put(tokens, batch), jax.device_put(mask, batch))
    chex.assert_trees_all_close(np.asarray(got.logits), np.asarray(want.logits), rtol=0, atol=2e-5)
    chex.assert_trees_all_equal(np.asarray(got.routing), np.asarray(want.routing))


def test_load_hf_places_on_the_mesh(mesh, tmp_path):
    pytest.importorskip("safetensors", reason="load_hf needs safetensors (sat_jax[hf])")
    from sat_jax.models import load_hf, save_hf

    graphdef, params = init_model(CFG, seed=2)
    save_hf(tmp_path, CFG, params, max_shard_size="20KB")
    _, _, placed = load_hf(tmp_path, mesh=mesh)
    want = _specs(param_shardings(CFG, mesh))
    for path, leaf in jax.tree_util.tree_flatten_with_path(placed)[0]:
        assert leaf.sharding == want[param_path(path)], param_path(path)
    chex.assert_trees_all_equal(placed, params)
    tokens = jnp.arange(20, dtype=jnp.int32).reshape(2, 10)
    fwd = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t).logits)
    chex.assert_trees_all_close(
        np.asarray(fwd(placed, tokens)), np.asarray(fwd(params, tokens)), rtol=0, atol=1e-5
    )
    with pytest.raises(ValueError, match=r"'expert' \(8\).*num_experts=4"):
        load_hf(tmp_path, mesh=parallel.make_mesh(num_data=1, expert=8))
