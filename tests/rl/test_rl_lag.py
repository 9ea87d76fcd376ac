"""Lag bookkeeping (Section 4.4), the rollout sources' retention and the snapshot store,
hand-checked without the trainer (a fake engine stands in for sampling)."""

import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sat_jax.rl import LagSchedule, SnapshotStore, lag_stats, rng
from sat_jax.rl.batch import RolloutBatch
from sat_jax.rl.rollout_sources import ScheduledRollouts
from sat_jax.rl.stream import StreamRollouts


def test_fixed_lag_versions():
    s = LagSchedule("fixed", 3)
    assert [s.version_for(j) for j in range(7)] == [0, 0, 0, 0, 1, 2, 3]
    assert [s.version_for(j) for j in range(4)] == [0, 0, 0, 0]
    assert LagSchedule("fixed", 0).version_for(5) == 5  # on-policy
    assert s.needed_after(5) == {3, 4, 5, 6}


def test_broadcast_versions():
    # Weights reach the engine every n = 4 steps; batch j comes from the newest broadcast < j.
    s = LagSchedule("broadcast", 4)
    assert [s.version_for(j) for j in range(11)] == [0, 0, 0, 0, 0, 4, 4, 4, 4, 8, 8]
    lags = [j - s.version_for(j) for j in range(1, 11)]
    assert lags == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    one = LagSchedule("broadcast", 1)  # the usual one-step-off-policy pipeline
    assert [one.version_for(j) for j in range(5)] == [0, 0, 1, 2, 3]
    assert s.needed_after(6) == {4, 8}


@pytest.mark.parametrize(
    "mode,lag,error",
    [
        ("fixed", -1, ValueError),
        ("broadcast", 0, ValueError),
        ("sync", 1, ValueError),
        ("fixed", 1.5, TypeError),
    ],
)
def test_bad_schedules(mode, lag, error):
    with pytest.raises(error):
        LagSchedule(mode, lag)


def test_stream_has_no_schedule():
    with pytest.raises(ValueError, match="stream"):
        LagSchedule("stream", 2).version_for(3)


def test_lag_stats_split():
    # Response 0: tokens by versions 3, 3, 4 (a swap mid-decode), trained at step 6.
    # Response 1: all version 5, one padding slot.
    versions = np.array([[3, 3, 4], [5, 5, -1]])
    mask = np.array([[1, 1, 1], [1, 1, 0]], bool)
    s = lag_stats(versions, mask, step=6)
    lags = [3, 3, 2, 1, 1]
    assert s["lag/mean"] == pytest.approx(np.mean(lags))
    assert s["lag/max"] == 3 and s["lag/min"] == 1
    # N_PQS: v_last − v = [1, 1, 0, 0, 0]; N_IQS: step − v_last = [2, 2, 2, 1, 1]
    assert s["lag/pqs_mean"] == pytest.approx(2 / 5)
    assert s["lag/iqs_mean"] == pytest.approx(8 / 5)
    assert s["lag/pqs_mean"] + s["lag/iqs_mean"] == pytest.approx(s["lag/mean"])
    assert lag_stats(versions, np.zeros_like(mask), 6)["lag/mean"] == 0.0


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
    np.testing.assert_array_equal(back, np.arange(8))
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


def test_capacity_is_what_the_schedule_ever_needs():
    assert LagSchedule("fixed", 3).capacity == 4
    assert LagSchedule("fixed", 0).capacity == 1
    assert LagSchedule("broadcast", 8).capacity == 2
    for schedule in (LagSchedule("fixed", 3), LagSchedule("broadcast", 4)):
        for step in range(30):
            held = {v for v in schedule.needed_after(step) if v <= step + 1} | {step + 1}
            assert len(held) <= schedule.capacity, (schedule, step, held)


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
            assert rollout.metrics["stream/swaps"] >= 0
            source.publish(step + 1, {"v": step + 1})
    finally:
        stop.set()
        watcher.join()
        source.close()
    assert max(sizes) <= (2 + 2 if needs_old else 1) == source.store.capacity


def test_random_streams_are_named_and_keep_the_rollout_root():
    k = jax.random.key(7)
    same = jax.random.fold_in(jax.random.fold_in(k, 3), 1)
    assert jnp.array_equal(
        jax.random.key_data(rng.key(7, "rollout", 3, 1)), jax.random.key_data(same)
    )
    eval_key = jax.random.key_data(rng.key(7, "eval", 3))
    assert jnp.array_equal(eval_key, jax.random.key_data(rng.key(7, "eval", 3)))
    assert not jnp.array_equal(eval_key, jax.random.key_data(rng.key(7, "stream", 3)))
    assert not jnp.array_equal(eval_key, jax.random.key_data(rng.key(7, "rollout", 3)))
    assert rng.stream_id("eval") >= 2**31  # above every step index
    with pytest.raises(ValueError, match="indices"):
        rng.key(7, "eval", -1)
    with pytest.raises(ValueError, match="name"):
        rng.key(7, "")


def test_batch_specs_and_minibatches_follow_each_fields_batch_axis():
    specs = RolloutBatch.specs(("data",))
    assert specs.tokens == jax.sharding.PartitionSpec("data")
    assert specs.routing == jax.sharding.PartitionSpec(None, "data")
    two = RolloutBatch.specs()  # default: BATCH_AXES
    assert two.routing == jax.sharding.PartitionSpec(None, ("data", "fsdp"))
    b = 4
    batch = RolloutBatch(
        tokens=np.arange(b * 3).reshape(b, 3),
        input_mask=np.ones((b, 3), bool),
        response_mask=np.ones((b, 2), bool),
        behavior_logp=np.zeros((b, 2)),
        cutoffs=np.zeros((b, 2)),
        routing=np.arange(2 * b).reshape(2, b, 1, 1),
        versions=np.zeros((b, 2), int),
        advantages=np.arange(b, dtype=float),
        rewards=np.zeros(b),
    )
    first, second = batch.minibatches(2)
    np.testing.assert_array_equal(second.advantages, [2, 3])
    np.testing.assert_array_equal(second.routing[:, :, 0, 0], [[2, 3], [6, 7]])
    assert first.size == 2
    with pytest.raises(ValueError, match="equal minibatches"):
        list(batch.minibatches(3))
