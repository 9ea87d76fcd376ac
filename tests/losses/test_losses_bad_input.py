"""Bad input fails at the boundary naming the argument; degenerate data never produces NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sat_jax import losses

NAMES = ["ppo", "sat", "gspo", "gspo_token", "sat_gspo", "seqclip", "dppo", "spo", "drpo"]
B, T = 3, 5


def _ok():
    rng = np.random.default_rng(0)
    beh = np.log(rng.uniform(0.1, 0.9, (B, T))).astype(np.float32)
    logp = (beh + rng.normal(0, 0.05, (B, T))).astype(np.float32)
    return logp, beh, rng.normal(size=(B,)).astype(np.float32), np.ones((B, T), bool)


@pytest.mark.parametrize("name", NAMES)
def test_shape_and_dtype_errors_name_the_argument(name):
    fn = losses.get(name)
    logp, beh, adv, mask = _ok()
    with pytest.raises(ValueError, match="`logp` must have rank 2"):
        fn(logp[0], beh, adv, mask)
    with pytest.raises(ValueError, match="`behavior_logp` must have shape"):
        fn(logp, beh[:, :-1], adv, mask)
    with pytest.raises(TypeError, match="`logp` must have a floating dtype"):
        fn(logp.astype(np.int32), beh, adv, mask)
    with pytest.raises(TypeError, match="`behavior_logp` must have a floating dtype"):
        fn(logp, beh.astype(np.int64), adv, mask)
    with pytest.raises(ValueError, match="`mask` must have shape"):
        fn(logp, beh, adv, mask[:, :2])
    with pytest.raises(ValueError, match="`advantages` must have shape"):
        fn(logp, beh, adv[:2], mask)
    with pytest.raises(ValueError, match="`token_weights` must have shape"):
        fn(logp, beh, adv, mask, token_weights=np.ones((B,), np.float32))
    with pytest.raises(ValueError, match="`aggregation` must be one of"):
        fn(logp, beh, adv, mask, aggregation="mean")
    with pytest.raises(ValueError, match="`logp` is required"):
        fn(None, beh, adv, mask)


@pytest.mark.parametrize(
    "name,kwargs,match",
    [
        ("ppo", {"eps_low": 1.0}, "`eps_low` must be < 1"),
        ("ppo", {"eps_high": -0.1}, "`eps_high` must be >= 0"),
        ("ppo", {"dual_clip": 0.5}, "`dual_clip` must be > 1"),
        ("ppo", {"eps_low": float("nan")}, "`eps_low` must be finite"),
        ("sat", {"alpha": 0.0}, "`alpha` must be > 0"),
        ("sat", {"alpha": 1.5}, "`alpha` must be <= 1"),
        ("sat", {"alpha": jnp.float32(0.9)}, "`alpha` must be a Python or NumPy float"),
        ("sat", {"alpha": True}, "`alpha` must be a Python or NumPy float"),
        ("ppo", {"eps_high": True}, "`eps_high` must be a real number, got the bool"),
        ("spo", {"eps": np.bool_(True)}, "`eps` must be a real number, got the bool"),
        ("sat", {"hill_exponent": 0.0}, "`hill_exponent` must be > 0"),
        ("sat", {"kernel": 3}, "`kernel` must be a callable"),
        ("sat", {"quantile_method": "sort"}, "`method` must be one of"),
        ("sat_gspo", {"alpha": -1.0}, "`alpha` must be > 0"),
        ("dppo", {"delta": 0.0}, "`delta` must be > 0"),
        ("dppo", {"divergence": "js"}, "`divergence` must be 'tv' or 'kl'"),
        ("spo", {"eps": 0.0}, "`eps` must be > 0"),
        ("drpo", {"delta": -1.0}, "`delta` must be > 0"),
        ("seqclip", {"low": 1.1, "high": 1.0}, "`high` must be >= 1.1"),
    ],
)
def test_hyperparameter_errors(name, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        losses.get(name)(*_ok(), **kwargs)


def test_other_public_functions_validate():
    logp, beh, _, mask = _ok()
    with pytest.raises(ValueError, match="`cap` must be > 0"):
        losses.tis(logp, beh, mask, cap=0.0)
    with pytest.raises(ValueError, match="`old_logp` must have rank 2"):
        losses.icepop(logp[0], beh, mask)
    with pytest.raises(TypeError, match="phi"):
        losses.kpop(logp, beh, mask)  # φ has no default in the paper
    with pytest.raises(ValueError, match="`ref_logp` must have shape"):
        losses.low_var_kl(logp, beh[:1], mask)
    with pytest.raises(ValueError, match="`mask` must have shape"):
        losses.mismatch_metrics(logp, beh, mask[0])
    with pytest.raises(ValueError, match="`alpha` must be a Python or NumPy float in"):
        losses.quantile(logp, mask, 0.0)
    with pytest.raises(ValueError, match="`values` must have rank 2"):
        losses.aggregate(logp[0], mask[0])


@pytest.mark.parametrize("name", NAMES)
def test_all_masked_gives_zero_and_finite(name):
    logp, beh, adv, _ = _ok()
    mask = np.zeros((B, T), bool)
    fn = losses.get(name)
    (value, metrics), grad = jax.value_and_grad(
        lambda x: (lambda o: (o.loss, o.metrics))(fn(x, beh, adv, mask)), has_aux=True
    )(logp)
    assert float(value) == 0.0
    np.testing.assert_array_equal(grad, 0.0)
    for k, v in metrics.items():
        assert np.isfinite(v), k
    for mode in losses.AGGREGATIONS:
        assert float(fn(logp, beh, adv, mask, aggregation=mode).loss) == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_padding_never_leaks(name):
    logp, beh, adv, _ = _ok()
    mask = np.arange(T)[None, :] < np.array([[5], [2], [0]])
    fn = jax.jit(jax.value_and_grad(lambda x, b, a, m: losses.get(name)(x, b, a, m).loss))
    clean_value, clean_grad = fn(logp, beh, np.broadcast_to(adv[:, None], (B, T)), mask)
    for poison in (np.nan, np.inf, -np.inf):
        lp, bh = logp.copy(), beh.copy()
        ad = np.broadcast_to(adv[:, None], (B, T)).copy()
        lp[~mask], bh[~mask], ad[~mask] = poison, -poison, poison
        value, grad = fn(lp, bh, ad, mask)
        assert np.isfinite(value) and np.all(np.isfinite(grad)), poison
        np.testing.assert_array_equal(value, clean_value)
        np.testing.assert_array_equal(grad, clean_grad)


@pytest.mark.parametrize("name", NAMES)
def test_extreme_log_ratios_stay_finite(name):
    _, beh, adv, mask = _ok()
    logp = beh + np.array([1e4, -1e4, 30.0, -30.0, 0.0], np.float32)[None, :]
    fn = losses.get(name)
    (value, metrics), grad = jax.value_and_grad(
        lambda x: (lambda o: (o.loss, o.metrics))(fn(x, beh, adv, mask)), has_aux=True
    )(logp)
    assert np.isfinite(value), name
    assert np.all(np.isfinite(grad)), name
    for k, v in metrics.items():
        assert np.isfinite(v), (name, k)
    assert float(metrics["mismatch_max"]) == losses.LOG_RATIO_CLAMP


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_inputs_compute_in_float32(name):
    logp, beh, adv, mask = _ok()
    lp16, beh16, adv16 = (jnp.asarray(x, jnp.bfloat16) for x in (logp, beh, adv))
    fn = losses.get(name)
    out16 = fn(lp16, beh16, adv16, mask)
    assert out16.loss.dtype == jnp.float32
    assert all(v.dtype == jnp.float32 for v in out16.metrics.values())
    out32 = fn(*(np.asarray(x, np.float32) for x in (lp16, beh16, adv16)), mask)
    np.testing.assert_array_equal(out16.loss, out32.loss)
    grad = jax.grad(lambda x: fn(x, beh16, adv16, mask).loss)(lp16)
    assert grad.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(grad, np.float32)))


def test_numeric_masks_equal_bool_masks():
    logp, beh, adv, _ = _ok()
    mask = np.arange(T)[None, :] < np.array([[5], [2], [1]])
    want = losses.sat(logp, beh, adv, mask).loss
    for m in (mask.astype(np.int32), mask.astype(np.uint8), mask.astype(np.float32)):
        np.testing.assert_array_equal(losses.sat(logp, beh, adv, m).loss, want)
        np.testing.assert_array_equal(jax.jit(losses.sat)(logp, beh, adv, m).loss, want)


@pytest.mark.parametrize("name", NAMES)
def test_masks_other_than_0_1_are_refused_or_read_as_nonzero(name):
    """A 0.5 meant as a weight: refused when concrete (pointing at token_weights); under jit
    values are traced, and the one rule, mask != 0, reads it as 1 (documented in _base)."""
    logp, beh, adv, mask = _ok()
    fn = losses.get(name)
    for bad, shown in ((0.5, "0.5"), (2, "2")):
        m = np.where(mask, bad, 0).astype(np.float32 if shown == "0.5" else np.int32)
        with pytest.raises(
            ValueError, match=f"`mask` must hold only 0 and 1, got {shown}.*`token_weights`"
        ):
            fn(logp, beh, adv, m)
        np.testing.assert_array_equal(
            jax.jit(fn)(logp, beh, adv, m).loss, fn(logp, beh, adv, mask).loss
        )


@pytest.mark.parametrize("shape", [(0, T), (B, 0)])
def test_empty_batches_name_the_argument(shape):
    z = np.zeros(shape, np.float32)
    m = np.zeros(shape, bool)
    adv = np.zeros(shape[:1], np.float32)
    for name in NAMES:
        with pytest.raises(ValueError, match="`logp` must have at least one row and one token"):
            losses.get(name)(z, z, adv, m)
    with pytest.raises(ValueError, match="`old_logp` must have at least one row"):
        losses.tis(z, z, m)
    with pytest.raises(ValueError, match="`values` must have at least one row"):
        losses.aggregate(z, m)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_advantage_on_an_active_token(name, bad):
    logp, beh, adv, mask = _ok()
    adv = np.broadcast_to(adv[:, None], (B, T)).copy()
    adv[1, 2] = bad
    fn = losses.get(name)
    with pytest.raises(
        ValueError,
        match=r"`advantages` must be finite on active tokens, got .* "
        r"at row 1, token 2",
    ):
        fn(logp, beh, adv, mask)
    # Under jit: the documented result is a NaN loss (never -inf), with finite gradients.
    value, grad = jax.jit(jax.value_and_grad(lambda x: fn(x, beh, adv, mask).loss))(logp)
    assert np.isnan(value)
    assert np.all(np.isfinite(grad))
    # On a masked position it is padding, and ignored.
    mask[1, 2] = False
    assert np.isfinite(fn(logp, beh, adv, mask).loss)


def test_numpy_scalar_hyperparameters_are_accepted():
    args = _ok()
    want = losses.sat(*args, alpha=0.9, eps_low=0.1).loss
    got = losses.sat(*args, alpha=np.float32(0.9), eps_low=np.float64(0.1)).loss
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(
        losses.ppo(*args, eps_high=np.float32(0.2)).loss, losses.ppo(*args).loss
    )
