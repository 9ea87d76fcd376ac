"""Mismatch-shape diagnostics against NumPy references on small hand batches (masked positions,
empty rows), the staleness/engine decomposition, the clip split, and sharded == unsharded."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sat_jax import losses

JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


def _call(fn, jit, *args, **kw):
    return jax.jit(lambda *a: fn(*a, **kw))(*args) if jit else fn(*args, **kw)


def _lower_quantile(values, alpha):
    """⌈α·n⌉-th smallest (1-based), by sorting: the definition, not the bisection."""
    v = np.sort(np.asarray(values, np.float64))
    return 0.0 if v.size == 0 else v[max(math.ceil(round(alpha * v.size, 9)), 1) - 1]


def _reference_shape(logp, beh, mask):
    d = np.where(mask, np.clip(logp - beh, -20, 20), 0.0).astype(np.float64)
    a = np.abs(d[mask])
    w = np.exp(d[mask])
    ess = (w.sum() ** 2) / (w.size * (w * w).sum()) if w.size else 0.0
    return {
        "p50": _lower_quantile(a, 0.5),
        "p90": _lower_quantile(a, 0.9),
        "p99": _lower_quantile(a, 0.99),
        "max": a.max() if a.size else 0.0,
        "seq_sum_max": np.abs(d.sum(axis=1)).max(),
        "ess": ess,
    }


# Three rows; the middle one empty. Masked positions hold inf / nan, which must never matter.
LOGP = np.array(
    [
        [math.log(0.5), math.log(0.2), math.log(0.9), np.inf],
        [np.nan, np.inf, -np.inf, 0.0],
        [math.log(0.3), math.log(0.6), math.log(0.05), math.log(0.4)],
    ],
    np.float32,
)
BEH = np.array(
    [
        [math.log(0.4), math.log(0.4), math.log(0.9), 0.0],
        [0.0, 0.0, 0.0, 0.0],
        [math.log(0.3), math.log(0.3), math.log(0.1), math.log(0.8)],
    ],
    np.float32,
)
MASK = np.array([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)


@JIT
def test_mismatch_shape_matches_numpy(jit):
    got = _call(losses.mismatch_shape, jit, LOGP, BEH, MASK)
    want = _reference_shape(LOGP, BEH, MASK)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
    # Hand values: |d| = [log 1.25, log 2, 0 | 0, log 2, log 2, log 2], n = 7.
    # ⌈0.5·7⌉ = 4th smallest of (0, 0, .223, .693, .693, .693, .693) = log 2; p90, p99: 7th.
    np.testing.assert_allclose(got["p50"], math.log(2), rtol=1e-6)
    np.testing.assert_allclose(got["p90"], math.log(2), rtol=1e-6)
    # Row 0: Σd = log 1.25 − log 2 = log 0.625; row 2: log 2 − log 2 − log 2 = −log 2.
    np.testing.assert_allclose(got["seq_sum_max"], math.log(2), rtol=1e-6)
    # w = (1.25, .5, 1, 1, 2, .5, .5): Σw = 6.75, Σw² = 8.3125, ESS/n = 6.75² / (7 · 8.3125).
    np.testing.assert_allclose(got["ess"], 6.75**2 / (7 * 8.3125), rtol=1e-6)


@JIT
def test_mismatch_shape_of_an_empty_batch_is_zero(jit):
    got = _call(losses.mismatch_shape, jit, LOGP, BEH, np.zeros_like(MASK))
    for k, v in got.items():
        assert float(v) == 0.0, k


def test_ess_is_one_for_equal_ratios_and_small_for_one_dominant_ratio():
    mask = np.ones((1, 4), bool)
    equal = losses.mismatch_shape(np.full((1, 4), 0.3, np.float32), np.zeros((1, 4)), mask)
    np.testing.assert_allclose(equal["ess"], 1.0, rtol=1e-6)
    lp = np.array([[10.0, 0.0, 0.0, 0.0]], np.float32)
    dominant = losses.mismatch_shape(lp, np.zeros((1, 4)), mask)
    w = np.exp([10.0, 0, 0, 0])
    np.testing.assert_allclose(dominant["ess"], w.sum() ** 2 / (4 * (w * w).sum()), rtol=1e-5)
    assert float(dominant["ess"]) < 0.26


@JIT
def test_decomposition_adds_up_and_matches_numpy(jit):
    rng = np.random.default_rng(0)
    beh = np.log(rng.uniform(0.05, 0.95, (5, 7))).astype(np.float32)
    old = (beh + rng.normal(0, 0.05, beh.shape)).astype(np.float32)
    logp = (old + rng.normal(0, 0.2, beh.shape)).astype(np.float32)
    mask = np.arange(7)[None, :] < np.array([7, 0, 3, 5, 1])[:, None]
    got = _call(losses.mismatch_decomposition, jit, logp, old, beh, mask)
    for part, (num, den) in {"staleness": (logp, old), "engine": (old, beh)}.items():
        want = _reference_shape(num, den, mask)
        d = (num - den)[mask].astype(np.float64)
        want["mean"] = np.abs(d).mean()
        for k, v in want.items():
            np.testing.assert_allclose(got[f"{part}/{k}"], v, rtol=1e-5, atol=1e-7, err_msg=k)
    # staleness + engine = log r, token by token, to float32 rounding.
    stale = jnp.asarray(logp) - jnp.asarray(old)
    engine = jnp.asarray(old) - jnp.asarray(beh)
    total = jnp.asarray(logp) - jnp.asarray(beh)
    np.testing.assert_allclose(
        np.where(mask, stale + engine, 0), np.where(mask, total, 0), rtol=0, atol=2e-6
    )
    # With the engine exact (π_θv = μ) all of log r is staleness.
    same = losses.mismatch_decomposition(logp, beh, beh, mask)
    total_shape = losses.mismatch_shape(logp, beh, mask)
    assert float(same["engine/max"]) == 0.0
    for k, v in total_shape.items():
        np.testing.assert_allclose(same[f"staleness/{k}"], v, rtol=1e-6, err_msg=k)


def test_decomposition_checks_shapes():
    with pytest.raises(ValueError, match="old_logp"):
        losses.mismatch_decomposition(LOGP, BEH[:2], BEH, MASK)
    with pytest.raises(ValueError, match="behavior_logp"):
        losses.mismatch_decomposition(LOGP, BEH, BEH[:, :2], MASK)


def test_clip_split_by_sign_and_side():
    r = np.array([[1.5, 0.5, 1.1, 0.7, 1.3, 0.6, 1.0]], np.float32)
    a = np.array([[1.0, 1.0, -1.0, -1.0, -1.0, 0.0, 1.0]], np.float32)
    got = losses.clip_split(jnp.asarray(r), jnp.asarray(a), 0.8, 1.2)
    np.testing.assert_array_equal(got["clip/pos_high"], [[1, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(got["clip/pos_low"], [[0, 1, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(got["clip/neg_low"], [[0, 0, 0, 1, 0, 0, 0]])
    np.testing.assert_array_equal(got["clip/neg_high"], [[0, 0, 0, 0, 1, 0, 0]])


def test_objective_reports_the_clip_split_over_active_tokens():
    r = np.array([[1.5, 0.5, 1.1, 0.7, 9.0]], np.float32)
    a = np.array([[1.0, 1.0, -1.0, -1.0, 1.0]], np.float32)
    mask = np.array([[1, 1, 1, 1, 0]], bool)  # the masked r = 9 must not count as pos_high
    m = losses.ppo(np.log(r), np.zeros_like(r), a, mask).metrics
    assert float(m["clip/pos_high"]) == float(m["clip_frac_upper"]) == 0.25
    assert float(m["clip/pos_low"]) == 0.25
    assert float(m["clip/neg_low"]) == float(m["clip_frac_lower"]) == 0.25
    assert float(m["clip/neg_high"]) == 0.0
    # SAT's contracted edges: the edges are per token, the split follows them.
    lp = np.log(np.array([[1.0, 1.01, 1.02, 1.03, 1.15]], np.float32))
    adv = np.ones((1, 5), np.float32)
    sat = losses.sat(lp, np.zeros_like(lp), adv, np.ones((1, 5), bool), alpha=0.8).metrics
    ppo = losses.ppo(lp, np.zeros_like(lp), adv, np.ones((1, 5), bool)).metrics
    assert float(ppo["clip/pos_high"]) == 0.0
    np.testing.assert_allclose(sat["clip/pos_high"], 0.2, rtol=1e-6)


def test_sharded_equals_unsharded():
    ndev = 8
    mesh = jax.make_mesh((ndev,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rng = np.random.default_rng(1)
    b, t = 16, 6
    beh = np.log(rng.uniform(0.05, 0.95, (b, t))).astype(np.float32)
    old = (beh + rng.normal(0, 0.05, (b, t))).astype(np.float32)
    logp = (old + rng.normal(0, 0.3, (b, t))).astype(np.float32)
    lengths = rng.integers(0, t + 1, size=b)
    lengths[:2] = 0  # device 0 holds only empty rows
    mask = np.arange(t)[None, :] < lengths[:, None]

    def both(logp, old, beh, mask, axis_name=None):
        return (
            losses.mismatch_shape(logp, beh, mask, axis_name),
            losses.mismatch_decomposition(logp, old, beh, mask, axis_name),
        )

    want = jax.jit(both)(logp, old, beh, mask)
    sharded = jax.jit(
        jax.shard_map(
            lambda *a: both(*a, axis_name="data"),
            mesh=mesh,
            in_specs=(P("data"),) * 4,
            out_specs=P(),
        )
    )
    put = lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))  # noqa: E731
    got = sharded(*(put(x) for x in (logp, old, beh, mask)))
    for g, w in zip(got, want, strict=True):
        assert set(g) == set(w)
        for k in w:
            np.testing.assert_allclose(g[k], w[k], rtol=1e-6, atol=1e-7, err_msg=k)
