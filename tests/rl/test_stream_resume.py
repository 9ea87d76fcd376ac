"""Stream mode's resume: finished batches not yet trained on are saved with their per-token
versions and the snapshot versions they need, and come back in order; a partial rollout is
discarded with a logged count; the batch wait is a config field its error names."""

import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_rl_system import _cli_overrides, _train_rows, tiny

from sat_jax import config as config_lib
from sat_jax.config.validation import ConfigError, validate
from sat_jax.rl import trainer
from sat_jax.rl.stream import StreamRollouts
from sat_jax.run.checkpoint import Checkpointer
from sat_jax.train import learner


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sft-cache")


def _same_batch(a, b):
    for name in a.fields():
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def _newest_checkpoint(config):
    """(state, meta, step) of the newest checkpoint of ``config``'s run, as the learner saved it."""
    with Checkpointer(f"{config.workdir}/checkpoints", read_only=True) as ckpt:
        parts = learner.build(config)
        state = trainer.init_train_state(
            parts.params, parts.optimizer, parts.mesh, config=parts.model_cfg
        )
        target = learner._restore_target(state, parts.params, parts.params, StreamRollouts)
        return ckpt.restore(target, unchecked=("stream",))


def _record_batches(monkeypatch) -> list:
    """The batches the learner's stream source hands out, in order."""
    seen, real_next = [], StreamRollouts.next

    def recording(self, step, timeout=None):
        rollout = real_next(self, step, timeout)
        seen.append(rollout.batch)
        return rollout

    monkeypatch.setattr(StreamRollouts, "next", recording)
    return seen


def test_queued_batches_survive_a_checkpoint_in_order(tmp_path, cache_dir, caplog):
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    config.loss.ratio_denominator = "recompute"  # batches need their behaviour version
    parts = learner.build(config)
    prompts = iter(lambda: [parts.train_src[i] for i in range(4)], None)
    source = StreamRollouts(parts.engine, prompts, seed=0, queue_size=2, needs_old=True)
    source.publish(0, parts.params)
    source.start()
    try:
        while source._finished is None:  # the queue is full and a third batch waits
            source._thread.join(0.05)
            assert source._error is None
        source.publish(1, parts.params)  # a newer version: the batches need version 0 kept
        arrays, meta = source.state()
    finally:
        source.close()
    assert [q["index"] for q in meta["queued"]] == [0, 1, 2]
    assert [q["started"] for q in meta["queued"]] == [0, 0, 0]
    assert source.store.versions() == [0, 1]
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        state = {"stream": arrays, "store": source.store.state()}
        ckpt.save(1, state, {"stream": meta}, unchecked=("stream",))
        ckpt.wait()
        restored, rmeta, _ = ckpt.restore(
            lambda m: {
                "stream": StreamRollouts.restore_target(m["stream"]),
                "store": {str(v): parts.params for v in (0, 1)},
            },
            unchecked=("stream",),
        )
    resumed = StreamRollouts(parts.engine, prompts, seed=0, queue_size=2, needs_old=True)
    resumed.store.load(restored["store"])
    with caplog.at_level(logging.WARNING):
        resumed.restore(restored["stream"], rmeta["stream"])
    assert resumed._index == meta["next_index"] == 3
    assert ("discarded 1 rollout batch" in caplog.text) == bool(meta["inflight"])
    expected = [arrays[str(i)] for i in range(3)]
    for i in range(3):  # next() serves the saved batches without the worker
        rollout = resumed.next(i) if i < 2 else None
        if rollout is None:  # the one that waited for a slot goes into the queue first
            resumed._hand_over()
            rollout = resumed.next(i)
        _same_batch(rollout.batch, type(rollout.batch)(**expected[i]))
        assert rollout.behaviour["old"] is not None
    resumed.close()


