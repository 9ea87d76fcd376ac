"""The rollout batch type: its partition specs and minibatches follow each field's batch axis."""

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
