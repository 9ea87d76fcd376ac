"""Orbax save and restore of a sharded train state (8 fake CPU devices, conftest.py).

* A state sharded over fsdp 2 × expert 2 × tensor 2 is saved and restored with its values and its
  shardings, each device holding only its slice; the step after a restore equals the step after
  no save at all.
* The same checkpoint restores into another mesh (data 2 × fsdp 4) from an abstract target
  (``trainer.abstract_train_state``): orbax reshards on read, nothing full-size is built first.
"""

from __future__ import annotations

import chex
import jax
import numpy as np
import optax
import pytest
from _tiny_models import mixed_moe

from sat_jax import parallel
from sat_jax.models import init_model
from sat_jax.rl import trainer
from sat_jax.rl.batch import RolloutBatch
from sat_jax.run.checkpoint import Checkpointer

CFG = mixed_moe(num_kv_heads=4, init_std=0.1)
P_W, N, ROWS = 3, 4, 8
OPT = optax.adam(1e-2)
SPEC = trainer.LossSpec(objective="ppo", r3=False, support_replay=False)


def _batch(seed=0) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    t = P_W + N
    response_mask = np.ones((ROWS, N), bool)
    response_mask[0, 2:] = False
    return RolloutBatch(
        tokens=rng.integers(2, CFG.vocab_size, (ROWS, t)).astype(np.int32),
        input_mask=np.concatenate([np.ones((ROWS, P_W), bool), response_mask], axis=1),
        response_mask=response_mask,
        behavior_logp=np.where(response_mask, -4.0, 0.0).astype(np.float32),
        cutoffs=np.full((ROWS, N), -np.inf, np.float32),
        advantages=rng.normal(size=(ROWS,)).astype(np.float32),
        routing=np.zeros((CFG.num_moe_layers, ROWS, t - 1, CFG.num_experts_per_tok), np.int32),
        versions=np.zeros((ROWS, N), np.int32),
        rewards=np.zeros((ROWS,), np.float32),
    )


def _local_bytes(tree) -> int:
    dev = jax.devices()[0]
    return sum(
        s.data.nbytes
        for x in jax.tree.leaves(tree)
        for s in x.addressable_shards
        if s.device == dev
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    mesh = parallel.make_mesh(num_data=1, fsdp=2, expert=2, tensor=2)
    graphdef, params = init_model(CFG, seed=0, mesh=mesh)
    state = trainer.init_train_state(params, OPT, mesh, config=CFG)
    step = trainer.make_train_step(graphdef, OPT, SPEC, prompt_width=P_W, mesh=mesh)
    state, _ = step(state, _batch(0).shard(mesh), {})  # Adam's moments are non-zero now
    directory = tmp_path_factory.mktemp("sharded_ckpt")
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, {"state": state._asdict()}, {"step": 1}, force=True)
    return dict(mesh=mesh, step=step, state=state, dir=directory, graphdef=graphdef)


def _assert_same_values(a, b):
    chex.assert_trees_all_equal(jax.device_get(a), jax.device_get(b))


def test_sharded_state_round_trips_with_its_layout(saved):
    state, mesh = saved["state"], saved["mesh"]
    with Checkpointer(saved["dir"]) as ckpt:
        target = trainer.abstract_train_state(CFG, OPT, mesh)._asdict()
        restored, meta, step = ckpt.restore({"state": target})
    assert (meta["step"], step) == (1, 1)
    got = trainer.TrainState(**restored["state"])
    _assert_same_values(got, state)
    for want, have in zip(jax.tree.leaves(state), jax.tree.leaves(got), strict=True):
        assert have.sharding.is_equivalent_to(want.sharding, have.ndim), (
            want.sharding,
            have.sharding,
        )
    # Each device holds its slice only: 1/8 of every expert and attention weight.
    assert _local_bytes(got.params) == _local_bytes(state.params)
    assert _local_bytes(got.params) < sum(x.nbytes for x in jax.tree.leaves(got.params)) / 4

    # Training on from the restored state is training on from the saved one.
    batch = _batch(1).shard(mesh)
    after_restore, m1 = saved["step"](got, batch, {})
    after_none, m2 = saved["step"](state, batch, {})
    _assert_same_values(after_restore.params, after_none.params)
    assert jax.device_get(m1) == jax.device_get(m2)


def test_sharded_checkpoint_restores_into_another_mesh(saved):
    other = parallel.make_mesh(num_data=2, fsdp=4)
    with Checkpointer(saved["dir"]) as ckpt:
        target = trainer.abstract_train_state(CFG, OPT, other)._asdict()
        restored, _, _ = ckpt.restore({"state": target})
    got = trainer.TrainState(**restored["state"])
    _assert_same_values(got, saved["state"])
    for want, have in zip(jax.tree.leaves(target), jax.tree.leaves(restored["state"]), strict=True):
        assert have.sharding.is_equivalent_to(want.sharding, have.ndim), (want, have.sharding)
        assert have.sharding.mesh.shape == other.shape
