"""Every objective against the independent NumPy reference, values and gradients, random inputs."""

import _loss_reference as ref
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sat_jax import losses

B, T = 4, 7

# (objective, hyper-parameters): defaults and non-default settings that exercise each branch.
CASES = [
    ("ppo", {}),
    ("ppo", {"eps_low": 0.1, "eps_high": 0.28, "dual_clip": 1.5}),
    ("sat", {}),
    ("sat", {"alpha": 0.7, "hill_exponent": 3.0, "eps_low": 0.05, "eps_high": 0.08}),
    ("gspo", {}),
    ("gspo", {"eps_low": 0.05, "eps_high": 0.05}),
    ("gspo_token", {"eps_low": 0.05, "eps_high": 0.05}),
    ("sat_gspo", {}),
    ("sat_gspo", {"alpha": 0.6, "eps_low": 0.03, "eps_high": 0.04}),
    ("seqclip", {"low": 0.95, "high": 1.05, "eps_low": 0.2, "eps_high": 0.2}),
    ("dppo", {}),
    ("dppo", {"delta": 0.02}),
    ("dppo", {"divergence": "kl", "delta": 0.002}),
    ("dppo", {"variant": "verl", "delta": 0.02, "ratio_cap": 1.1}),
    ("spo", {}),
    ("drpo", {"delta": 0.05}),
]


def _inputs(seed, per_token_adv):
    rng = np.random.default_rng(seed)
    beh = np.log(rng.uniform(0.05, 0.95, (B, T))).astype(np.float32)
    logp = (beh + rng.normal(0.0, 0.15, (B, T))).astype(np.float32)
    adv = rng.normal(size=(B, T) if per_token_adv else (B,)).astype(np.float32)
    lengths = np.array([T, 5, 3, 1])
    mask = np.arange(T)[None, :] < lengths[:, None]
    logp[~mask] = np.nan  # padding must never matter
    return logp, beh, adv, mask


@pytest.mark.parametrize("name,hp", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_matches_numpy_reference(name, hp, aggregation):
    fn = losses.get(name)

    def loss_fn(lp, beh, adv, mask):
        return fn(lp, beh, adv, mask, aggregation=aggregation, **hp).loss

    value_and_grad = jax.jit(jax.value_and_grad(loss_fn))
    for seed, per_token in ((0, False), (1, True)):
        logp, beh, adv, mask = _inputs(seed, per_token)
        clean = np.where(mask, logp, 0.0)
        got, got_g = value_and_grad(logp, beh, adv, mask)
        want = ref.loss(name, clean, beh, adv, mask, aggregation=aggregation, **hp)
        chex.assert_trees_all_close(got, want, rtol=2e-5, atol=1e-6)
        want_g = ref.grad(name, clean, beh, adv, mask, aggregation=aggregation, **hp)
        chex.assert_trees_all_close(got_g, want_g, rtol=2e-4, atol=2e-6)
        chex.assert_tree_all_finite(got_g)


@pytest.mark.parametrize(
    "aggregation",
    [
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
        "seq-mean-token-sum-norm-active",
        "seq-sum-token-sum-norm",
    ],
)
def test_other_aggregations_match_reference(aggregation):
    logp, beh, adv, mask = _inputs(2, False)
    clean = np.where(mask, logp, 0.0)
    for name in ("ppo", "sat"):
        got = losses.get(name)(logp, beh, adv, mask, aggregation=aggregation).loss
        want = ref.loss(name, clean, beh, adv, mask, aggregation=aggregation)
        chex.assert_trees_all_close(got, want, rtol=2e-5, atol=1e-6)


def test_token_weights_match_reference():
    logp, beh, adv, mask = _inputs(3, False)
    old = beh + np.random.default_rng(3).normal(0, 0.5, beh.shape).astype(np.float32)
    w = losses.tis(old, beh, mask)
    chex.assert_trees_all_close(
        w, np.where(mask, np.minimum(np.exp(old - beh), 2.0), 0.0), rtol=1e-5
    )
    got = losses.sat(logp, beh, adv, mask, token_weights=w).loss
    want = ref.loss("sat", np.where(mask, logp, 0.0), beh, adv, mask, weights=np.asarray(w))
    chex.assert_trees_all_close(got, want, rtol=2e-5)


def test_mismatch_metrics_match_reference():
    logp, beh, adv, mask = _inputs(4, False)
    got = losses.mismatch_metrics(logp, beh, mask)
    want = ref.mismatch(np.where(mask, logp, 0.0), beh, mask)
    chex.assert_trees_all_close(
        dict(got), {k: np.float32(v) for k, v in want.items()}, rtol=1e-4, atol=1e-7
    )


@pytest.mark.parametrize("alpha", [0.9, 0.5, 0.75, 0.95, 1.0, 0.1, 0.333])
def test_quantile_matches_reference(alpha):
    rng = np.random.default_rng(int(alpha * 1000))
    for n in (1, 2, 9, 10, 11, 100, 997):
        x = rng.normal(size=(n,)).astype(np.float32) * rng.choice([1e-6, 1.0, 1e4])
        x[rng.random(n) < 0.1] = rng.choice(x)  # ties
        mask = rng.random(n) < 0.8
        want = ref.lower_quantile(x[mask], alpha)
        for method in ("radix", "bisect"):
            got = losses.quantile(x, mask, alpha, method=method)
            assert float(got) == np.float32(want), (n, alpha, method)


def test_quantile_float_edge_cases():
    x = jnp.array([-0.0, 0.0, -jnp.inf, jnp.inf, 1e-45, -1e-45, 3.4e38, -3.4e38])
    m = jnp.ones(8, bool)
    want = np.sort(np.asarray(x))
    for method in ("radix", "bisect"):
        for k in range(1, 9):
            assert float(losses.quantile(x, m, k / 8, method=method)) == want[k - 1]


def test_weighted_quantile_equals_repeated_values():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(50,)).astype(np.float32)
    w = rng.integers(0, 6, size=50)
    mask = rng.random(50) < 0.9
    for alpha in (0.1, 0.5, 0.9, 1.0):
        want = ref.lower_quantile(np.repeat(x[mask], w[mask]), alpha)
        for method in ("radix", "bisect"):
            got = losses.quantile(x, mask, alpha, weights=w, method=method)
            assert float(got) == np.float32(want), (alpha, method)
    with pytest.raises(ValueError, match="`weights` must be an integer array"):
        losses.quantile(x, mask, 0.9, weights=w.astype(np.float32))
