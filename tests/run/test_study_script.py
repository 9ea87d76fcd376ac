"""scripts/study.py: its config overrides and the sat-jax compare --grid command line it runs."""

import importlib.util
import os

import pytest

from sat_jax import default_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("study", os.path.join(ROOT, "scripts/study.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_override_parses_with_the_field_type(study):
    c = default_config.get_config()
    study._override(c, "optim.learning_rate=3e-4")
    study._override(c, "rollout.group_size=4")
    study._override(c, "log.plots=false")
    assert c.optim.learning_rate == 3e-4 and isinstance(c.optim.learning_rate, float)
    assert c.rollout.group_size == 4 and isinstance(c.rollout.group_size, int)
    assert c.log.plots is False


@pytest.mark.parametrize("item,message", [("optim.nonexistent=1", "unknown config field"),
                                          ("optim.learning_rate", "KEY=VALUE")])
def test_override_rejects_bad_input(study, item, message):
    with pytest.raises(SystemExit, match=message):
        study._override(default_config.get_config(), item)


def test_arguments_become_a_compare_grid_command_line(study):
    args = study.argparse.Namespace(configs="sat_gspo_r3,grpo", seeds="0,1,2", lag=8,
                                    lag_mode="fixed", steps=50, out="runs/s",
                                    set=["optim.learning_rate=3e-4"])
    assert study.argv(args) == [
        "compare", "--grid=core", "--methods=sat_gspo_r3,grpo", "--baseline=grpo", "--seeds=3",
        "--lags=8", "--lag_mode=fixed", "--out=runs/s", "--set=num_steps=50",
        "--set=optim.learning_rate=3e-4"]
    with pytest.raises(SystemExit, match="count or 0,1"):
        study._seed_count("1,2")