def test_stream_run_resumed_trains_first_on_the_batches_it_had_queued(
    tmp_path, cache_dir, monkeypatch
):
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    config.lag_mode, config.lag, config.num_steps = "stream", 2, 2
    learner.train(config, quiet=True)
    saved, meta, _ = _newest_checkpoint(config)
    queued = meta["stream"]["queued"]
    assert queued, "the worker ran ahead of the trainer"
    assert [q["index"] for q in queued] == list(range(2, 2 + len(queued)))
    seen = _record_batches(monkeypatch)
    config.num_steps = 2 + len(queued)
    summary = learner.train(config, quiet=True)
    assert summary["start_step"] == 2 and len(seen) == len(queued)
    for batch, q in zip(seen, queued, strict=True):
        _same_batch(batch, type(batch)(**saved["stream"][str(q["index"])]))
    # Their tokens' versions are the old ones: the staleness they had is what is logged.
    assert summary["history"][0]["lag/max"] >= 1


def test_batch_wait_is_a_config_field_named_by_its_error(tmp_path, cache_dir):
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    config.rollout.stream_timeout_s = 0.0
    with pytest.raises(ConfigError, match="rollout.stream_timeout_s"):
        validate(config)
    config.rollout.stream_timeout_s = 0.3
    validate(config)
    parts = learner.build(config)
    config.lag_mode, config.lag = "stream", 1
    source = learner.make_source(config, parts, iter([]), first_step=0)  # never started
    assert source.timeout == 0.3
    with pytest.raises(TimeoutError, match=r"within 0.3 s \(rollout.stream_timeout_s"):
        source.next(0)


def test_a_partial_rollout_is_discarded_with_a_logged_count(caplog):
    prompts = iter([])
    source = StreamRollouts(engine=None, prompts=prompts, seed=0, queue_size=2)
    position = {"epoch": 0, "index": 12}
    source._index, source._inflight = 4, (3, position)  # decoding batch 3, drawn at 12
    arrays, meta = source.state()
    assert arrays == {} and meta == {
        "queued": [],
        "next_index": 3,
        "iterator": position,
        "inflight": 1,
        "inflight_groups": 0,
    }
    resumed = StreamRollouts(engine=None, prompts=prompts, seed=0, queue_size=2)
    with caplog.at_level(logging.WARNING):
        resumed.restore({}, meta)
    assert resumed._index == 3  # batch 3 is decoded again from the prompts it drew
    assert "discarded 1 rollout batch(es)" in caplog.text and "from batch 3 on" in caplog.text
    # Without saving batches (multi-host), the finished ones are discarded too, and drawn again.
    source._pinned, source._drawn_at = {1: 0, 2: 0}, {1: {"epoch": 0, "index": 4}, 2: position}
    source._inflight = (2, position)
    source.queue.put_nowait((1, "a finished batch"))
    arrays, meta = source.state(batches=False)
    assert arrays == {} and meta == {
        "queued": [],
        "next_index": 1,
        "iterator": {"epoch": 0, "index": 4},
        "inflight": 2,
        "inflight_groups": 0,
    }


def test_stream_run_killed_and_resumed_loses_no_queued_batch(
    tmp_path, cache_dir, monkeypatch, caplog
):
    workdir = tmp_path / "run"
    stream = ["--config.lag_mode=stream", "--config.lag=2", "--config.checkpoint.every=2"]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sat_jax.cli",
            "train",
            *_cli_overrides(workdir, cache_dir),
            "--config.num_steps=100000",
            "--config.eval.every=0",
            *stream,
        ],
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (workdir / "metrics.jsonl").exists() and len(_train_rows(workdir)) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    config = tiny(config_lib.get_config(), workdir, cache_dir)
    config.lag_mode, config.lag, config.checkpoint.every = "stream", 2, 2
    saved, meta, step = _newest_checkpoint(config)
    queued = meta["stream"]["queued"]
    assert step >= 2 and queued and queued[0]["index"] == step
    seen = _record_batches(monkeypatch)
    config.num_steps = step + len(queued)
    with caplog.at_level(logging.WARNING):
        summary = learner.train(config, quiet=True)
    assert summary["start_step"] == step and len(seen) == len(queued)
    for batch, q in zip(seen, queued, strict=True):  # trained on, in order, as saved
        _same_batch(batch, type(batch)(**saved["stream"][str(q["index"])]))
    assert ("discarded 1 rollout batch" in caplog.text) == bool(meta["stream"]["inflight"])
    assert [r["step"] for r in _train_rows(workdir)] == list(range(1, step + len(queued) + 1))
