"""Non-finite values in training: the trainer step refuses a non-finite update, the learner
counts such steps and stops after ``optim.max_nonfinite_steps`` in a row, a NaN reward is
reported with its example, no checkpoint holds a non-finite value, and a warm-up cache entry
with one is rebuilt."""

import glob
import logging
import math

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from test_rl_system import tiny

from sat_jax import config as config_lib
from sat_jax import parallel
from sat_jax.rl import trainer
from sat_jax.run.checkpoint import Checkpointer
from sat_jax.run.metrics import read_metrics
from sat_jax.train import learner
from sat_jax.train.controls import NonFiniteError, NonFiniteGuard


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sft-cache")


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_step_with_non_finite_loss_is_not_applied(tmp_path, cache_dir):
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    parts = learner.build(config)
    examples = [parts.train_src[i] for i in range(4)]
    batch = parts.engine.score(
        examples, parts.engine.generate(parts.params, examples, jax.random.key(0), 0)
    )
    # Advantages that move the parameters, then the same batch with one NaN advantage.
    good = batch.replace(advantages=np.linspace(-1, 1, batch.size).astype(np.float32))
    bad_adv = np.asarray(good.advantages).copy()
    bad_adv[5] = np.nan
    bad = good.replace(advantages=bad_adv)
    mesh = parts.mesh
    step = trainer.make_train_step(
        parts.graphdef,
        parts.optimizer,
        parts.spec,
        prompt_width=config.data.max_prompt_len,
        mesh=mesh,
    )
    state = trainer.init_train_state(parts.params, parts.optimizer, mesh, config=parts.model_cfg)
    before = (_leaves(state.params), _leaves(state.opt_state), int(state.step))
    skipped, metrics = step(state, bad.shard(mesh), {})
    assert float(metrics["optim/nonfinite"]) == 1.0
    assert not math.isfinite(float(metrics["loss/total"]))
    for a, b in zip(_leaves(skipped.params), before[0], strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_leaves(skipped.opt_state), before[1], strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(skipped.step) == before[2] == 0
    applied, metrics = step(skipped, good.shard(mesh), {})
    assert float(metrics["optim/nonfinite"]) == 0.0 and int(applied.step) == 1
    assert any(
        not np.array_equal(a, b) for a, b in zip(_leaves(applied.params), before[0], strict=True)
    )


def test_guard_counts_steps_in_a_row():
    guard = NonFiniteGuard(3)
    assert guard.check(1, 0, 2) is None
    assert "step 2: 1 of 2 updates not applied" in guard.check(2, 1, 2)
    assert "2 steps in a row" in guard.check(3, 2, 2)
    assert guard.check(4, 0, 2) is None  # a clean step resets the count
    guard.check(5, 1, 2)
    guard.check(6, 1, 2)
    with pytest.raises(NonFiniteError, match=r"step 7: 3 steps in a row.*max_nonfinite_steps=3"):
        guard.check(7, 1, 2)
    assert guard.total == 5
    with pytest.raises(ValueError, match="max_in_a_row"):
        NonFiniteGuard(0)


def _nan_rewards(monkeypatch, which):
    """Makes the run's reward NaN for the completions ``which(example)`` selects."""
    build = learner.build

    def patched(config, log=lambda msg: None, **kwargs):
        parts = build(config, log, **kwargs)
        reward = parts.engine.reward
        parts.engine.reward = lambda text, ex: math.nan if which(ex) else reward(text, ex)
        return parts

    monkeypatch.setattr(learner, "build", patched)


def test_nan_reward_run_stops_and_saves_no_non_finite_value(
    tmp_path, cache_dir, monkeypatch, caplog
):
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    config.num_steps, config.checkpoint.every, config.optim.max_nonfinite_steps = 6, 1, 3
    config.lag_mode, config.lag = "fixed", 1
    _nan_rewards(monkeypatch, lambda ex: True)
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(NonFiniteError, match="stopping at step 3: 3 steps in a row"),
    ):
        learner.train(config, quiet=True)
    # Reported with the example that produced it.
    assert any(
        "non-finite reward nan for completion" in r.getMessage() and "'prompt'" in r.getMessage()
        for r in caplog.records
    )
    rows = [r for r in read_metrics(config.workdir) if "train/reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(
        r["optim/nonfinite_updates"] == 1 and r["train/nonfinite_rewards"] == 16 for r in rows
    )
    # Every checkpoint written holds finite values only, and the parameters never moved.
    parts = learner.build(config)
    state = trainer.init_train_state(
        parts.params, parts.optimizer, parts.mesh, config=parts.model_cfg
    )
    with Checkpointer(tmp_path / "run" / "checkpoints", read_only=True) as ckpt:
        steps = ckpt.all_steps()
        assert steps == [1, 2]
        for s in steps:
            target = learner._restore_target(state, parts.params, parts.params)(ckpt.read_meta(s))
            args = ocp.args.Composite(state=ocp.args.StandardRestore(target))
            restored = ckpt._manager.restore(s, args=args)["state"]  # no check of ours on the way
            assert all(np.isfinite(x).all() for x in _leaves(restored) if x.dtype.kind == "f")
            for a, b in zip(
                _leaves(restored["state"]["params"]), _leaves(parts.params), strict=True
            ):
                np.testing.assert_array_equal(a, b)


