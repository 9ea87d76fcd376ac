"""SIGTERM (what preemptible VMs and schedulers send) stops a run like Ctrl-C: a checkpoint at
the step it stopped after, so nothing trained is lost, and the shell's status for the signal."""

import os
import signal
import subprocess
import sys
import time

from test_rl_system import _cli_overrides, _train_rows

from sat_jax.run.checkpoint import Checkpointer


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
