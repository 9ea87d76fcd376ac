"""sat_jax.run.checkpoint: what may be skipped on restore (only corruption), finiteness on save
and restore, and read-only opening."""

import logging
import os

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from sat_jax.run import checkpoint as checkpoint_lib
from sat_jax.run.checkpoint import Checkpointer, NonFiniteStateError


def _state(value: float) -> dict:
    return {"w": jnp.full((4, 3), value, jnp.float32), "b": jnp.arange(3.0), "count": 2}


def _save(ckpt: Checkpointer, steps) -> None:
    for s in steps:
        assert ckpt.save(s, _state(float(s)), {"step": s})
    ckpt.wait()


def test_save_refuses_non_finite_state_and_writes_nothing(tmp_path):
    ckpt = Checkpointer(tmp_path)
    _save(ckpt, [0])
    bad = _state(1.0)
    bad["w"] = bad["w"].at[2, 1].set(jnp.nan)
    bad["extra"] = {"v": jnp.array([1.0, jnp.inf], jnp.bfloat16), "n": np.array([3], np.int32)}
    with pytest.raises(NonFiniteStateError, match=r"step 1 .*\['extra'\]\['v'\], \['w'\]$"):
        ckpt.save(1, bad, {})
    with pytest.raises(NonFiniteStateError, match=r"\['lr'\]"):
        ckpt.save(1, {"lr": float("nan")}, {})
    ckpt.wait()
    assert ckpt.all_steps() == [0]
    assert sorted(os.listdir(tmp_path)) == ["0"]  # not even a temporary directory is left


def test_restore_walks_back_past_a_non_finite_checkpoint(tmp_path, caplog):
    ckpt = Checkpointer(tmp_path)
    _save(ckpt, [0, 1])
    # A checkpoint with an infinity, written past the guard (as by an older version).
    bad = _state(2.0)
    bad["b"] = bad["b"].at[0].set(-jnp.inf)
    ckpt._manager.save(
        2,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(bad), meta=ocp.args.JsonSave({"step": 2})
        ),
    )
    ckpt.wait()
    with caplog.at_level(logging.WARNING):
        restored, meta, step = ckpt.restore(_state(0.0))
    assert step == 1 and meta == {"step": 1}
    np.testing.assert_array_equal(restored["w"], np.full((4, 3), 1.0, np.float32))
    assert any(
        "step 2" in r.getMessage() and "infinity in ['b']" in r.getMessage() for r in caplog.records
    )


@pytest.mark.parametrize(
    "error",
    [
        MemoryError("host memory exhausted"),
        RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1073741824 bytes"),
        OSError(5, "Input/output error"),
        ValueError("UNAVAILABLE: Error reading gs://bucket/run/2/state: 503 Service Unavailable"),
    ],
    ids=["memory", "device-oom", "eio", "unavailable"],
)
def test_restore_stops_on_errors_that_are_not_corruption(tmp_path, monkeypatch, error):
    ckpt = Checkpointer(tmp_path)
    _save(ckpt, [0, 1, 2])
    real = ckpt._manager.restore
    calls = []

    def flaky(step, args=None):
        calls.append(step)
        if "state" in args.keys():
            raise error
        return real(step, args=args)

    monkeypatch.setattr(ckpt._manager, "restore", flaky)
    with pytest.raises(type(error), match=str(error.args[-1])[:20]):
        ckpt.restore(_state(0.0))
    assert calls == [2, 2]  # the meta and the state of the newest step, and nothing older
    monkeypatch.setattr(ckpt._manager, "restore", real)
    # The newest step is not marked invalid: it restores once the error is gone, and a save
    # after it is refused instead of moving it aside.
    restored, _, step = ckpt.restore(_state(0.0))
    assert step == 2 and float(restored["w"][0, 0]) == 2.0
    with pytest.raises(ValueError, match="already exist"):
        ckpt.save(1, _state(1.0), {})
    assert not (tmp_path / "invalid").exists()


def test_corruption_signatures():
    tensorstore = ValueError(
        'OUT_OF_RANGE: Error reading "w/0" in OCDBT database at local file "/r/2/state/": '
        "Requested byte range [0, 2291) is not valid for value of size 1276"
    )
    wrapped = Exception("Encountered error while reading array index: (slice(0, 4, 1),)")
    wrapped.__cause__ = tensorstore
    assert checkpoint_lib._is_corruption(wrapped)
    assert checkpoint_lib._is_corruption(ValueError("FAILED_PRECONDITION: Truncated Zstd stream"))
    assert checkpoint_lib._is_corruption(ValueError("DATA_LOSS: checksum mismatch"))
    assert not checkpoint_lib._is_corruption(ValueError("RESOURCE_EXHAUSTED: out of memory"))
    assert not checkpoint_lib._is_corruption(ValueError("tree structures do not match"))
    assert not checkpoint_lib._is_corruption(OSError(5, "Input/output error"))


def test_read_only_creates_and_cleans_nothing(tmp_path):
    missing = tmp_path / "typo"
    with pytest.raises(FileNotFoundError, match="typo"):
        Checkpointer(missing, read_only=True)
    assert not missing.exists()
    writer = Checkpointer(tmp_path / "run")
    _save(writer, [0, 1])
    # A save in flight by the writer: its temporary directory.
    in_flight = tmp_path / "run" / "2.orbax-checkpoint-tmp-1733100000000000"
    (in_flight / "state").mkdir(parents=True)
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*"))
    with Checkpointer(tmp_path / "run", read_only=True) as reader:
        assert reader.latest_step() == 1
        restored, _, step = reader.restore(_state(0.0))
        assert step == 1 and float(restored["w"][0, 0]) == 1.0
        with pytest.raises(ValueError, match="read-only"):
            reader.save(5, _state(5.0), {})
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*")) == before


def test_an_error_raised_while_handling_a_missing_file_is_not_corruption(tmp_path, monkeypatch):
    # Out of memory while orbax handles a missing file: the FileNotFoundError is only the
    # context of the real failure, which must stop the restore instead of walking past step 2.
    ckpt = Checkpointer(tmp_path)
    _save(ckpt, [1, 2])
    real = ckpt._manager.restore

    def oom_while_handling(step, args=None):
        if "state" in args.keys():
            try:
                raise FileNotFoundError("a cache file")
            except FileNotFoundError:
                raise MemoryError("host memory exhausted")  # noqa: B904 (the context is the point)
        return real(step, args=args)

    monkeypatch.setattr(ckpt._manager, "restore", oom_while_handling)
    with pytest.raises(MemoryError):
        ckpt.restore(_state(0.0))
    assert ckpt.all_steps() == [1, 2] and not (tmp_path / "invalid").exists()
    context = MemoryError("oom")
    context.__context__ = FileNotFoundError("x")
    caused = ValueError("read failed")
    caused.__cause__ = FileNotFoundError("x")
    assert not checkpoint_lib._is_corruption(context)
    assert checkpoint_lib._is_corruption(caused)
