"""sat_jax.run.checkpoint: round trips, sharded targets, meta-driven targets, walk-back."""

import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from sat_jax.run.checkpoint import Checkpointer


def _params(seed: int) -> dict:
    """A small nnx-style nested parameter dict with mixed dtypes."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "embed": {"embedding": jax.random.normal(k1, (5, 4), jnp.float32)},
        "layers": {"0": {"w": jax.random.normal(k2, (4, 4)).astype(jnp.bfloat16)}},
        "scale": jnp.full((4,), seed, jnp.float32),
    }


def _state(step: int, versions: tuple[int, ...] = (3, 4)) -> dict:
    params = _params(step)
    return {
        "params": params,
        "opt_state": optax.adam(1e-3).init(params),
        "step": step,
        "rng": jax.random.key_data(jax.random.key(step)),
        "snapshots": {str(v): _params(100 + v) for v in versions},
    }


def _assert_bitwise_equal(actual, expected) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        if isinstance(e, int | float):
            assert type(a) is type(e) and a == e
            continue
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype and a.shape == e.shape
        assert a.tobytes() == e.tobytes()


def _save_steps(ckpt: Checkpointer, steps) -> dict:
    saved = {}
    for s in steps:
        saved[s] = _state(s)
        assert ckpt.save(s, saved[s], {"step": s, "iterator": {"epoch": 0, "index": 10 * s}})
    ckpt.wait()
    return saved


def test_round_trip_concrete_target_preserves_structure(tmp_path):
    state = _state(7)
    meta = {"versions": (3, 4), "pos": np.int64(12), "config": {"lr": 1e-3}}
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.save(7, state, meta)
        assert ckpt.latest_step() == 7 and ckpt.all_steps() == [7]
        restored, rmeta, step = ckpt.restore(_state(0))
    assert step == 7
    assert rmeta == {"versions": [3, 4], "pos": 12, "config": {"lr": 1e-3}}
    _assert_bitwise_equal(restored, state)
    # optax NamedTuples come back as NamedTuples when the target has them.
    assert type(restored["opt_state"][0]) is type(state["opt_state"][0])
    assert restored["params"]["layers"]["0"]["w"].dtype == jnp.bfloat16
    key = jax.random.wrap_key_data(restored["rng"])
    assert jax.random.key_data(key).dtype == jnp.uint32


def test_abstract_sharded_target(tmp_path):
    mesh = jax.make_mesh((8,), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), sharding)
    state = {"x": x, "count": 3}
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, state, {})
    target = {"x": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharding), "count": 0}
    restored, _, _ = ckpt.restore(target)
    assert restored["x"].sharding == sharding
    np.testing.assert_array_equal(restored["x"], x)
    assert restored["count"] == 3
    ckpt.close()


def test_meta_driven_target_walks_back_across_structures(tmp_path, caplog):
    ckpt = Checkpointer(tmp_path)
    saved = {1: _state(1, versions=(0,)), 2: _state(2, versions=(0, 1))}
    for s, st in saved.items():
        ckpt.save(s, st, {"versions": list(st["snapshots"])})

    def make_target(meta):
        return _state(0, versions=tuple(int(v) for v in meta["versions"]))

    assert ckpt.read_meta() == {"versions": ["0", "1"]}
    restored, _, step = ckpt.restore(make_target)
    assert step == 2
    _assert_bitwise_equal(restored, saved[2])
    # Corrupt step 2: the walk-back must rebuild the (smaller) target from step 1's meta.
    os.remove(tmp_path / "2" / "state" / "_METADATA")
    with caplog.at_level(logging.WARNING):
        restored, meta, step = ckpt.restore(make_target)
    assert step == 1 and meta == {"versions": ["0"]}
    _assert_bitwise_equal(restored, saved[1])
    assert any("step 2" in r.getMessage() for r in caplog.records)


def _truncate_data_files(step_dir: Path) -> None:
    for path in (step_dir / "state" / "d").iterdir():
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_corrupt_latest_falls_back_and_save_moves_it_aside(tmp_path, caplog, damage):
    ckpt = Checkpointer(tmp_path)
    saved = _save_steps(ckpt, [0, 1, 2])
    if damage == "truncate":
        _truncate_data_files(tmp_path / "2")
    else:
        os.remove(tmp_path / "2" / "state" / "_METADATA")
    with caplog.at_level(logging.WARNING):
        restored, meta, step = ckpt.restore(_state(0))
    assert step == 1 and meta["iterator"]["index"] == 10
    _assert_bitwise_equal(restored, saved[1])
    assert any("step 2" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="step 2"):
        ckpt.restore(_state(0), step=2)
    # Resuming from step 1 and saving step 2 again must work: the bad step is moved aside.
    assert ckpt.save(2, saved[2], {"again": True})
    assert (tmp_path / "invalid").is_dir() and len(list((tmp_path / "invalid").iterdir())) == 1
    restored, meta, step = ckpt.restore(_state(0))
    assert step == 2 and meta == {"again": True}
    _assert_bitwise_equal(restored, saved[2])


def test_bogus_incomplete_step_directory_is_skipped(tmp_path, caplog):
    ckpt = Checkpointer(tmp_path)
    saved = _save_steps(ckpt, [0, 1])
    (tmp_path / "7" / "state").mkdir(parents=True)
    (tmp_path / "7" / "state" / "junk").write_bytes(b"x")
    ckpt = Checkpointer(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert ckpt.latest_step() == 1
        assert ckpt.all_steps() == [0, 1]
        restored, _, step = ckpt.restore(_state(0))
    assert step == 1
    _assert_bitwise_equal(restored, saved[1])
    assert any("step 7" in r.getMessage() for r in caplog.records)
    # Saving a later step must not be blocked by the bogus directory.
    assert ckpt.save(2, saved[1], {})
    assert ckpt.all_steps() == [0, 1, 2]


def test_empty_directory_and_nothing_valid(tmp_path):
    ckpt = Checkpointer(tmp_path / "run")
    assert ckpt.latest_step() is None and ckpt.all_steps() == []
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ckpt.restore(_state(0))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ckpt.read_meta()
    ckpt.save(0, {"a": jnp.ones(3)}, {})
    with pytest.raises(ValueError, match="no checkpoint at step 5"):
        ckpt.restore({"a": jnp.ones(3)}, step=5)
    # A target that matches nothing is the caller's error, not corruption: raised as it is.
    with pytest.raises(ValueError, match="tree structures do not match"):
        ckpt.restore({"b": jnp.ones(3)})
    assert ckpt.latest_step() == 0


def test_save_interval_async_and_input_checks(tmp_path):
    ckpt = Checkpointer(tmp_path, save_interval_steps=2, async_save=True)
    state = {"w": jnp.ones(2)}
    assert ckpt.save(0, state, {})
    assert not ckpt.save(1, state, {})
    assert ckpt.save(3, state, {}, force=True)
    ckpt.wait()
    assert ckpt.all_steps() == [0, 3]
    with pytest.raises(ValueError, match="already exist"):
        ckpt.save(2, state, {}, force=True)
    with pytest.raises(TypeError, match="key_data"):
        ckpt.save(4, {"rng": jax.random.key(0)}, {})
    with pytest.raises(TypeError, match=r"meta\['bad'\]"):
        ckpt.save(4, state, {"bad": object()})
    with pytest.raises(ValueError, match="non-negative"):
        ckpt.save(-1, state, {})
    ckpt.close()


def test_a_corrupt_step_found_by_restore_is_moved_aside_at_once(tmp_path, caplog):
    ckpt = Checkpointer(tmp_path)
    saved = _save_steps(ckpt, [1, 2])
    _truncate_data_files(tmp_path / "2")
    ckpt = Checkpointer(tmp_path)  # a resumed run: nothing known about step 2 yet
    assert ckpt.all_steps() == [1, 2]  # structurally complete
    with caplog.at_level(logging.WARNING):
        _, _, step = ckpt.restore(_state(0))
    assert step == 1
    # Kept for inspection, out of the steps, and the message says what moved where and why.
    (moved,) = (tmp_path / "invalid").iterdir()
    assert moved.name.startswith("2.") and (moved / "state").is_dir()
    assert not (tmp_path / "2").exists() and ckpt.all_steps() == [1]
    assert any(
        "step 2" in r.getMessage()
        and str(moved) in r.getMessage()
        and "restore failed" in r.getMessage()
        for r in caplog.records
    )
    # The resumed run's save of step 2 really writes.
    assert ckpt.save(2, saved[2], {"again": True})
    ckpt.wait()
    restored, meta, step = Checkpointer(tmp_path, read_only=True).restore(_state(0))
    assert step == 2 and meta == {"again": True}
    _assert_bitwise_equal(restored, saved[2])


def test_read_only_restore_moves_nothing(tmp_path):
    ckpt = Checkpointer(tmp_path)
    _save_steps(ckpt, [1, 2])
    _truncate_data_files(tmp_path / "2")
    _, _, step = Checkpointer(tmp_path, read_only=True).restore(_state(0))
    assert step == 1 and (tmp_path / "2").is_dir() and not (tmp_path / "invalid").exists()
