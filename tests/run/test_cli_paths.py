"""Paths and configs a user gets wrong fail in one line: an unwritable workdir or warm-up cache
directory, and ``sat-jax eval`` with a config other than the run's."""

import pytest
from _tiny_models import tiny_run as tiny
from test_cli import run_cli

from sat_jax import config as config_lib
from sat_jax.train import learner


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    return path


def test_an_unwritable_workdir_is_one_line(capsys, a_file):
    rc, out, err = run_cli(capsys, "train", f"--workdir={a_file}/run")
    assert rc == 2 and err.startswith("sat-jax: error: cannot write "), err
    assert str(a_file) in err and "Traceback" not in out + err and len(err.splitlines()) == 1


def test_an_unwritable_warmup_cache_is_one_line(capsys, tmp_path, a_file):
    c = tiny(config_lib.get_config(), tmp_path / "run", f"{a_file}/cache")
    args = [f"--workdir={tmp_path / 'run'}", "--config.num_steps=1", "--config.mesh.data=1"]
    args += [f"--config.sft.cache_dir={a_file}/cache", f"--config.sft.steps={c.sft.steps}"]
    default = config_lib.get_config().model
    args += [f"--config.model.{k}={v}" for k, v in c.model.items() if v != default[k]]
    rc, out, err = run_cli(capsys, "train", *args)
    assert rc == 2 and err.startswith("sat-jax: error: cannot write "), err
    assert "Traceback" not in out + err and len(err.splitlines()) == 1


def test_eval_refuses_a_config_other_than_the_runs(tmp_path, capsys):
    config = tiny(config_lib.get_config(), tmp_path / "run", tmp_path / "cache")
    config.checkpoint.every = 2
    learner.train(config, quiet=True)
    other = tiny(config_lib.get_config(), tmp_path / "run", tmp_path / "cache")
    other.data.task = "multiplication"
    with pytest.raises(learner.ResumeError, match="data.task: 'addition' -> 'multiplication'"):
        learner.evaluate_run(other)
    # The defaults are not this run's config either: one line from the CLI.
    rc, out, err = run_cli(capsys, "eval", f"--workdir={tmp_path / 'run'}")
    assert rc == 2 and "holds a run with a different config" in err and "Traceback" not in err
    config.eval.num_prompts = 4  # the evaluation's own settings may differ
    assert learner.evaluate_run(config)["step"] == 2
