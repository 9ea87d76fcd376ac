"""One writer per run directory (sat_jax.run.lock): a live holder is refused by name, a dead
holder's lock is taken over, ``train`` takes the lock before anything else, and ``eval`` on a
directory that is not a run fails in one line without creating anything."""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from sat_jax import config as config_lib
from sat_jax.run.lock import LOCK_FILE, WorkdirLock, WorkdirLocked, lock_path
from sat_jax.train import learner

_HOLDER = """
import sys, time
from sat_jax.run.lock import WorkdirLock
lock = WorkdirLock(sys.argv[1], "train")
lock.acquire()
print("locked", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """A live process holding the lock of tmp_path/run."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.stdout.readline().strip() == "locked"
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=60)


def test_live_holder_is_refused_by_name_and_dead_holder_taken_over(tmp_path, holder, caplog):
    workdir = str(tmp_path / "run")
    with pytest.raises(WorkdirLocked, match=rf"in use by `sat-jax train` \(pid {holder.pid} on"):
        WorkdirLock(workdir).acquire()
    holder.send_signal(signal.SIGKILL)  # no clean-up runs: the holder record stays behind
    holder.wait(timeout=60)
    record = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
    assert record["pid"] == holder.pid
    with caplog.at_level(logging.WARNING), WorkdirLock(workdir, "train") as lock:
        assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["pid"] == os.getpid()
        with pytest.raises(WorkdirLocked, match=rf"pid {os.getpid()}"):
            WorkdirLock(workdir).acquire()  # the same process, a second writer: refused too
    assert any(f"pid {holder.pid}" in r.getMessage() for r in caplog.records)
    assert lock._fd is None and (tmp_path / "run" / LOCK_FILE).read_text() == ""
    with WorkdirLock(workdir):  # released cleanly: taken again without a warning
        pass


def test_lock_paths():
    # gs:// in the bucket (tests/run/test_gcs_workdir.py); other URL schemes a local file each.
    assert lock_path("gs://a/x") == lock_path("gs://a/x/") == f"gs://a/x/{LOCK_FILE}"
    a, b = lock_path("memory://a/x"), lock_path("memory://b/x")
    assert a != b and "://" not in a and lock_path("memory://a/x/") == a


def test_train_refuses_a_workdir_in_use_before_anything_runs(tmp_path, holder):
    config = config_lib.get_config()
    config.workdir = str(tmp_path / "run")
    t0 = time.perf_counter()
    with pytest.raises(WorkdirLocked, match=f"pid {holder.pid}"):
        learner.train(config, quiet=True)
    assert sorted(os.listdir(tmp_path / "run")) == [LOCK_FILE]  # no metrics, no checkpoints
    assert time.perf_counter() - t0 < 30  # refused before building the model or the warm-up


def test_cli_eval_of_a_mistyped_workdir_is_one_line_and_creates_nothing(tmp_path):
    typo = tmp_path / "rnu"
    res = subprocess.run(
        [sys.executable, "-m", "sat_jax.cli", "eval", f"--workdir={typo}", "--config.mesh.data=1"],
        capture_output=True,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        timeout=300,
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"sat-jax: error: no checkpoints in {typo} ({typo}/checkpoints does not exist): is it a "
        "run directory?"
    ]
    assert not typo.exists()
