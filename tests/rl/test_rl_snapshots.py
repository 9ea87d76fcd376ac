"""The snapshot store (bounds, versions, host placement and its memory accounting) and what the
rollout sources keep in it, hand-checked without the trainer (a fake engine stands in for
sampling)."""

import threading
import time
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sat_jax.rl import LagSchedule, SnapshotStore
from sat_jax.rl.batch import RolloutBatch
from sat_jax.rl.rollout_sources import ScheduledRollouts
from sat_jax.rl.stream import StreamRollouts


def test_snapshot_store_bounds_and_versions():
    store = SnapshotStore(capacity=3)
    for v in range(5):
        store.put(v, {"w": np.full(2, v)})
    assert store.versions() == [2, 3, 4]
    assert store.latest()[0] == 4
    np.testing.assert_array_equal(store.get(3)["w"], [3, 3])
    with pytest.raises(KeyError, match="version 0 is not in the store"):
        store.get(0)
    with pytest.raises(ValueError, match="not newer"):
        store.put(4, {"w": np.zeros(2)})
    store.retain({2})
    assert store.versions() == [2, 4]  # the newest is always kept
    store.put(5, {"w": np.zeros(2)}, keep={2})
    assert store.versions() == [2, 5]  # keep names what stays besides the new version


def test_host_placement_keeps_the_sharding_and_accounts_memory():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    w = jax.device_put(jnp.arange(8, dtype=jnp.float32), sharding)
    host = SnapshotStore(capacity=2, placement="host")
    host.put(0, {"w": w})
    held = host.state()["0"]["w"]
    assert held.sharding.memory_kind == "pinned_host" and held.sharding.spec == sharding.spec
    back = host.get(0)["w"]
    assert back.sharding == sharding  # device memory again, same sharding
    chex.assert_trees_all_equal(back, np.arange(8))
    # 8 float32 = 32 bytes, split over two devices: this process holds all 32, in host memory.
    assert host.memory() == {
        "snapshots/versions": 1.0,
        "snapshots/bytes_per_version": 32.0,
        "snapshots/device_bytes": 0.0,
        "snapshots/host_bytes": 32.0,
    }
    device = SnapshotStore(capacity=2)
    device.put(0, {"w": w})
    device.put(1, {"w": w})
    assert device.memory()["snapshots/device_bytes"] == 64.0
    numpy_host = SnapshotStore(capacity=2, placement="host")
    numpy_host.put(0, {"w": np.ones(2)})
    assert isinstance(numpy_host.state()["0"]["w"], np.ndarray)


class _FakeSampler:
    """Three decode steps per batch, each recording the version it ran with."""

    max_prompt_len = 1

    def is_done(self, state):
        return len(state["versions"]) >= 3

    def decode(self, params, state, num_steps, version):
        time.sleep(0.001)
        return {"versions": state["versions"] + [version] * num_steps}

    def finalize(self, state):
        versions = np.array([state["versions"][:3]] * 2, np.int32)
        return types.SimpleNamespace(tokens=versions, versions=versions)


class _FakeEngine:
    """Batches of 2 sequences x 3 tokens whose ``versions`` say which version sampled them."""

    sampler = _FakeSampler()

    def start(self, params, examples, key):
        return {"versions": []}

    def generate(self, params, examples, key, version):
        versions = np.full((2, 3), params["v"], np.int32)
        return types.SimpleNamespace(tokens=versions, versions=versions)

    def score(self, examples, out):
        ones = np.ones((2, 3), np.float32)
        return RolloutBatch(
            tokens=np.zeros((2, 4), np.int32),
            input_mask=ones > 0,
            response_mask=ones > 0,
            behavior_logp=ones,
            cutoffs=ones,
            routing=np.zeros((1, 2, 3, 1), np.int32),
            versions=out.versions,
            advantages=ones[:, 0],
            rewards=ones[:, 0],
        )


@pytest.mark.parametrize("mode,lag", [("fixed", 2), ("fixed", 0), ("broadcast", 3)])
def test_scheduled_source_samples_the_scheduled_version_and_keeps_only_what_is_needed(mode, lag):
    schedule = LagSchedule(mode, lag)
    source = ScheduledRollouts(
        _FakeEngine(), schedule, iter(lambda: [{}], None), seed=0, needs_old=True
    )
    source.publish(0, {"v": 0})
    for step in range(10):
        rollout = source.next(step)
        expected = schedule.version_for(step)
        assert np.all(rollout.batch.versions == expected), step
        assert rollout.behaviour["old"] == {"v": expected}
        source.publish(step + 1, {"v": step + 1})  # the trainer's new version
        held = source.store.versions()
        assert len(held) <= schedule.capacity
        assert set(held) == {v for v in schedule.needed_after(step) if v <= step + 1} | {step + 1}
    if mode == "broadcast":
        assert source.store.versions() == [9, 10]  # the last broadcast copy and the newest


@pytest.mark.parametrize("needs_old", [False, True])
def test_stream_source_keeps_the_newest_and_the_versions_of_unconsumed_batches(needs_old):
    source = StreamRollouts(
        _FakeEngine(), iter(lambda: [{}], None), seed=0, queue_size=2, chunk=1, needs_old=needs_old
    )
    source.publish(0, {"v": 0})
    sizes = []
    seen_swaps, swaps = 0, []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            sizes.append(len(source.store.versions()))

    watcher = threading.Thread(target=watch)
    source.start()
    watcher.start()
    try:
        for step in range(8):
            rollout = source.next(step)
            live = rollout.batch.versions
            assert np.all(np.diff(live, axis=1) >= 0)  # versions only move forward
            if needs_old:  # the batch's oldest version, i.e. the one it started from
                assert rollout.behaviour["old"] == {"v": int(live.min())}
            else:
                assert rollout.behaviour == {}
            # Each version change inside a consumed batch is one swap; swaps can also land in
            # batches still queued or after a batch's last chunk, and each swap moves to a newer
            # published version, of which there are `step` (versions 1..step) so far.
            seen_swaps += int(np.count_nonzero(np.diff(live[0])))
            swaps.append(rollout.metrics["stream/swaps"])
            assert seen_swaps <= swaps[-1] <= step and swaps[-1] == int(swaps[-1])
            source.publish(step + 1, {"v": step + 1})
    finally:
        stop.set()
        watcher.join()
        source.close()
    assert swaps == sorted(swaps)  # a running count
    assert max(sizes) <= (2 + 2 if needs_old else 1) == source.store.capacity