def test_an_occasional_nan_reward_skips_its_step_and_the_run_goes_on(
    tmp_path, cache_dir, monkeypatch
):
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    config.num_steps, config.lag_mode, config.lag = 4, "fixed", 1
    bad_prompt = []

    def which(ex):
        # The first prompt drawn is the bad row.
        bad_prompt[:] = bad_prompt or [ex["prompt"]]
        return ex["prompt"] == bad_prompt[0]

    _nan_rewards(monkeypatch, which)
    summary = learner.train(config, quiet=True)
    assert summary["end_step"] == 4
    skipped = [h["optim/nonfinite_updates"] for h in summary["history"]]
    bad = [h["train/nonfinite_rewards"] > 0 for h in summary["history"]]
    assert skipped == [float(b) for b in bad] and bad[0]
    state = parallel.to_host(summary["state"].params)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state))


def test_warmup_cache_with_non_finite_values_is_rebuilt(tmp_path, cache_dir):
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    config.sft.cache_dir = str(tmp_path / "cache")
    first = learner.build(config)
    (path,) = glob.glob(str(tmp_path / "cache" / "sft-*.npz"))
    with np.load(path) as data:
        arrays = [data[f"arr_{i}"] for i in range(len(data.files))]
    arrays[0] = np.full_like(arrays[0], np.inf)
    np.savez(path, *arrays)
    logs = []
    again = learner.build(config, logs.append)
    assert any("NaN or infinity" in m for m in logs) and "warm-up: trained" in logs[-1]
    for a, b in zip(_leaves(again.params), _leaves(first.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_resume_past_a_corrupt_newest_checkpoint_saves_that_step_again(tmp_path, cache_dir):
    config = tiny(config_lib.get_config(), tmp_path / "run", cache_dir)
    config.checkpoint.every = 1
    learner.train(config, quiet=True)  # steps 1 and 2
    ckpt_dir = tmp_path / "run" / "checkpoints"
    for path in (ckpt_dir / "2" / "state" / "d").iterdir():  # truncated: its data unreadable
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    config.num_steps = 3
    summary = learner.train(config, quiet=True)  # resumes at step 1, trains step 2 again
    assert summary["start_step"] == 1 and summary["end_step"] == 3
    assert [p.name.split(".")[0] for p in (ckpt_dir / "invalid").iterdir()] == ["2"]
    parts = learner.build(config)
    state = trainer.init_train_state(
        parts.params, parts.optimizer, parts.mesh, config=parts.model_cfg
    )
    with Checkpointer(ckpt_dir, read_only=True) as ckpt:
        target = learner._restore_target(state, parts.params, parts.params)
        _, meta, step = ckpt.restore(target, step=2, unchecked=learner._DATA)
    assert step == 2 and meta["step"] == 2
