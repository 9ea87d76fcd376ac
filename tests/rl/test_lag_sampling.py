"""The ``sampled`` lag mode: each group's lag drawn from a stated distribution on 1..cap with a
given mean. The realized histogram matches it, per-token versions are the snapshot that decoded
them, the store keeps every version still needed, and impossible knobs are config errors."""

import math
import types

import chex
import numpy as np
import pytest

from sat_jax import config as config_lib
from sat_jax.config import ConfigError, validate
from sat_jax.rl import LagSchedule
from sat_jax.rl.batch import RolloutBatch
from sat_jax.rl.lag import lag_pmf
from sat_jax.rl.rollout_sources import ScheduledRollouts

DISTS = pytest.mark.parametrize("dist", ["geometric", "zipf"])


@DISTS
@pytest.mark.parametrize("mean,cap", [(4, 16), (2, 32), (8, 16), (3, 4)])
def test_pmf_has_the_stated_mean_and_shape(dist, mean, cap):
    p = lag_pmf(dist, mean, cap)
    k = np.arange(1, cap + 1)
    assert p.shape == (cap,) and np.all(p >= 0)
    chex.assert_trees_all_close(p.sum(), 1.0, rtol=1e-12)
    chex.assert_trees_all_close(np.dot(k, p), mean, rtol=1e-9)
    # The family's form: geometric ratios p_{k+1}/p_k constant; Zipf log p linear in log k.
    if dist == "geometric":
        ratios = p[1:] / p[:-1]
        chex.assert_trees_all_close(ratios, ratios[0], rtol=1e-9)
    else:
        slope = np.diff(np.log(p)) / np.diff(np.log(k))
        chex.assert_trees_all_close(slope, slope[0], rtol=1e-9)
    if mean < (cap + 1) / 2:  # below the uniform mean: decreasing, most groups fresh
        assert np.all(np.diff(p) < 0)


def test_zipf_has_the_heavier_tail_at_the_same_mean():
    geo, zipf = lag_pmf("geometric", 4, 32), lag_pmf("zipf", 4, 32)
    assert zipf[0] > geo[0]  # more mass on lag 1 ...
    assert zipf[-8:].sum() > 10 * geo[-8:].sum()  # ... and far more on lags 25..32


def test_degenerate_means_put_all_mass_on_one_lag():
    np.testing.assert_array_equal(lag_pmf("zipf", 1, 4), [1, 0, 0, 0])
    np.testing.assert_array_equal(lag_pmf("geometric", 4, 4), [0, 0, 0, 1])


@DISTS
def test_realized_lags_match_the_distribution(dist):
    """32,000 group lags (2,000 steps × 16 groups, steps past the cap so no lag is cut at
    version 0). Tolerance: each bin's frequency within 4.5 binomial standard deviations of its
    probability (plus 1/n), and Pearson's χ² below its 0.999 quantile for cap − 1 degrees of
    freedom (Wilson–Hilferty)."""
    cap, groups, steps = 16, 16, range(100, 2100)
    s = LagSchedule("sampled", 4, dist, cap)
    versions = np.stack([s.group_versions(j, groups, seed=7) for j in steps])
    lags = (np.asarray(steps)[:, None] - versions).ravel()
    n = lags.size
    freq = np.bincount(lags, minlength=cap + 1)[1:] / n
    assert lags.min() >= 1 and lags.max() <= cap
    bound = 4.5 * np.sqrt(s.pmf * (1 - s.pmf) / n) + 1 / n
    assert np.all(np.abs(freq - s.pmf) <= bound), np.abs(freq - s.pmf) / bound
    expected = n * s.pmf
    chi2 = np.sum((freq * n - expected) ** 2 / expected)
    dof, z = cap - 1, 3.090  # z of 0.999
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < crit, (chi2, crit)
    chex.assert_trees_all_close(lags.mean(), 4, rtol=1e-7, atol=5 * lags.std() / math.sqrt(n))


def test_lag_draws_depend_on_seed_and_step_only():
    s = LagSchedule("sampled", 4, "zipf", 16)
    chex.assert_trees_all_equal(s.group_lags(5, 64, seed=1), s.group_lags(5, 64, seed=1))
    assert not np.array_equal(s.group_lags(5, 64, seed=1), s.group_lags(5, 64, seed=2))
    assert not np.array_equal(s.group_lags(5, 64, seed=1), s.group_lags(6, 64, seed=1))
    # Early steps: the version is cut at 0, as in the fixed mode.
    assert np.all(s.group_versions(2, 64, seed=1) == np.maximum(2 - s.group_lags(2, 64, 1), 0))


def test_capacity_is_what_the_schedule_ever_needs():
    s = LagSchedule("sampled", 3, "geometric", 5)
    assert s.capacity == 6
    for step in range(30):
        held = {v for v in s.needed_after(step) if v <= step + 1} | {step + 1}
        assert len(held) <= s.capacity
        # Every version a later batch can draw is kept.
        for later in range(step + 1, step + 8):
            assert {max(later - k, 0) for k in range(1, 6)} & set(range(step + 2)) <= held


