"""SIGTERM at any moment of a run, to one of two processes: during the closing evaluation, during
the closing save and after the last step (mid-step: test_multihost_safety). Both processes end
with the signal's status (143) and the checkpoint holds the step the run stopped after. One
process, every phase: tests/rl/test_preemption.py."""

import os
import signal
import subprocess
import sys

import pytest
from test_multihost_safety import _finish, _train_args
from test_two_processes import _env, _free_port

from sat_jax.run.checkpoint import Checkpointer

_DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_preempt.py")

# 3 steps, an evaluation at step 2 and a closing one at step 3, no periodic checkpoint: the only
# checkpoint is the one the signal (or the run's end) writes.
_STEPS = ["--config.num_steps=3", "--config.eval.every=2", "--config.eval.num_prompts=4"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sft-cache")


@pytest.mark.parametrize("phase", ["eval", "save", "after_last_step"])
def test_sigterm_at_any_phase_saves_and_exits_143_everywhere(tmp_path, cache_dir, phase):
    processes, workdir = 2, tmp_path / "run"
    args = [
        a
        for a in _train_args(workdir, _free_port(), cache_dir)
        if not a.startswith("--config.eval.every")
    ]
    args += [*_STEPS, "--config.checkpoint.every=0"]
    procs = [
        subprocess.Popen(
            [sys.executable, _DRIVER, phase, "1", *args, f"--process_id={i}"],
            env=_env(processes),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]
    outs = _finish(procs)
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 128 + signal.SIGTERM, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
    assert "SIGTERM: stopping after this step" in outs[-1]
    with Checkpointer(workdir / "checkpoints", read_only=True) as ckpt:
        assert ckpt.all_steps() == [3] and ckpt.read_meta(3)["step"] == 3
