"""M2PO, BAPO and the age-aware clip (token and GSPO forms): hand values, NumPy references of
the papers' loops (M2PO's one-by-one drop, BAPO's bound search), the shared input guarantees,
and exactness under ``shard_map`` and ``pmap`` on 8 CPU devices against the unsharded batch."""

import importlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sat_jax import losses
from sat_jax.rl import trainer

# The package re-exports the function `quantile` under the module's name.
quantile_lib = importlib.import_module("sat_jax.losses.quantile")
NDEV = 8
B, T = 16, 6
AGE = ("age_clip", "age_clip_gspo", "decoupled_ppo")  # the objectives that take staleness=
# name -> hyper-parameters that make the statistic bind on the test batch.
OBJECTIVES = {
    "m2po": {"tau": 0.004},
    "m2po_gspo": {"tau": 0.002, "eps_low": 0.05, "eps_high": 0.05},
    "bapo": {
        "rho_target": 0.8,
        "low_range": (0.9, 0.98),
        "high_range": (1.02, 1.2),
        "step_high": 0.01,
        "step_low": 0.01,
    },
    "bapo_gspo": {
        "rho_target": 0.8,
        "low_range": (0.95, 0.99),
        "high_range": (1.01, 1.1),
        "step_high": 0.01,
        "step_low": 0.01,
    },
    "age_clip": {"kappa": 1.0, "eps_low": 0.05, "eps_high": 0.05},
    "age_clip_gspo": {"kappa": 1.0, "eps_low": 0.01, "eps_high": 0.01, "seq_age": "max"},
    "cispo": {"cispo_eps_low": 0.05, "cispo_eps_high": 0.05},
    "sapo": {"tau_pos": 2.0},
    "decoupled_ppo": {"eps_low": 0.05, "eps_high": 0.05, "behav_weight_cap": 1.1},
}
NAMES = tuple(OBJECTIVES)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    beh = np.log(rng.uniform(0.05, 0.95, (B, T))).astype(np.float32)
    logp = (beh + rng.normal(0, 0.1, (B, T))).astype(np.float32)
    adv = rng.normal(size=(B,)).astype(np.float32)
    lengths = rng.integers(0, T + 1, size=B)
    lengths[:2] = 0
    lengths[2:4] = [1, 0]
    mask = np.arange(T)[None, :] < lengths[:, None]
    logp[~mask] = np.inf
    stale = rng.integers(0, 5, size=(B, T)).astype(np.int32)
    return logp, beh, adv, mask, stale


def _call(name, logp, beh, adv, mask, stale, axis_name=None, **kw):
    hp = {**OBJECTIVES[name], **kw}
    if name in AGE:
        hp["staleness"] = stale
    return losses.get(name)(logp, beh, adv, mask, axis_name=axis_name, **hp)


def _value_and_grad(name, axis_name=None):
    def f(logp, beh, adv, mask, stale):
        def loss(x):
            out = _call(name, x, beh, adv, mask, stale, axis_name)
            return out.loss, out.metrics

        (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logp)
        return value, metrics, grad

    return f


