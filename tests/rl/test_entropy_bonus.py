"""The entropy bonus (loss.entropy_coef): the trainer's objective subtracts the coefficient times
the policy entropy aggregated over active tokens, like the objective; 0 leaves the loss as is."""

import chex
import jax
import numpy as np
import pytest

from sat_jax.rl import trainer

MASK = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)  # an empty row too
RNG = np.random.default_rng(0)
LOGP = np.log(RNG.uniform(0.1, 0.9, MASK.shape)).astype(np.float32)
BEH = (LOGP + RNG.normal(0, 0.1, MASK.shape)).astype(np.float32)
ENTROPY = RNG.uniform(0.0, 2.0, MASK.shape).astype(np.float32)
BATCH = {
    "response_mask": MASK,
    "behavior_logp": BEH,
    "advantages": np.array([1.0, -1.0, 0.5], np.float32),
}


def _loss(entropy, coef, aggregation="token-mean"):
    spec = trainer.LossSpec(objective="ppo", r3=False, entropy_coef=coef, aggregation=aggregation)
    return trainer._objective(LOGP, entropy, None, None, BATCH, spec, None)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_the_bonus_is_the_coefficient_times_the_aggregated_entropy(aggregation):
    base, base_metrics = _loss(ENTROPY, 0.0, aggregation)
    loss, metrics = _loss(ENTROPY, 0.05, aggregation)
    if aggregation == "token-mean":
        want = ENTROPY[MASK].mean()
    else:  # mean over non-empty rows of each row's token mean
        rows = [ENTROPY[i][MASK[i]].mean() for i in range(2)]
        want = np.mean(rows)
    chex.assert_trees_all_close(float(base - loss), 0.05 * want, rtol=1e-6)
    chex.assert_trees_all_close(float(metrics["loss/entropy_bonus"]), 0.05 * want, rtol=1e-6)
    assert "loss/entropy_bonus" not in base_metrics
    # The logged entropy is the token mean whatever the bonus.
    chex.assert_trees_all_close(float(metrics["train/entropy"]), ENTROPY[MASK].mean(), rtol=1e-6)
    # Its gradient reaches only active positions, and lowers the loss as entropy rises.
    grad = jax.grad(lambda e: _loss(e, 0.05, aggregation)[0])(ENTROPY)
    assert np.all(grad[~MASK] == 0) and np.all(grad[MASK] < 0)
