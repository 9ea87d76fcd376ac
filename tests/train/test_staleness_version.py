"""Each token's staleness in the trainer step counts the learner's versions, not optimizer
updates: with two minibatches and two passes per batch (four updates a step) the age-aware clip
and the mismatch-by-staleness buckets read the lag the schedule gave the batch."""

import pytest
from _tiny_models import tiny_run

from sat_jax.study.grid import method_config
from sat_jax.train import learner


def test_four_updates_a_step_keep_the_schedules_lag(tmp_path):
    c = tiny_run(method_config("age_clip"), tmp_path / "run", tmp_path / "cache")
    c.num_steps = 5
    c.lag_mode, c.lag = "fixed", 2
    c.optim.num_minibatches, c.optim.updates_per_batch = 2, 2
    history = learner.train(c, quiet=True)["history"]
    assert [h["optim/nonfinite_updates"] for h in history] == [0.0] * 5
    for step, h in enumerate(history):
        # Batch j is sampled by version max(j - 2, 0): j - that many versions behind.
        lag = step - max(step - 2, 0)
        assert h["lag/mean"] == pytest.approx(lag)
        assert h["loss/age/staleness_mean"] == pytest.approx(lag), step
        assert h["mismatch/lag_le2_share"] == pytest.approx(1.0)