# ----------------------------------------------------------------------------------------------
# Exact under sharding.
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((NDEV,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


@pytest.mark.parametrize("way", ["shard_map", "pmap"])
@pytest.mark.parametrize("name", NAMES)
def test_sharded_equals_unsharded_loss_metrics_and_gradient(name, way, mesh):
    batch = _batch()
    want_value, want_metrics, want_grad = _value_and_grad(name)(*batch)
    chex.assert_tree_all_finite((want_value, dict(want_metrics), want_grad))
    if way == "shard_map":
        f = jax.jit(
            jax.shard_map(
                _value_and_grad(name, "data"),
                mesh=mesh,
                in_specs=(P("data"),) * 5,
                out_specs=(P(), P(), P("data")),
            )
        )
        sharding = jax.sharding.NamedSharding(mesh, P("data"))
        value, metrics, grad = f(*(jax.device_put(a, sharding) for a in batch))
    else:
        split = [a.reshape(NDEV, -1, *a.shape[1:]) for a in batch]
        value, metrics, grad = jax.pmap(_value_and_grad(name, "data"), axis_name="data")(*split)
        value, metrics = value[0], jax.tree.map(lambda x: x[0], metrics)
        grad = grad.reshape(B, T) / NDEV  # pmap transposes psum to psum (objectives.py)
    chex.assert_trees_all_close(value, want_value, rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_close(dict(metrics), dict(want_metrics), rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_close(grad, want_grad, rtol=1e-5, atol=1e-7)
    # The statistic the objective adapts is global: the same selection / bounds everywhere.
    for key in ("m2po/masked_frac", "bapo/c_low", "bapo/c_high", "bapo/steps"):
        if key in want_metrics:
            chex.assert_trees_all_equal(metrics[key], want_metrics[key])


def test_the_test_batch_makes_each_statistic_bind():
    batch = _batch()
    m = {n: _call(n, *batch).metrics for n in NAMES}
    assert 0 < float(m["m2po"]["m2po/masked_frac"]) < 0.5
    assert 0 < float(m["m2po_gspo"]["m2po/masked_frac"]) < 0.5
    assert float(m["bapo"]["bapo/steps"]) > 0 and float(m["bapo_gspo"]["bapo/steps"]) > 0
    assert float(m["age_clip"]["age/eps_high_mean"]) < 0.05
    assert float(m["cispo"]["cispo/clipped_frac"]) > 0
    assert 0 < float(m["decoupled_ppo"]["clip_frac"]) < 0.5


# ----------------------------------------------------------------------------------------------
# M2PO against the paper's one-by-one drop.
# ----------------------------------------------------------------------------------------------


def _greedy_keep(m2, mask, candidates, tau):
    """Alg. 1 of M2PO, literally: drop the largest candidate M2 while the kept mean exceeds τ."""
    keep = mask.copy()
    order = [
        i for i in np.argsort(-m2.ravel(), kind="stable") if candidates.flat[i] and mask.flat[i]
    ]
    for i in order:
        if m2[keep].sum() <= tau * keep.sum():
            break
        keep.flat[i] = False
    return keep


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("variant", ["paper", "trust_region"])
def test_m2po_selection_equals_the_one_by_one_drop(seed, variant):
    rng = np.random.default_rng(seed)
    lr = rng.normal(0, 0.3, (5, 7)).astype(np.float32)
    adv = rng.normal(size=(5, 7)).astype(np.float32)
    mask = rng.random((5, 7)) < 0.8
    m2 = np.square(lr)
    cand = mask if variant == "paper" else mask & (adv * lr > 0)
    for tau in (0.01, 0.04, 0.2, 10.0):
        want = _greedy_keep(m2, mask, cand, tau)
        got = quantile_lib.mean_bounded_keep(jnp.asarray(m2), mask, cand, tau)
        np.testing.assert_array_equal(got, want)
        out = losses.m2po(lr, np.zeros_like(lr), adv, mask, tau=tau, variant=variant)
        r = np.exp(lr)
        np.testing.assert_allclose(out.loss, -(want * r * adv).sum() / mask.sum(), rtol=1e-5)
        kept = m2[want]
        np.testing.assert_allclose(
            out.metrics["m2po/m2_after"], kept.mean() if kept.size else 0, rtol=1e-5, atol=1e-8
        )
        if variant == "paper":
            assert float(out.metrics["m2po/m2_after"]) <= tau * (1 + 1e-6)


def test_m2po_ties_are_kept_or_dropped_together():
    m2 = jnp.array([0.0, 0.0, 1.0, 1.0])
    mask = jnp.ones(4, bool)
    # Dropping one of the two 1.0s gives mean 1/3 ≤ 0.4; the threshold drops both (mean 0).
    np.testing.assert_array_equal(
        quantile_lib.mean_bounded_keep(m2, mask, mask, 0.4), [True, True, False, False]
    )
    np.testing.assert_array_equal(quantile_lib.mean_bounded_keep(m2, mask, mask, 0.5), True)


def _selection_batch(seed, n=300):
    rng = np.random.default_rng(seed)
    lr = rng.normal(0, float(rng.choice([0.01, 0.1, 0.3, 3.0])), n).astype(np.float32)
    if seed % 3 == 0:
        lr = np.round(lr * 4) / 4  # many ties, and sums exact in any order
    mask = (rng.random(n) < 0.8) & (np.arange(n) < rng.integers(1, n + 1))
    cand = mask & (rng.random(n) < 0.6) if seed % 2 else mask
    return np.square(lr), mask, cand


def _keep(method, tau, axis_name=None):
    return lambda x, m, c: quantile_lib.mean_bounded_keep(x, m, c, tau, axis_name, method=method)


@pytest.mark.parametrize("seed", range(12))
def test_m2po_radix_selection_equals_the_bisection_and_the_one_by_one_drop(seed):
    x, mask, cand = _selection_batch(seed)
    for tau in (1e-4, 0.01, 0.04, 0.5, 100.0):
        got = jax.jit(_keep("radix", tau))(x, mask, cand)
        np.testing.assert_array_equal(got, jax.jit(_keep("bisect", tau))(x, mask, cand))
        if seed % 3:  # no ties: the threshold is the one-by-one drop
            np.testing.assert_array_equal(got, _greedy_keep(x, mask, cand, tau))


def test_m2po_radix_falls_back_to_the_bisection_when_its_bucket_sums_mislead(monkeypatch):
    """The direct test checks the radix guess: a guess one bucket off still gives the exact mask."""
    last_within = quantile_lib._last_within

    def off_by_one(*args):
        last, s, c = last_within(*args)
        return jnp.maximum(last - 1, -1), s, c

    monkeypatch.setattr(quantile_lib, "_last_within", off_by_one)
    x, mask, cand = _selection_batch(4)  # no ties
    for tau in x[mask].mean() * np.array([0.2, 0.5, 0.9]):
        tau = float(tau)
        want = _greedy_keep(x, mask, cand, tau)
        assert not want[mask].all() and want[mask].any()  # the threshold lies inside the batch
        np.testing.assert_array_equal(jax.jit(_keep("radix", tau))(x, mask, cand), want)


@pytest.mark.parametrize("method", ["bisect", "radix"])
def test_m2po_selection_under_shard_map_equals_the_unsharded_one(method, mesh):
    sharding = jax.sharding.NamedSharding(mesh, P("data"))
    for seed in range(3):
        x, mask, cand = _selection_batch(seed, n=NDEV * 40)
        for tau in (0.01, 0.04):
            want = jax.jit(_keep(method, tau))(x, mask, cand)
            f = jax.jit(
                jax.shard_map(
                    _keep(method, tau, "data"),
                    mesh=mesh,
                    in_specs=(P("data"),) * 3,
                    out_specs=P("data"),
                )
            )
            got = f(*(jax.device_put(a, sharding) for a in (x, mask, cand)))
            np.testing.assert_array_equal(got, want)


def test_m2po_rejects_an_unknown_selection_method():
    batch = _batch()
    with pytest.raises(ValueError, match="`selection_method` must be one of .*'sort'"):
        _call("m2po", *batch, selection_method="sort")
    with pytest.raises(ValueError, match="`method` must be one of .*'sort'"):
        quantile_lib.mean_bounded_keep(
            jnp.ones(3), jnp.ones(3, bool), jnp.ones(3, bool), 0.1, method="sort"
        )


def test_m2po_hand_values():
    lp = np.log(np.array([[1.0, 1.1, 3.0, 0.5]], np.float32))
    adv = np.array([[1.0, 1.0, -1.0, -1.0]], np.float32)
    mask = np.ones((1, 4), bool)
    # (log r)² = 0, 0.0091, 1.2069, 0.4805: drop 3.0 then 0.5 (mean 0.0045 ≤ 0.04).
    out = losses.m2po(lp, np.zeros_like(lp), adv, mask)
    np.testing.assert_allclose(out.loss, -(1.0 + 1.1) / 4, rtol=1e-6)
    assert float(out.metrics["m2po/masked_frac"]) == 0.5
    np.testing.assert_allclose(
        out.metrics["m2po/m2_before"], np.mean(np.log([1, 1.1, 3, 0.5]) ** 2), rtol=1e-5
    )
    # The authors' variant drops only outward moves (A>0, r>1 or A<0, r<1): r = 3 with A < 0
    # is a pull-back and stays, so the mean cannot reach τ and every candidate is dropped.
    out = losses.m2po(lp, np.zeros_like(lp), adv, mask, variant="trust_region")
    assert float(out.metrics["m2po/masked_frac"]) == 0.5  # 1.1 (A>0) and 0.5 (A<0)
    np.testing.assert_allclose(out.loss, -(1.0 - 3.0) / 4, rtol=1e-6)
    # Gradient: r·A on kept tokens, 0 on dropped ones.
    g = jax.grad(lambda x: losses.m2po(x, np.zeros_like(lp), adv, mask).loss)(lp)
    np.testing.assert_allclose(g, [[-0.25, -1.1 / 4, 0.0, 0.0]], rtol=1e-6)


def test_m2po_gspo_drops_whole_responses_weighted_by_length():
    # Response 0: 3 tokens at ρ = 1; response 1: 1 token at ρ = e^0.3 (M2 0.09).
    lp = np.array([[0.0, 0.0, 0.0], [0.3, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 0, 0]], bool)
    adv = np.array([1.0, 1.0], np.float32)
    # Token mean of M2 = 0.09/4 = 0.0225 ≤ 0.04: nothing dropped; τ = 0.02 drops response 1.
    out = losses.m2po_gspo(lp, np.zeros_like(lp), adv, mask, eps_low=None, eps_high=None)
    assert float(out.metrics["m2po/masked_frac"]) == 0.0
    out = losses.m2po_gspo(lp, np.zeros_like(lp), adv, mask, tau=0.02, eps_low=None, eps_high=None)
    assert float(out.metrics["m2po/masked_frac"]) == 0.25
    np.testing.assert_allclose(out.loss, -3.0 / 4, rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# BAPO.
# ----------------------------------------------------------------------------------------------


def _bapo_reference(r, adv, mask, rho0, low, high, d1, d2):
    """BAPO's Alg. 1 in NumPy (this project's reading of ρ, docs/losses.md)."""

    def rho(cl, ch):
        c = np.abs(r * adv)
        p = c[mask & (adv > 0) & (r <= ch)].sum()
        n = c[mask & (adv < 0) & (r >= cl)].sum()
        return p / (p + n) if p + n > 0 else 1.0

    kh = kl = 0
    nh = int((high[1] - high[0]) / d1 + 1e-6)
    nl = int((low[1] - low[0]) / d2 + 1e-6)
    trace = [rho(low[0], high[0])]
    while trace[-1] < rho0 and (kh < nh or kl < nl):
        if kh < nh:
            kh += 1
        else:
            kl += 1
        trace.append(rho(low[0] + kl * d2, high[0] + kh * d1))
    return low[0] + kl * d2, high[0] + kh * d1, trace


@pytest.mark.parametrize("seed", range(3))
def test_bapo_search_moves_rho_towards_the_target(seed):
    rng = np.random.default_rng(seed)
    lr = rng.normal(0, 0.4, (6, 8)).astype(np.float32)
    adv = np.where(rng.random((6, 8)) < 0.3, 1.0, -1.0).astype(np.float32)  # negatives dominate
    mask = rng.random((6, 8)) < 0.9
    r = np.exp(lr)
    hp = dict(rho_target=0.45, low_range=(0.6, 0.9), high_range=(1.2, 3.0))
    cl, ch, trace = _bapo_reference(r, adv, mask, 0.45, (0.6, 0.9), (1.2, 3.0), 0.05, 0.02)
    assert trace[0] < 0.45 and len(trace) > 1  # the search had to move
    assert all(np.diff(trace) >= 0)  # each step raises ρ
    out = losses.bapo(lr, np.zeros_like(lr), adv, mask, **hp)
    m = out.metrics
    np.testing.assert_allclose([m["bapo/c_low"], m["bapo/c_high"]], [cl, ch], rtol=1e-6)
    np.testing.assert_allclose(m["bapo/rho"], trace[-1], rtol=1e-5)
    assert float(m["bapo/rho"]) > trace[0]
    assert float(m["bapo/steps"]) == len(trace) - 1
    s = np.minimum(r * adv, np.clip(r, cl, ch) * adv)
    np.testing.assert_allclose(out.loss, -(s * mask).sum() / mask.sum(), rtol=1e-5)


def test_bapo_keeps_the_start_bounds_when_balanced():
    lp = np.log(np.array([[1.1, 1.0]], np.float32))
    out = losses.bapo(
        lp, np.zeros_like(lp), np.array([[1.0, -1.0]], np.float32), np.ones((1, 2), bool)
    )
    m = out.metrics
    np.testing.assert_allclose([m["bapo/c_low"], m["bapo/c_high"]], [0.6, 1.2], rtol=1e-6)
    assert float(m["bapo/steps"]) == 0.0
    # All-negative batch: ρ = 0 whatever the bounds, so both reach their maxima.
    out = losses.bapo(lp, np.zeros_like(lp), np.array([-1.0], np.float32), np.ones((1, 2), bool))
    np.testing.assert_allclose(
        [out.metrics["bapo/c_low"], out.metrics["bapo/c_high"]], [0.9, 3.0], rtol=1e-6
    )


# ----------------------------------------------------------------------------------------------
# The age-aware clip.
# ----------------------------------------------------------------------------------------------


def test_age_clip_without_age_effect_is_ppo_bit_for_bit():
    logp, beh, adv, mask, stale = _batch()
    want = jax.value_and_grad(lambda x: losses.ppo(x, beh, adv, mask, eps_low=0.1).loss)(logp)
    for kw in ({"kappa": 0.0, "staleness": stale}, {"staleness": np.ones((B, T), np.int32)}):
        got = jax.value_and_grad(
            lambda x, kw=kw: losses.age_clip(x, beh, adv, mask, eps_low=0.1, **kw).loss
        )(logp)
        chex.assert_trees_all_equal(got, want)


def test_age_clip_hand_values():
    lp = np.log(np.array([[1.5, 1.5, 1.5, 0.5]], np.float32))
    adv = np.array([[1.0, 1.0, 1.0, -1.0]], np.float32)
    stale = np.array([[0, 1, 3, 5]], np.int32)
    out = losses.age_clip(
        lp, np.zeros_like(lp), adv, np.ones((1, 4), bool), staleness=stale, kappa=1.0
    )
    # ε_t = 0.2/(1 + max(d − 1, 0)) = 0.2, 0.2, 0.0667, 0.04.
    want = [1.2, 1.2, 1 + 0.2 / 3, -(1 - 0.04)]
    np.testing.assert_allclose(out.loss, -np.mean(want), rtol=1e-6)
    np.testing.assert_allclose(out.metrics["age/staleness_mean"], 9 / 4)
    np.testing.assert_allclose(
        out.metrics["age/eps_high_mean"], np.mean([0.2, 0.2, 0.2 / 3, 0.04]), rtol=1e-6
    )


def test_age_clip_gspo_sequence_age_mean_or_max():
    lp = np.log(np.full((1, 2), 1.5, np.float32))
    args = (lp, np.zeros_like(lp), np.array([1.0], np.float32), np.ones((1, 2), bool))
    stale = np.array([[1, 5]], np.int32)
    mean = losses.age_clip_gspo(*args, staleness=stale, kappa=1.0)
    mx = losses.age_clip_gspo(*args, staleness=stale, kappa=1.0, seq_age="max")
    np.testing.assert_allclose(mean.loss, -(1 + 0.2 / 3), rtol=1e-6)  # mean age 3
    np.testing.assert_allclose(mx.loss, -(1 + 0.2 / 5), rtol=1e-6)  # max age 5


def test_age_clip_staleness_checks():
    logp, beh, adv, mask, stale = _batch()
    with pytest.raises(ValueError, match="`staleness` is required"):
        losses.age_clip(logp, beh, adv, mask)
    with pytest.raises(TypeError, match="`staleness` must be an integer array"):
        losses.age_clip(logp, beh, adv, mask, staleness=stale.astype(np.float32))
    with pytest.raises(ValueError, match="`staleness` must have shape"):
        losses.age_clip_gspo(logp, beh, adv, mask, staleness=stale[:, :2])
    neg = stale.copy()
    neg[mask] = -1
    with pytest.raises(ValueError, match="`staleness` must be >= 0 on active tokens"):
        losses.age_clip(logp, beh, adv, mask, staleness=neg)
    with pytest.raises(ValueError, match="`seq_age` must be one of"):
        losses.age_clip_gspo(logp, beh, adv, mask, staleness=stale, seq_age="min")
    with pytest.raises(ValueError, match="`kappa` must be >= 0"):
        losses.age_clip(logp, beh, adv, mask, staleness=stale, kappa=-1.0)


def test_the_trainer_fills_staleness_from_the_versions():
    logp, beh, adv, mask, _ = _batch()
    versions = np.random.default_rng(3).integers(4, 10, (B, T)).astype(np.int32)
    batch = trainer.RolloutBatch(
        tokens=None,
        input_mask=None,
        response_mask=mask,
        behavior_logp=beh,
        cutoffs=None,
        routing=None,
        versions=versions,
        advantages=adv,
        rewards=None,
    )
    spec = trainer.LossSpec(objective="age_clip", r3=False, objective_kwargs=(("kappa", 1.0),))
    fields = trainer._loss_fields(batch, spec, jnp.int32(10))
    np.testing.assert_array_equal(fields["staleness"], 10 - versions)
    loss, metrics = trainer._objective(logp, np.zeros_like(logp), None, None, fields, spec, None)
    want = losses.age_clip(logp, beh, adv, mask, staleness=10 - versions, kappa=1.0)
    np.testing.assert_array_equal(loss, want.loss)
    with pytest.raises(ValueError, match="takes `staleness`"):
        trainer._loss_fields(batch, spec)
    assert "staleness" not in trainer._loss_fields(batch, trainer.LossSpec(objective="ppo"))


# ----------------------------------------------------------------------------------------------
# The shared input guarantees.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_padding_bf16_aggregations_and_empty_masks(name):
    logp, beh, adv, mask, stale = _batch()
    adv_t = np.broadcast_to(adv[:, None], (B, T)).copy()
    f = jax.jit(jax.value_and_grad(lambda x, b, a: _call(name, x, b, a, mask, stale).loss))
    clean = f(np.where(mask, logp, 0.0), beh, adv_t)
    for poison in (np.nan, np.inf, -np.inf):
        lp, bh, ad = logp.copy(), beh.copy(), adv_t.copy()
        lp[~mask], bh[~mask], ad[~mask] = poison, -poison, poison
        chex.assert_trees_all_equal(f(lp, bh, ad), clean)
    out16 = _call(
        name,
        *(jnp.asarray(x, jnp.bfloat16) for x in (np.where(mask, logp, 0), beh, adv)),
        mask,
        stale,
    )
    out32 = _call(
        name,
        *(
            np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
            for x in (np.where(mask, logp, 0), beh, adv)
        ),
        mask,
        stale,
    )
    assert out16.loss.dtype == jnp.float32
    np.testing.assert_array_equal(out16.loss, out32.loss)
    for mode in losses.AGGREGATIONS:
        out = _call(name, np.where(mask, logp, 0), beh, adv, mask, stale, aggregation=mode)
        assert np.isfinite(out.loss), mode
    empty = np.zeros_like(mask)
    value, grad = jax.value_and_grad(lambda x: _call(name, x, beh, adv, empty, stale).loss)(logp)
    assert float(value) == 0.0 and np.all(grad == 0)
    assert all(np.isfinite(v) for v in _call(name, logp, beh, adv, empty, stale).metrics.values())
    extreme = beh + np.array([1e4, -1e4, 30.0, -30.0, 0.0, 0.1], np.float32)
    value, grad = jax.value_and_grad(
        lambda x: _call(name, x, beh, adv, np.ones_like(mask), stale).loss
    )(extreme)
    assert np.isfinite(value) and np.all(np.isfinite(grad))


@pytest.mark.parametrize(
    "name,kwargs,match",
    [
        ("m2po", {"tau": 0.0}, "`tau` must be > 0"),
        ("m2po", {"tau": True}, "`tau` must be a real number"),
        ("m2po", {"variant": "verl"}, "`variant` must be one of"),
        ("m2po_gspo", {"eps_low": None}, "`eps_low` and `eps_high` must both be None"),
        ("bapo", {"rho_target": 1.5}, "`rho_target` must be <= 1"),
        ("bapo", {"low_range": (0.6, 1.1)}, "`low_range` must stay below 1"),
        ("bapo", {"high_range": (1.2, 1.0)}, r"`high_range\[1\]` must be >= 1.2"),
        ("bapo", {"high_range": 1.2}, "`high_range` must be a pair"),
        ("bapo_gspo", {"step_low": 0.0}, "`step_low` must be > 0"),
        ("age_clip", {"eps_low": 1.0}, "`eps_low` must be < 1"),
    ],
)
def test_hyperparameter_errors(name, kwargs, match):
    logp, beh, adv, mask, stale = _batch()
    with pytest.raises((ValueError, TypeError), match=match):
        _call(name, logp, beh, adv, mask, stale, **kwargs)
    with pytest.raises((ValueError, TypeError), match=match):  # what config validation runs
        losses.registry.check(name, {**OBJECTIVES[name], **kwargs})


# ----------------------------------------------------------------------------------------------
# CISPO, SAPO, decoupled PPO / A-3PO and the sequence-level corrections.
# ----------------------------------------------------------------------------------------------


def test_cispo_gradient_is_the_clipped_weight_times_the_advantage():
    """SkyRL (``compute_policy_loss_cispo``, r = exp(clip(log r, ±20))) and verl write CISPO as
    −A·sg(clamp(r, 1 − ε_low, 1 + ε_high))·log π: its gradient with respect to log π is
    −A·clamp(r), which ours must equal (the values differ by design). The edge-batch check
    against SkyRL's restated loss is in test_peer_stabilizers.py."""
    r = np.array([[0.5, 0.9, 1.0, 1.3, 7.0]], np.float32)
    adv = np.array([[1.0, -1.0, 2.0, 1.0, -0.5]], np.float32)
    mask = np.ones_like(r, bool)
    for lo, hi in ((1.0, 4.0), (0.2, 0.2)):
        f = lambda x, lo=lo, hi=hi: losses.cispo(  # noqa: E731
            x, np.zeros_like(r), adv, mask, cispo_eps_low=lo, cispo_eps_high=hi
        )
        w = np.clip(r, 1 - lo, 1 + hi)
        np.testing.assert_allclose(f(np.log(r)).loss, -(w * adv).mean(), rtol=1e-6)
        grad = jax.grad(lambda x, f=f: f(x).loss)(np.log(r))
        np.testing.assert_allclose(grad, -(w * adv) / r.size, rtol=1e-6)


def test_sapo_value_and_gradient():
    r = np.array([[0.7, 1.0, 1.4]], np.float32)
    adv = np.array([[1.0, -2.0, 1.0]], np.float32)
    tau = np.where(adv > 0, 1.0, 1.05)
    out = losses.sapo(np.log(r), np.zeros_like(r), adv, np.ones_like(r, bool))
    sig = 1 / (1 + np.exp(-tau * (r - 1)))
    np.testing.assert_allclose(out.loss, -np.mean(4 / tau * sig * adv), rtol=1e-6)
    grad = jax.grad(lambda x: losses.sapo(x, np.zeros_like(r), adv, np.ones_like(r, bool)).loss)(
        np.log(r)
    )
    # d/dlog r of (4/τ)σ(τ(r−1))A = 4σ(1−σ)·A·r; the gate is 1 at r = 1 (the policy gradient).
    np.testing.assert_allclose(grad, -(4 * sig * (1 - sig) * adv * r) / 3, rtol=1e-5)
    np.testing.assert_allclose(grad[0, 1], 2.0 / 3, rtol=1e-6)


def test_decoupled_ppo_hand_and_a3po():
    logp, beh, adv, mask, stale = _batch()
    logp = np.where(mask, logp, 0.0)
    ppo = jax.value_and_grad(lambda x: losses.ppo(x, beh, adv, mask).loss)(logp)
    # A-3PO with every token at most one version behind: π_prox = μ, PPO bit for bit.
    got = jax.value_and_grad(
        lambda x: losses.decoupled_ppo(x, beh, adv, mask, staleness=np.ones_like(stale)).loss
    )(logp)
    chex.assert_trees_all_equal(got, ppo)
    # d = 2: α = 1/2, log π_prox = log μ + (log π − log μ)/2, u = w = √r.
    r = np.array([[1.44, 0.64]], np.float32)
    a = np.array([[1.0, -1.0]], np.float32)
    out = losses.decoupled_ppo(
        np.log(r), np.zeros_like(r), a, np.ones_like(r, bool), staleness=np.full((1, 2), 2)
    )
    u = np.sqrt(r)
    want = u * np.minimum(u * a, np.clip(u, 0.8, 1.2) * a)
    np.testing.assert_allclose(out.loss, -want.mean(), rtol=1e-6)
    # Given prox_logp (which wins over staleness), with a cap on w.
    prox = np.log(np.array([[1.5, 0.5]], np.float32))
    out = losses.decoupled_ppo(
        np.log(r),
        np.zeros_like(r),
        a,
        np.ones_like(r, bool),
        prox_logp=prox,
        staleness=np.full((1, 2), 2),
        behav_weight_cap=1.2,
    )
    w, u = np.minimum(np.exp(prox), 1.2), r / np.exp(prox)
    want = w * np.minimum(u * a, np.clip(u, 0.8, 1.2) * a)
    np.testing.assert_allclose(out.loss, -want.mean(), rtol=1e-6)
    with pytest.raises(ValueError, match="`prox_logp` or `staleness` is required"):
        losses.decoupled_ppo(logp, beh, adv, mask)
    with pytest.raises(ValueError, match="`prox_logp` must have shape"):
        losses.decoupled_ppo(logp, beh, adv, mask, prox_logp=beh[:, :2])


def test_sequence_corrections_hand():
    old = np.log(np.array([[1.5, 1.2, 9.0], [3.0, 1.0, 1.0], [1.0, 1.0, 1.0]], np.float32))
    beh = np.zeros_like(old)
    mask = np.array([[1, 1, 0], [1, 1, 1], [0, 0, 0]], bool)  # the 9 is padding
    w = losses.seq_mis(old, beh, mask)
    np.testing.assert_allclose(w, [[1.8, 1.8, 0], [0, 0, 0], [0, 0, 0]], rtol=1e-6)
    w = losses.seq_mis(old, beh, mask, cap=1.5, high=4.0)
    np.testing.assert_allclose(w, [[1.5, 1.5, 0], [1.5, 1.5, 1.5], [0, 0, 0]], rtol=1e-6)
    geo = losses.geo_rs(old, beh, mask, low=0.5, high=1.4)  # geometric means 1.342, 1.442
    np.testing.assert_array_equal(geo, [[1, 1, 0], [0, 0, 0], [0, 0, 0]])
    lp = np.log(np.array([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5], [0.9, 0.9, 0.9]], np.float32))
    mask = np.ones_like(lp, bool)
    w = losses.opsm(lp, np.zeros_like(lp), mask, np.array([-1.0, 1.0, -1.0]), delta=0.5)
    # mean log(μ/π) = log 2 ≈ 0.69 > 0.5 drops the negative row 0 only; row 2 has 0.105.
    np.testing.assert_array_equal(w, [[0, 0, 0], [1, 1, 1], [1, 1, 1]])
    with pytest.raises(TypeError, match="delta"):
        losses.opsm(lp, np.zeros_like(lp), mask, np.ones(3))
    with pytest.raises(ValueError, match="`advantages` must have shape"):
        losses.opsm(lp, np.zeros_like(lp), mask, np.ones(2), delta=0.1)
    # Through the registry, as the trainer applies a correction.
    np.testing.assert_array_equal(
        losses.registry.correction_weights(
            "geo_rs", logp=lp, old_logp=old, behavior_logp=beh, mask=mask, low=0.5, high=1.4
        ),
        losses.geo_rs(old, beh, mask, low=0.5, high=1.4),
    )


def test_registry_knows_the_stabilizers():
    assert set(NAMES) <= set(losses.names())
    assert losses.registry.takes_staleness("age_clip")
    assert not losses.registry.takes_staleness("m2po")
    assert "staleness" not in losses.registry.hyperparameters("age_clip")
    assert "prox_logp" not in losses.registry.hyperparameters("decoupled_ppo")
    assert {"seq_mis", "geo_rs"} <= set(losses.names("correction"))
    for name in NAMES:
        losses.registry.check(name, OBJECTIVES[name])


def test_docstring_examples_run():
    import doctest

    for name in ("objectives", "stabilizers", "quantile", "corrections", "diagnostics"):
        module = importlib.import_module(f"sat_jax.losses.{name}")
        result = doctest.testmod(module, extraglobs={"jnp": jnp, "np": np}, verbose=False)
        assert result.failed == 0, module.__name__
