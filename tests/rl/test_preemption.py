"""SIGTERM (what preemptible VMs and schedulers send) stops a run like Ctrl-C: a checkpoint at
the step it stopped after, so nothing trained is lost, and the shell's status for the signal."""

import os
import signal
import subprocess
import sys
import time

import pytest
from test_rl_system import _cli_overrides, _train_rows, tiny

from sat_jax import config as config_lib
from sat_jax.run.checkpoint import Checkpointer
from sat_jax.train import learner


def test_sigterm_saves_the_current_step_and_exits_143(tmp_path):
    workdir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sat_jax.cli",
            "train",
            *_cli_overrides(workdir, tmp_path / "cache"),
            "--config.num_steps=100000",
            "--config.eval.every=0",
            "--config.checkpoint.every=0",  # no periodic checkpoint: only the signal's
        ],
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (workdir / "metrics.jsonl").exists() and len(_train_rows(workdir)) >= 2:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "SIGTERM: stopping after this step" in out and "Traceback" not in out
    logged = [r["step"] for r in _train_rows(workdir)]
    with Checkpointer(workdir / "checkpoints", read_only=True) as ckpt:
        # Every logged step is in the checkpoint: a resume repeats nothing and loses nothing.
        assert ckpt.all_steps() == [logged[-1]] and logged == list(range(1, logged[-1] + 1))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sft-cache")


def _signal_before(monkeypatch, owner, name, when):
    original = getattr(owner, name)

    def patched(self, *args, **kwargs):
        if when(self, *args):
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, patched)


@pytest.mark.parametrize(
    ("phase", "saved"), [("mid_step", 2), ("eval", 3), ("save", 3), ("after_last_step", 3)]
)
def test_sigterm_at_any_phase_ends_with_a_checkpoint(
    tmp_path, cache_dir, monkeypatch, phase, saved
):
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    config.num_steps, config.eval.every, config.eval.num_prompts = 3, 2, 4
    updates = []
    if phase == "mid_step":  # inside step 2's update
        _signal_before(
            monkeypatch,
            learner._Session,
            "update",
            lambda s, r, step: updates.append(1) or len(updates) == 2,
        )
    elif phase == "eval":  # entering the closing evaluation (step 3; the one at 2 is periodic)
        _signal_before(monkeypatch, learner._Session, "evaluate", lambda s, step: step == 3)
    elif phase == "save":  # entering the closing checkpoint write
        _signal_before(monkeypatch, Checkpointer, "save", lambda s, step, *rest: step == 3)
    else:  # after the last step, before the closing evaluation and save
        _signal_before(monkeypatch, learner._Session, "finish", lambda s: True)
    summary = learner.train(config, quiet=True)
    # The CLI exits with 128 + the signal for an interrupted run.
    assert summary["interrupted"] and summary["signal"] == signal.SIGTERM
    with Checkpointer(tmp_path / "run" / "checkpoints", read_only=True) as ckpt:
        assert ckpt.all_steps() == [saved] and ckpt.read_meta(saved)["step"] == saved
