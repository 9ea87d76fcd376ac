"""The cosine schedule's horizon is explicit (``optim.decay_steps``; 0 = num_steps at the run's
first start) and resuming never changes it: a run extended up to its horizon equals one trained
in one go, and resuming past the horizon (where the rate is 0) is refused."""

import pytest
from test_rl_system import _same_rows, _train_rows, tiny

from sat_jax import config as config_lib
from sat_jax.config.validation import ConfigError, validate
from sat_jax.train import learner


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sft-cache")


def _cosine(tmp_path, name, cache_dir, num_steps, decay_steps):
    c = tiny(config_lib.get_config(), tmp_path / name, cache_dir)
    c.optim.schedule, c.optim.warmup_steps, c.optim.learning_rate = "cosine", 1, 1e-3
    c.num_steps, c.optim.decay_steps, c.lag_mode, c.lag = num_steps, decay_steps, "fixed", 1
    return c


def test_extending_a_run_keeps_its_explicit_horizon(tmp_path, cache_dir):
    learner.train(_cosine(tmp_path, "whole", cache_dir, 4, 4), quiet=True)
    learner.train(_cosine(tmp_path, "extended", cache_dir, 2, 4), quiet=True)
    resumed = learner.train(_cosine(tmp_path, "extended", cache_dir, 4, 4), quiet=True)
    assert resumed["start_step"] == 2
    # Same rates at every step, so the same updates: every logged value equal.
    _same_rows(_train_rows(tmp_path / "whole"), _train_rows(tmp_path / "extended"))


def test_default_horizon_is_the_first_starts_num_steps(tmp_path, cache_dir, capsys):
    learner.train(_cosine(tmp_path, "run", cache_dir, 2, 0), quiet=True)
    with pytest.raises(learner.ResumeError, match="past the cosine schedule's horizon of 2 steps"):
        learner.train(_cosine(tmp_path, "run", cache_dir, 3, 0), quiet=True)
    learner.train(_cosine(tmp_path, "run", cache_dir, 2, 0))
    assert "its cosine schedule decays to 0 at step 2" in capsys.readouterr().out


def test_horizon_below_num_steps_is_refused(tmp_path, cache_dir):
    with pytest.raises(ConfigError, match="optim.decay_steps=3 is below num_steps=4"):
        validate(_cosine(tmp_path, "run", cache_dir, 4, 3))
    with pytest.raises(ConfigError, match="optim.decay_steps must be an int >= 0"):
        validate(_cosine(tmp_path, "run", cache_dir, 4, -1))
