"""Hand-computed expectations for every objective, correction and helper (jitted and not)."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sat_jax import advantages, losses

JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


def _call(fn, jit, *args, **kw):
    if jit:
        return jax.jit(lambda *a: fn(*a, **kw))(*args)
    return fn(*args, **kw)


def _grad(fn, jit, logp, *args, **kw):
    g = jax.grad(lambda lp: fn(lp, *args, **kw).loss)
    return (jax.jit(g) if jit else g)(logp)


# Four tokens of one sequence, behaviour log-prob 0 so r = exp(logp).
R4 = np.array([[1.5, 0.5, 1.1, 0.7]], np.float32)
A4 = np.array([[1.0, 1.0, -1.0, -1.0]], np.float32)
M4 = np.ones((1, 4), bool)


@JIT
def test_ppo_hand(jit):
    out = _call(losses.ppo, jit, jnp.log(R4), jnp.zeros((1, 4)), A4, M4)
    # S = [min(1.5, 1.2), min(0.5, 0.8), min(-1.1, -1.1), min(-0.7, -0.8)] = [1.2, .5, -1.1, -.8]
    chex.assert_trees_all_close(out.loss, -(1.2 + 0.5 - 1.1 - 0.8) / 4, rtol=1e-6)
    chex.assert_trees_all_close(out.metrics["clip_frac_upper"], 0.25)
    chex.assert_trees_all_close(out.metrics["clip_frac_lower"], 0.25)
    chex.assert_trees_all_close(out.metrics["clip_frac"], 0.5)
    chex.assert_trees_all_close(out.metrics["ratio_mean"], (1.5 + 0.5 + 1.1 + 0.7) / 4, rtol=1e-6)
    g = _grad(losses.ppo, jit, jnp.log(R4), jnp.zeros((1, 4)), A4, M4)
    # dS/dlogp = r·A on unclipped tokens, 0 on clipped ones; loss = -mean.
    chex.assert_trees_all_close(
        g, np.asarray([[0.0, -0.5 / 4, 1.1 / 4, 0.0]]), rtol=1e-6, atol=1e-7
    )


@JIT
def test_ppo_dual_clip_hand(jit):
    r = np.array([[5.0, 2.0]], np.float32)
    out = _call(
        losses.ppo,
        jit,
        jnp.log(r),
        jnp.zeros((1, 2)),
        jnp.array([[-1.0, -1.0]]),
        jnp.ones((1, 2)),
        dual_clip=3.0,
    )
    # A<0: S = max(min(-r, -1.2), -3): r=5 -> -3 (dual clip), r=2 -> -2.
    chex.assert_trees_all_close(out.loss, (3.0 + 2.0) / 2, rtol=1e-6)
    chex.assert_trees_all_close(out.metrics["dual_clip_frac"], 0.5)


def _sat_example():
    # |d| = 0.01 … 0.10; α = 0.9 over n = 10 gives q = the 9th smallest = 0.09; only 0.10 is gated.
    d = np.array([[0.01, -0.02, 0.03, -0.04, 0.05, -0.06, 0.07, -0.08, 0.09, 0.10]], np.float32)
    return jnp.asarray(d), jnp.zeros_like(d), jnp.ones((1,)), jnp.ones(d.shape, bool)


@JIT
def test_sat_hand(jit):
    logp, beh, adv, mask = _sat_example()
    out = _call(losses.sat, jit, logp, beh, adv, mask)
    c_plus = 1.0 / (1.0 + (0.10 / 0.09) ** 2)  # Hill kernel, p = 2
    hi = 1.0 + 0.2 * c_plus
    assert math.exp(0.10) > hi  # the gated token is newly clipped
    s = [math.exp(x) for x in np.asarray(logp)[0, :9]] + [hi]
    chex.assert_trees_all_close(out.loss, -sum(s) / 10, rtol=1e-6)
    m = out.metrics
    chex.assert_trees_all_close(m["sat/q"], 0.09, rtol=1e-6)
    chex.assert_trees_all_close(m["sat/gate_rate"], 0.1)
    chex.assert_trees_all_close(m["sat/binding_rate"], 0.1)
    chex.assert_trees_all_close(m["sat/c_min"], c_plus, rtol=1e-5)
    chex.assert_trees_all_close(m["sat/eps_high_mean"], 0.2 * (9 + c_plus) / 10, rtol=1e-6)
    chex.assert_trees_all_close(m["sat/eps_low_mean"], 0.2, rtol=1e-6)
    g = _grad(losses.sat, jit, logp, beh, adv, mask)
    expect = -np.exp(np.asarray(logp)) / 10
    expect[0, 9] = 0.0  # SAT clips the gated token; PPO would not (e^0.1 < 1.2)
    chex.assert_trees_all_close(g, expect, rtol=1e-5)
    g_ppo = _grad(losses.ppo, jit, logp, beh, adv, mask)
    chex.assert_trees_all_close(g_ppo[0, 9], -math.exp(0.1) / 10, rtol=1e-5)


def test_sat_custom_kernel():
    logp, beh, adv, mask = _sat_example()
    out = losses.sat(logp, beh, adv, mask, kernel=lambda u, q: jnp.exp(-jnp.log(2.0) * u / q))
    c = math.exp(-math.log(2.0) * 0.10 / 0.09)
    chex.assert_trees_all_close(out.metrics["sat/c_min"], c, rtol=1e-5)
    out3 = losses.sat(logp, beh, adv, mask, hill_exponent=4.0)
    chex.assert_trees_all_close(out3.metrics["sat/c_min"], 1 / (1 + (0.10 / 0.09) ** 4), rtol=1e-5)


@JIT
def test_gspo_family_hand(jit):
    logp = jnp.array([[0.1, 0.3]])
    beh, adv, mask = jnp.zeros((1, 2)), jnp.ones((1,)), jnp.ones((1, 2))
    rho = math.exp(0.2)  # exp(mean(0.1, 0.3)) = 1.2214
    out = _call(losses.gspo, jit, logp, beh, adv, mask, eps_low=0.2, eps_high=0.2)
    chex.assert_trees_all_close(out.loss, -1.2, rtol=1e-6)  # clipped at 1 + 0.2
    chex.assert_trees_all_close(out.metrics["clip_frac_upper"], 1.0)
    chex.assert_trees_all_close(out.metrics["mismatch"], 0.2, rtol=1e-6)  # token ratios: (.1+.3)/2
    for fn in (losses.gspo, losses.gspo_token):
        out = _call(fn, jit, logp, beh, adv, mask, eps_low=0.3, eps_high=0.3)
        chex.assert_trees_all_close(out.loss, -rho, rtol=1e-6)
        g = _grad(fn, jit, logp, beh, adv, mask, eps_low=0.3, eps_high=0.3)
        chex.assert_trees_all_close(g, np.asarray([[-rho / 2, -rho / 2]]), rtol=1e-5)
    # Per-token advantages: GSPO-token gives each token its own advantage's gradient.
    adv_t = jnp.array([[1.0, 0.0]])
    g_tok = _grad(losses.gspo_token, jit, logp, beh, adv_t, mask, eps_low=0.3, eps_high=0.3)
    chex.assert_trees_all_close(g_tok, np.asarray([[-rho / 2, 0.0]]), rtol=1e-5)
    g_seq = _grad(losses.gspo, jit, logp, beh, adv_t, mask, eps_low=0.3, eps_high=0.3)
    chex.assert_trees_all_close(g_seq, np.asarray([[-rho / 4, -rho / 4]]), rtol=1e-5)


@JIT
def test_seqclip_hand(jit):
    # Sequence 0: ρ = e^0.01 ≈ 1.01 (dropped); sequence 1: ρ = e^0.001 (kept, inside ε = 0.2).
    logp = jnp.array([[0.01, 0.01], [0.001, 0.001]])
    out = _call(
        losses.seqclip,
        jit,
        logp,
        jnp.zeros((2, 2)),
        jnp.ones((2,)),
        jnp.ones((2, 2)),
        eps_low=0.2,
        eps_high=0.2,
    )
    chex.assert_trees_all_close(out.loss, -2 * math.exp(0.001) / 4, rtol=1e-6)
    chex.assert_trees_all_close(out.metrics["seqclip/kept_frac"], 0.5)


@JIT
def test_dppo_hand(jit):
    # μ = 0.5, π = 0.505: r = 1.01, TV = μ|r-1| = 0.005 > δ = 1e-3.
    beh = jnp.log(jnp.array([[0.5, 0.5]]))
    logp = jnp.log(jnp.array([[0.505, 0.505]]))
    adv = jnp.array([[1.0, -1.0]])  # token 0 moves outward (dropped), token 1 pulls back (kept)
    out = _call(losses.dppo, jit, logp, beh, adv, jnp.ones((1, 2)))
    chex.assert_trees_all_close(out.loss, 1.01 / 2, rtol=1e-5)
    chex.assert_trees_all_close(out.metrics["dppo/masked_frac"], 0.5)
    # With δ = 0.01 nothing is dropped.
    out = _call(losses.dppo, jit, logp, beh, adv, jnp.ones((1, 2)), delta=0.01)
    chex.assert_trees_all_close(out.loss, -(1.01 - 1.01) / 2, atol=1e-6)
    # KL discriminator: KL_B(0.5‖0.505) ≈ 5.0e-5, below the default δ = 0.05.
    out = _call(losses.dppo, jit, logp, beh, adv, jnp.ones((1, 2)), divergence="kl")
    chex.assert_trees_all_close(out.metrics["dppo/masked_frac"], 0.0)
    kl = 0.5 * math.log(0.5 / 0.505) + 0.5 * math.log(0.5 / 0.495)
    chex.assert_trees_all_close(losses.bernoulli_kl(jnp.log(0.5), jnp.log(0.505)), kl, rtol=1e-3)


@JIT
def test_spo_drpo_hand(jit):
    r, adv, mask = jnp.log(jnp.array([[1.5]])), jnp.ones((1,)), jnp.ones((1, 1))
    out = _call(losses.spo, jit, r, jnp.zeros((1, 1)), adv, mask, eps=0.2)
    chex.assert_trees_all_close(out.loss, -(1.5 - 0.25 / 0.4), rtol=1e-6)  # S = 0.875
    g = _grad(losses.spo, jit, r, jnp.zeros((1, 1)), adv, mask, eps=0.2)
    chex.assert_trees_all_close(
        g, np.asarray([[-1.5 * (1 - 0.5 / 0.2)]]), rtol=1e-6
    )  # -r(A - |A|(r-1)/ε)
    beh = jnp.log(jnp.array([[0.5]]))
    out = _call(losses.drpo, jit, beh + r, beh, adv, mask, delta=0.1)
    chex.assert_trees_all_close(out.loss, -(1.5 - 0.5 * 0.25 / 0.2), rtol=1e-6)


@JIT
def test_corrections_hand(jit):
    beh = jnp.zeros((1, 4))
    old = jnp.log(jnp.array([[3.0, 0.5, 6.0, 0.4]]))
    mask = jnp.array([[1, 1, 1, 0]])
    chex.assert_trees_all_close(
        _call(losses.tis, jit, old, beh, mask), np.asarray([[2.0, 0.5, 2.0, 0.0]]), rtol=1e-6
    )
    w = _call(losses.icepop, jit, old, beh, mask)
    chex.assert_trees_all_close(w, np.asarray([[3.0, 0.5, 0.0, 0.0]]), rtol=1e-6)
    chex.assert_trees_all_close(
        _call(losses.icepop, jit, old, beh, mask, binary=True), np.asarray([[1.0, 1.0, 0.0, 0.0]])
    )
    logp = jnp.log(jnp.array([[0.5, 0.9, 0.5]]))
    behp = jnp.log(jnp.array([[0.5, 0.1, 0.52]]))
    w = _call(losses.kpop, jit, logp, behp, jnp.ones((1, 3)), phi=0.01)
    # KL_B(0.5‖0.52) ≈ 8e-4 both ways (kept); 0.9 vs 0.1 is ≈ 1.76 nats (dropped).
    chex.assert_trees_all_close(w, np.asarray([[1.0, 0.0, 1.0]]))


def test_correction_composes_with_objective():
    logp = jnp.log(jnp.array([[1.0, 1.1]]))
    out = losses.ppo(
        logp,
        jnp.zeros((1, 2)),
        jnp.ones((1,)),
        jnp.ones((1, 2)),
        token_weights=jnp.array([[2.0, 0.5]]),
    )
    chex.assert_trees_all_close(out.loss, -(2.0 * 1.0 + 0.5 * 1.1) / 2, rtol=1e-6)
    # Weights are detached: the gradient is w·r·A/n, with no term from w.
    g = jax.grad(
        lambda w: (
            losses.ppo(
                logp, jnp.zeros((1, 2)), jnp.ones((1,)), jnp.ones((1, 2)), token_weights=w
            ).loss
        )
    )(jnp.ones((1, 2)))
    np.testing.assert_array_equal(g, 0.0)


@JIT
def test_low_var_kl_and_mismatch_hand(jit):
    logp = jnp.log(jnp.array([[0.25, 0.5]]))
    ref = jnp.log(jnp.array([[0.5, 0.5]]))
    out = _call(losses.low_var_kl, jit, logp, ref, jnp.ones((1, 2)))
    k3 = 2.0 - 1.0 - math.log(2.0)  # x = log 2
    chex.assert_trees_all_close(out.loss, k3 / 2, rtol=1e-6)
    chex.assert_trees_all_close(out.metrics["kl"], k3 / 2, rtol=1e-6)
    m = _call(losses.mismatch_metrics, jit, logp, ref, jnp.ones((1, 2)))
    d = [-math.log(2.0), 0.0]
    chex.assert_trees_all_close(m["mismatch"], math.log(2.0) / 2, rtol=1e-6)
    chex.assert_trees_all_close(m["k1"], math.log(2.0) / 2, rtol=1e-6)
    chex.assert_trees_all_close(m["k3"], (0.5 - 1 + math.log(2.0)) / 2, rtol=1e-6)
    chex.assert_trees_all_close(m["log_ratio_var"], np.var(d), rtol=1e-5)
    chex.assert_trees_all_close(m["mismatch_max"], math.log(2.0), rtol=1e-6)


def test_aggregations_hand():
    x = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = jnp.array([[1, 1, 1], [1, 0, 0]])
    chex.assert_trees_all_close(losses.aggregate(x, m, "token-mean"), 10 / 4)
    chex.assert_trees_all_close(losses.aggregate(x, m, "seq-mean-token-mean"), (2 + 4) / 2)
    chex.assert_trees_all_close(losses.aggregate(x, m, "seq-mean-token-sum"), (6 + 4) / 2)
    chex.assert_trees_all_close(losses.aggregate(x, m, "seq-mean-token-sum-norm"), 10 / 6)
    # A sequence with no active token does not count in the sequence means.
    x3 = jnp.concatenate([x, jnp.full((1, 3), 7.0)])
    m3 = jnp.concatenate([m, jnp.zeros((1, 3), m.dtype)])
    chex.assert_trees_all_close(losses.aggregate(x3, m3, "seq-mean-token-mean"), 3.0)
    for mode in losses.AGGREGATIONS:
        out = losses.ppo(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((2,)), m, aggregation=mode)
        chex.assert_trees_all_close(out.loss, -losses.aggregate(jnp.ones((2, 3)), m, mode))


def test_quantile_hand():
    x = jnp.array([3.0, 1.0, 2.0, 9.0, -5.0])
    m = jnp.array([1, 1, 1, 0, 1])
    for method in ("radix", "bisect"):
        q = lambda a, mm=m, meth=method: float(losses.quantile(x, mm, a, method=meth))  # noqa: E731
        assert q(0.5) == 1.0  # active sorted: -5, 1, 2, 3; ⌈0.5·4⌉ = 2nd
        assert q(0.25) == -5.0
        assert q(0.26) == 1.0
        assert q(1.0) == 3.0
        assert float(losses.quantile(x, jnp.zeros(5), 0.9, method=method)) == 0.0


def test_advantages_hand():
    r = jnp.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    s = math.sqrt(1.0 / 3.0)  # unbiased std of [1, 0, 0, 1]
    chex.assert_trees_all_close(
        advantages.grpo(r)[0], np.array([0.5, -0.5, -0.5, 0.5]) / (s + 1e-6), rtol=1e-6
    )
    chex.assert_trees_all_close(advantages.grpo(r)[1], 0.0)  # equal rewards: no signal
    chex.assert_trees_all_close(advantages.dr_grpo(r)[0], np.asarray([0.5, -0.5, -0.5, 0.5]))
    chex.assert_trees_all_close(
        advantages.rloo(r)[0], np.asarray([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]), rtol=1e-6
    )
    assert advantages.get("rloo") is advantages.rloo
    with pytest.raises(ValueError, match="rewards"):
        advantages.grpo(jnp.ones((4,)))
    with pytest.raises(ValueError, match="group_size"):
        advantages.grpo(jnp.ones((4, 1)))
    with pytest.raises(KeyError, match="unknown advantage"):
        advantages.get("ppo")


@JIT
def test_tis_pg_hand(jit):
    # r = [3, 0.5, 1.5, 0.2], A = [1, 1, -1, -1], C = 2; the last token masked (its inf padding
    # must not reach the loss or the gradient).
    r = np.array([[3.0, 0.5, 1.5, 0.2]], np.float32)
    a = np.array([[1.0, 1.0, -1.0, -1.0]], np.float32)
    mask = np.array([[1, 1, 1, 0]], bool)
    logp = np.where(mask, np.log(r), np.inf).astype(np.float32)
    out = _call(losses.tis_pg, jit, logp, jnp.zeros((1, 4)), a, mask, cap=2.0)
    # S = min(r, 2)·A = [2, 0.5, −1.5]; loss = −mean.
    np.testing.assert_allclose(out.loss, -(2.0 + 0.5 - 1.5) / 3, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["tis_pg/truncated_frac"], 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(out.metrics["ratio_mean"], (3.0 + 0.5 + 1.5) / 3, rtol=1e-6)
    g = _grad(losses.tis_pg, jit, jnp.asarray(logp), jnp.zeros((1, 4)), a, mask, cap=2.0)
    # dS/dlogp = min(r, C)·A on every active token, no clip: even r = 3 with A > 0 is pushed.
    np.testing.assert_allclose(g, [[-2.0 / 3, -0.5 / 3, 1.5 / 3, 0.0]], rtol=1e-6)
    # On-policy (r = 1) it is REINFORCE: the gradient is −A/n, which PPO's also is there.
    on = _grad(losses.tis_pg, jit, jnp.zeros((1, 4)), jnp.zeros((1, 4)), a, np.ones((1, 4)))
    ppo = _grad(losses.ppo, jit, jnp.zeros((1, 4)), jnp.zeros((1, 4)), a, np.ones((1, 4)))
    np.testing.assert_allclose(on, -a / 4, rtol=1e-6)
    np.testing.assert_allclose(on, ppo, rtol=1e-6)
    with pytest.raises(ValueError, match="`cap` must be > 0"):
        losses.tis_pg(logp, np.zeros((1, 4)), a, mask, cap=0.0)


def test_registry():
    assert set(losses.names()) >= {
        "ppo",
        "sat",
        "gspo",
        "gspo_token",
        "sat_gspo",
        "seqclip",
        "dppo",
        "spo",
        "drpo",
        "grpo",
        "tis_pg",
    }
    assert losses.get("tis_pg") is losses.tis_pg
    assert losses.names("correction") == ("geo_rs", "icepop", "kpop", "seq_mis", "tis")
    assert losses.get("sat_gspo") is losses.sat_gspo
    assert losses.get("tis") is losses.tis
    with pytest.raises(KeyError, match="unknown loss 'nope'"):
        losses.get("nope")
    with pytest.raises(ValueError, match="already registered"):
        losses.register("ppo", losses.ppo)


def test_signatures_match_the_documented_api():
    """Positional use as the README shows, and losses imports no flax/optax/orbax."""
    old, beh, mask = jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2))
    np.testing.assert_array_equal(losses.tis(old, beh, mask, 2.0), 1.0)
    np.testing.assert_array_equal(losses.icepop(old, beh, mask, 0.5, 5.0, True), 1.0)
    np.testing.assert_array_equal(losses.kpop(old, beh, mask, 0.1), 1.0)
    assert float(losses.quantile(jnp.arange(4.0), jnp.ones(4), 0.5, None)) == 1.0
    import subprocess
    import sys

    code = (
        "import sys, sat_jax.losses; bad = [m for m in ('flax', 'optax', 'orbax', "
        "'orbax.checkpoint', 'tensorflow') if m in sys.modules]; print(bad); "
        "sys.exit(1 if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
