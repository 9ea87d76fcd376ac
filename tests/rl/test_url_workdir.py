"""A URL (gs://) workdir keeps the run's metrics with its checkpoints: two runs whose URLs end
alike keep apart, and a run resumed on another VM (another working directory, no local files)
continues the workdir's metrics exactly. The bucket is a local directory here."""

import os

import pytest
from etils import epath
from test_rl_system import _same_rows, _train_rows, tiny

from sat_jax import config as config_lib
from sat_jax.run import lock as lock_lib
from sat_jax.run import workdir as workdir_lib
from sat_jax.run.metrics import read_metrics
from sat_jax.train import learner


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sft-cache")


class _NoLease:
    """The bucket lock's stand-in: the bucket here is a local directory, which has no object
    generations (tests/run/test_gcs_workdir.py tests the lock against a GCS emulator)."""

    def __init__(self, *args):
        pass

    def acquire(self, holder):
        pass

    def check(self):
        pass

    def release(self):
        pass


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    root = tmp_path / "gcs"
    monkeypatch.setattr(
        workdir_lib, "remote", lambda url: epath.Path(root / url.split("://", 1)[1].rstrip("/"))
    )
    monkeypatch.setattr(lock_lib, "_BucketLease", _NoLease)
    return root


def test_runs_whose_urls_end_alike_have_their_own_local_logs(bucket):
    a, b = config_lib.get_config(), config_lib.get_config()
    a.workdir, b.workdir = "gs://a/x", "gs://b/x"
    (log_a, ckpt_a), (log_b, ckpt_b) = workdir_lib.run_paths(a), workdir_lib.run_paths(b)
    assert log_a != log_b and ckpt_a == str(bucket / "a" / "x" / "checkpoints") != ckpt_b


def test_metrics_live_in_the_url_workdir_and_survive_the_vm(
    tmp_path, cache_dir, bucket, monkeypatch
):
    def config(workdir, num_steps=4):
        c = tiny(config_lib.get_config(), workdir, cache_dir)
        c.num_steps, c.checkpoint.every, c.lag_mode, c.lag = num_steps, 2, "fixed", 1
        return c

    learner.train(config(tmp_path / "local"), quiet=True)  # the reference, uninterrupted
    (tmp_path / "vm1").mkdir()
    monkeypatch.chdir(tmp_path / "vm1")
    learner.train(config("gs://bkt/runs/r"), max_steps=3, quiet=True)  # checkpoint at 2, log 3
    remote = bucket / "bkt" / "runs" / "r"
    assert [r["step"] for r in _train_rows(remote)] == [1, 2, 3]
    assert (remote / "config.json").is_file() and (remote / "checkpoints" / "2").is_dir()
    # Preempted: a new VM with nothing local resumes from the bucket.
    (tmp_path / "vm2").mkdir()
    monkeypatch.chdir(tmp_path / "vm2")
    summary = learner.train(config("gs://bkt/runs/r"), quiet=True)
    assert summary["start_step"] == 3  # the closing checkpoint of the first session
    _same_rows(_train_rows(tmp_path / "local"), _train_rows(remote))
    # Starting over moves the workdir's metrics aside with its checkpoints.
    again = config("gs://bkt/runs/r", num_steps=1)
    again.resume = False
    learner.train(again, quiet=True)
    assert [r["step"] for r in _train_rows(remote)] == [1]
    (replaced,) = [p for p in os.listdir(remote) if p.startswith("replaced-")]
    assert len(read_metrics(remote / replaced)) == len(read_metrics(tmp_path / "local"))