@pytest.mark.parametrize(
    "mode,lag,dist,cap,match",
    [
        ("sampled", 17, "zipf", 16, "above its cap"),
        ("sampled", 0, "zipf", 16, "must be >= 1"),
        ("sampled", 2, "pareto", 16, "lag distribution"),
        ("sampled", 2, "zipf", 0, "lag cap"),
    ],
)
def test_bad_sampled_schedules(mode, lag, dist, cap, match):
    with pytest.raises(ValueError, match=match):
        LagSchedule(mode, lag, dist, cap)


class _FakeEngine:
    """G = 2 rows per prompt, 3 tokens a row. A snapshot is ``{"v": version}``; ``generate``
    writes the version *tag* into ``versions`` and the snapshot's own ``v`` into
    ``behavior_logp``, and each prompt's id into ``tokens``."""

    group_size = 2
    vmaps_versions = False

    def __init__(self):
        self.calls = []

    def generate(self, params, examples, key, version):
        self.calls.append((version, len(examples)))
        rows = len(examples) * self.group_size
        ids = np.repeat([ex["id"] for ex in examples], self.group_size)
        return types.SimpleNamespace(
            tokens=np.broadcast_to(ids[:, None], (rows, 4)).astype(np.int32),
            versions=np.full((rows, 3), version, np.int32),
            snapshot=np.full((rows, 3), params["v"], np.float32),
        )

    def score(self, examples, out):
        rows = out.tokens.shape[0]
        ones = np.ones((rows, 3), np.float32)
        return RolloutBatch(
            tokens=out.tokens,
            input_mask=np.ones((rows, 4), bool),
            response_mask=ones > 0,
            behavior_logp=out.snapshot,
            cutoffs=ones,
            routing=np.broadcast_to(out.tokens[None, :, :3, None], (1, rows, 3, 1)).copy(),
            versions=out.versions,
            advantages=ones[:, 0],
            rewards=ones[:, 0],
        )


def test_sampled_source_versions_are_the_snapshots_used_in_prompt_order():
    prompts_per_step, seed = 6, 3
    schedule = LagSchedule("sampled", 2, "zipf", 4)
    engine = _FakeEngine()
    batches = iter(lambda: [{"id": 10 + i} for i in range(prompts_per_step)], None)
    source = ScheduledRollouts(engine, schedule, batches, seed=seed, needs_old=False)
    source.publish(0, {"v": 0})
    for step in range(12):
        engine.calls.clear()
        rollout = source.next(step)
        batch = rollout.batch
        want = schedule.group_versions(step, prompts_per_step, seed)
        # Rows in prompt order (G = 2 each), the routing row along its own batch axis.
        chex.assert_trees_all_equal(batch.tokens[:, 0], np.repeat(10 + np.arange(6), 2))
        chex.assert_trees_all_equal(batch.routing[0, :, 0, 0], batch.tokens[:, 0])
        # Each group's tokens carry its drawn version, and that is the snapshot that decoded it.
        chex.assert_trees_all_equal(batch.versions, np.repeat(want, 2)[:, None] * np.ones(3))
        chex.assert_trees_all_equal(batch.behavior_logp, batch.versions)
        # One decode per distinct version, each padded to a power of two of prompts (<= 6).
        assert sorted(v for v, _ in engine.calls) == sorted(set(want.tolist()))
        for v, size in engine.calls:
            count = int(np.sum(want == v))
            assert size == min(1 << (count - 1).bit_length(), prompts_per_step)
        assert rollout.metrics["rollout/versions"] == len(set(want.tolist()))
        assert rollout.behaviour == {}
        source.publish(step + 1, {"v": step + 1})
        assert len(source.store.versions()) <= schedule.capacity


def _config(**fields):
    c = config_lib.get_config()
    for key, value in fields.items():
        node = c
        *path, leaf = key.split(".")
        for part in path:
            node = node[part]
        node[leaf] = value
    return c


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"rollout.router_noise": -0.5}, "rollout.router_noise must be a float >= 0"),
        ({"rollout.router_noise": float("inf")}, "rollout.router_noise must be finite"),
        ({"rollout.dtype": "float64"}, "rollout.dtype must be one of"),
        ({"lag_mode": "sampled", "lag": 20, "lag_cap": 16}, "above its cap"),
        ({"lag_mode": "sampled", "lag": 2, "lag_dist": "pareto"}, "lag_dist must be one of"),
        ({"lag_dist": "pareto"}, "lag_dist must be one of"),
        ({"lag_mode": "sampled", "lag": 2, "loss.correction": "tis"}, "mixes behaviour versions"),
        (
            {"lag_mode": "sampled", "lag": 2, "log.decompose_mismatch": True},
            "mixes behaviour versions",
        ),
        ({"lag_mode": "stream", "log.decompose_mismatch": True}, "one behaviour version"),
    ],
)
def test_impossible_knobs_are_one_config_error(fields, match):
    with pytest.raises(ConfigError, match=match):
        validate(_config(**fields))


def test_valid_knobs_pass():
    validate(_config(**{"lag_mode": "sampled", "lag": 4, "lag_dist": "zipf", "lag_cap": 32}))
    validate(_config(**{"rollout.dtype": "float16", "rollout.router_noise": 0.3}))
    validate(_config(**{"lag_mode": "fixed", "lag": 2, "log.decompose_mismatch": True}))
