"""The rollout batch type: its partition specs and minibatches follow each field's batch axis."""

import dataclasses

import jax
import numpy as np
import pytest

from sat_jax.rl.batch import RolloutBatch


def test_batch_specs_and_minibatches_follow_each_fields_batch_axis():
    specs = RolloutBatch.specs(("data",))
    assert specs.tokens == jax.sharding.PartitionSpec("data")
    assert specs.routing == jax.sharding.PartitionSpec(None, "data")
    two = RolloutBatch.specs()  # default: BATCH_AXES
    assert two.routing == jax.sharding.PartitionSpec(None, ("data", "fsdp"))
    b = 4
    batch = RolloutBatch(
        tokens=np.arange(b * 3).reshape(b, 3),
        input_mask=np.ones((b, 3), bool),
        response_mask=np.ones((b, 2), bool),
        behavior_logp=np.zeros((b, 2)),
        cutoffs=np.zeros((b, 2)),
        routing=np.arange(2 * b).reshape(2, b, 1, 1),
        versions=np.zeros((b, 2), int),
        advantages=np.arange(b, dtype=float),
        rewards=np.zeros(b),
    )
    first, second = batch.minibatches(2)
    np.testing.assert_array_equal(second.advantages, [2, 3])
    np.testing.assert_array_equal(second.routing[:, :, 0, 0], [[2, 3], [6, 7]])
    assert first.size == 2
    with pytest.raises(ValueError, match="equal minibatches"):
        list(batch.minibatches(3))


def test_batch_stats_hand_batch():
    from sat_jax.rl.rollout import batch_stats

    lengths = np.array([4, 1, 2, 0])  # responses through EOS; the longest decodes 4 steps
    mask = np.arange(4)[None, :] < lengths[:, None]
    rewards = np.array([1.0, 0.0, 1.0, 1.0])
    batch = RolloutBatch(
        tokens=np.zeros((4, 6), int),
        input_mask=np.ones((4, 6), bool),
        response_mask=mask,
        behavior_logp=np.zeros((4, 4)),
        cutoffs=np.zeros((4, 4)),
        routing=np.zeros((1, 4, 5, 1), int),
        versions=np.zeros((4, 4), int),
        advantages=np.zeros(4),
        rewards=rewards,
    )
    s = batch_stats(batch, group_size=2)
    # 7 of the 16 cells of the [4 rows x 4 steps] decode grid are real tokens.
    assert s["rollout/finished_row_share"] == pytest.approx(9 / 16)
    assert s["train/tokens"] == 7 and s["train/response_len"] == pytest.approx(7 / 4)
    assert s["train/solved_groups"] == 1.0 and s["train/zero_variance_groups"] == 0.5
    empty = dataclasses.replace(batch, response_mask=np.zeros((4, 4), bool))
    assert batch_stats(empty, group_size=2)["rollout/finished_row_share"] == 0.0
