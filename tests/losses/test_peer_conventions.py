"""Our losses against the peers' conventions, restated here in NumPy (float64) from their formulas.

The peers (read, not copied; docs/losses.md has the table and the versions):

* verl, ``verl/trainer/ppo/core_algos.py``: ``agg_loss`` in an early form (``seq-mean-*`` average
  over every row; ``seq-mean-token-sum-norm`` = Σ m·x / T) and a late form (``seq-mean-*``
  average over rows with an active token; ``seq-mean-token-sum-norm`` = that / T);
  ``compute_policy_loss_vanilla`` (dual clip always on, c = 3), ``compute_policy_loss_gspo``
  (the GSPO-token form, log s capped at 10, aggregated ``seq-mean-token-mean``),
  ``compute_policy_loss_dppo_tv/kl`` (mask replaces the clip, weight sg(min(r, 20)));
  ``rollout_corr_helper.py``: TIS / IcePop weights and ``token_k1`` rejection.
* tunix, ``tunix/rl/common.py`` ``aggregate_loss`` and ``tunix/rl/algo_core.py``
  ``grpo_loss_fn`` (token log-ratios clamped at ±20; ``gspo-token`` caps log s at 10).

Each reference computes a loss from ``logp`` with its detached parts taken at ``frozen``, so central
finite differences give the gradient the peer's autograd would. Edge cases in every batch: an
empty row, a row with holes in its mask, a one-token row, per-sequence and per-token advantages;
large log-ratios where the convention is about them.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _loss_reference import central_difference
from jax.sharding import PartitionSpec as P

from sat_jax import losses

B, T = 5, 6
CLAMP, CAP = 20.0, 10.0


# ----------------------------------------------------------------------------------------------
# Peer references (float64).
# ----------------------------------------------------------------------------------------------


def _masked(x, m):
    return np.where(m, x, 0.0)


def verl_agg_early(loss_mat, m, mode):
    x, mf = _masked(loss_mat, m), m.astype(np.float64)
    if mode == "token-mean":
        return x.sum() / mf.sum()
    if mode == "seq-mean-token-sum":
        return x.sum(-1).mean()  # every row counts, empty ones too
    if mode == "seq-mean-token-mean":
        return (x.sum(-1) / mf.sum(-1)).mean()  # an empty row makes this 0/0
    if mode == "seq-mean-token-sum-norm":
        return x.sum() / m.shape[-1]
    raise KeyError(mode)


def verl_agg_late(loss_mat, m, mode):
    x, mf = _masked(loss_mat, m), m.astype(np.float64)
    n = mf.sum(-1)
    rows = (n > 0).sum()  # global_batch_size defaults to the rows with an active token
    if mode == "token-mean":
        return x.sum() / mf.sum()
    if mode == "seq-mean-token-sum":
        return x.sum() / rows
    if mode == "seq-mean-token-sum-norm":
        return x.sum() / rows / m.shape[-1]
    if mode == "seq-mean-token-mean":
        return (x.sum(-1) / (n + 1e-8))[n > 0].sum() / rows
    raise KeyError(mode)


def tunix_agg(loss_mat, m, mode, norm=None):
    x, mf = _masked(loss_mat, m), m.astype(np.float64)
    n = mf.sum(-1)
    rows = (n > 0).sum()
    if mode == "token-mean":
        return x.sum() / max(mf.sum(), 1.0)
    if mode == "sequence-mean-token-mean":
        return (x.sum(-1) / np.maximum(n, 1.0)).sum() / max(rows, 1.0)
    if mode == "sequence-mean-token-scale":
        return (x.sum(-1) / (norm or m.shape[-1])).sum() / max(rows, 1.0)
    if mode == "seq-mean-token-sum":
        return x.sum() / max(rows, 1e-6)
    if mode == "sequence-mean-token-sum-norm":
        return x.sum() / (norm or m.shape[0])
    raise KeyError(mode)


AGG = {"verl_early": verl_agg_early, "verl_late": verl_agg_late, "tunix": tunix_agg}


def _adv2d(adv, shape):
    return adv if adv.ndim == 2 else np.broadcast_to(adv[:, None], shape)


def clipped_pg(ratio, adv, eps_low, eps_high, c=None):
    """Per-token loss max(−A·r, −A·clip(r)), with the dual clip min(·, −c·A) on A < 0."""
    loss = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - eps_low, 1 + eps_high))
    if c is not None:
        loss = np.where(adv < 0, np.minimum(loss, -c * adv), loss)
    return loss


def peer_ppo(logp, frozen, old, adv, m, eps_low, eps_high, c):
    """verl vanilla (c = 3 by default) and tunix grpo (c = epsilon_c, None by default)."""
    r = np.exp(np.clip(logp - old, -CLAMP, CLAMP))
    return clipped_pg(r, _adv2d(adv, logp.shape), eps_low, eps_high, c)


def _gspo_token_log_s(logp, frozen, old, m, clamp_tokens):
    lr = frozen - old
    if clamp_tokens:  # tunix clamps tokens at ±20 before the mean; verl does not
        lr = np.clip(lr, -CLAMP, CLAMP)
    seq = _masked(lr, m).sum(-1) / np.maximum(m.sum(-1), 1)
    return np.minimum(logp - frozen + seq[:, None], CAP)


def tunix_gspo_token(logp, frozen, old, adv, m, eps_low, eps_high):
    s = np.exp(_gspo_token_log_s(logp, frozen, old, m, clamp_tokens=True))
    return clipped_pg(s, _adv2d(adv, logp.shape), eps_low, eps_high)


def verl_gspo(logp, frozen, old, adv, m, eps_low, eps_high):
    s = np.exp(_gspo_token_log_s(logp, frozen, old, m, clamp_tokens=False))
    return clipped_pg(s, _adv2d(adv, logp.shape), eps_low, eps_high)


def verl_dppo(logp, frozen, old, adv, m, delta, divergence, c=20.0):
    """−A·sg(min(r, c))·log π·valid, valid from the signed probability change of the token."""
    adv = _adv2d(adv, logp.shape)
    w = np.minimum(np.exp(np.clip(frozen - old, -CLAMP, CLAMP)), c)
    p, q = np.exp(frozen), np.exp(old)
    if divergence == "tv":
        pos, neg = (p - q) <= delta, (p - q) >= -delta
    else:
        kl = q * (old - frozen) + (1 - q) * np.log((1 - q + 1e-8) / (1 - p + 1e-8))
        pos, neg = (kl <= delta) | (p <= q), (kl <= delta) | (p >= q)
    valid = np.where(adv > 0, pos, neg)
    return -adv * w * logp * valid


def verl_is_weights(old, rollout, m, threshold):
    """rollout_is="token": TIS for a float threshold, IcePop for a (lower, upper) pair."""
    k = np.exp(np.clip(old - rollout, -CLAMP, CLAMP)) * m
    if isinstance(threshold, tuple):
        lo, hi = threshold
        return np.where((k >= lo) & (k <= hi), k, 0.0)
    return np.minimum(k, threshold)


def verl_rs_token_k1(old, rollout, m, lower, upper):
    """rollout_rs="token_k1" with threshold "lower_upper": keep log lower ≤ −log k ≤ log upper."""
    k1 = -np.clip(old - rollout, -CLAMP, CLAMP)
    return m & (k1 >= math.log(lower)) & (k1 <= math.log(upper))


def peer_value_and_grad(per_token, agg, logp, m, h=1e-6):
    """Value and central finite-difference gradient of agg(per_token(logp, frozen=logp), m)."""
    logp = np.asarray(logp, np.float64)
    return central_difference(lambda x: agg(per_token(x, logp), m), logp, h)


# ----------------------------------------------------------------------------------------------
# Inputs and our side.
# ----------------------------------------------------------------------------------------------


def _mask(empty_row=True):
    m = np.ones((B, T), bool)
    m[1] = [1, 0, 1, 1, 0, 1]  # holes
    m[2] = not empty_row  # empty row
    m[3, 1:] = False  # one token
    m[4, 4:] = False
    return m


def _batch(seed, per_token_adv, scale=0.3, empty_row=True):
    rng = np.random.default_rng(seed)
    beh = np.log(rng.uniform(0.05, 0.9, (B, T))).astype(np.float32)
    logp = np.minimum(beh + rng.normal(0.0, scale, (B, T)), -1e-3).astype(np.float32)
    adv = rng.normal(size=(B, T) if per_token_adv else (B,)).astype(np.float32)
    return logp, beh, adv, _mask(empty_row)


def ours(fn, logp, beh, adv, mask, **kw):
    """Our loss value and gradient in logp, with NaN on the padding (it must never matter)."""
    lp = np.where(mask, logp, np.nan).astype(np.float32)
    value, grad = jax.value_and_grad(lambda x: fn(x, beh, adv, mask, **kw).loss)(lp)
    return np.float64(value), np.asarray(grad, np.float64)


def _clean(logp, mask):
    return np.where(mask, logp, 0.0).astype(np.float64)


def _close(got, want, rtol=1e-5, atol=1e-6):
    chex.assert_trees_all_close(got[0], want[0], rtol=rtol, atol=atol)
    chex.assert_trees_all_close(got[1], want[1], rtol=1e-4, atol=atol)


# ----------------------------------------------------------------------------------------------
# 1. Aggregation: which of our modes is which peer mode (Dr.GRPO divisors included).
# ----------------------------------------------------------------------------------------------

EQUIVALENT = [  # (ours, peer, peer's mode, peer kwargs, batch has an empty row)
    ("token-mean", "verl_late", "token-mean", {}, True),
    ("token-mean", "verl_early", "token-mean", {}, True),
    ("token-mean", "tunix", "token-mean", {}, True),
    ("seq-mean-token-mean", "verl_late", "seq-mean-token-mean", {}, True),
    ("seq-mean-token-mean", "tunix", "sequence-mean-token-mean", {}, True),
    ("seq-mean-token-mean", "verl_early", "seq-mean-token-mean", {}, False),
    ("seq-mean-token-sum", "verl_late", "seq-mean-token-sum", {}, True),
    ("seq-mean-token-sum", "tunix", "seq-mean-token-sum", {}, True),
    ("seq-mean-token-sum", "verl_early", "seq-mean-token-sum", {}, False),
    ("seq-mean-token-sum-norm", "tunix", "sequence-mean-token-sum-norm", {"norm": B * T}, True),
    ("seq-mean-token-sum-norm-active", "verl_late", "seq-mean-token-sum-norm", {}, True),
    ("seq-mean-token-sum-norm-active", "tunix", "sequence-mean-token-scale", {}, True),
    ("seq-sum-token-sum-norm", "verl_early", "seq-mean-token-sum-norm", {}, True),
    ("seq-sum-token-sum-norm", "tunix", "sequence-mean-token-sum-norm", {"norm": T}, True),
]


@pytest.mark.parametrize("per_token_adv", [False, True], ids=["seq-adv", "token-adv"])
@pytest.mark.parametrize(
    "mode,peer,peer_mode,peer_kw,empty_row",
    EQUIVALENT,
    ids=[f"{e[0]}={e[1]}:{e[2]}" for e in EQUIVALENT],
)
def test_aggregation_equals_peer_mode(mode, peer, peer_mode, peer_kw, empty_row, per_token_adv):
    """PPO/GRPO values and gradients: verl's vanilla has the dual clip on (c = 3), tunix's off."""
    logp, beh, adv, mask = _batch(0, per_token_adv, empty_row=empty_row)
    c = 3.0 if peer.startswith("verl") else None
    got = ours(
        losses.ppo, logp, beh, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=c, aggregation=mode
    )
    want = peer_value_and_grad(
        lambda x, fr: peer_ppo(x, fr, beh, adv, mask, 0.2, 0.28, c),
        lambda x, m: AGG[peer](x, m, peer_mode, **peer_kw),
        _clean(logp, mask),
        mask,
    )
    _close(got, want)


def test_dr_grpo_divisors_hand():
    """Three rows (one empty), T = 4, Σ m·x = 12: ours /(3·4), active rows /(2·4), early verl /4."""
    x = jnp.array([[1.0, 2.0, 3.0, 0.0], [9.0, 9.0, 9.0, 9.0], [6.0, 0.0, 0.0, 0.0]])
    m = jnp.array([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]])
    assert float(losses.aggregate(x, m, "seq-mean-token-sum-norm")) == pytest.approx(12 / 12)
    assert float(losses.aggregate(x, m, "seq-mean-token-sum-norm-active")) == pytest.approx(12 / 8)
    assert float(losses.aggregate(x, m, "seq-sum-token-sum-norm")) == pytest.approx(12 / 4)
    # Without empty rows ours and the active-rows divisor agree; ÷T alone is B times larger.
    x2, m2 = x[::2], m[::2]
    assert float(losses.aggregate(x2, m2, "seq-mean-token-sum-norm")) == pytest.approx(12 / 8)
    assert float(losses.aggregate(x2, m2, "seq-mean-token-sum-norm-active")) == pytest.approx(1.5)
    assert float(losses.aggregate(x2, m2, "seq-sum-token-sum-norm")) == pytest.approx(3.0)
    for mode in ("seq-mean-token-sum-norm-active", "seq-sum-token-sum-norm"):
        assert float(losses.aggregate(x, jnp.zeros_like(m), mode)) == 0.0


def test_dr_grpo_stated_differences():
    """With an empty row: ours = late verl × B_act/B; tunix's default sum-norm (÷B) = ours × T."""
    logp, beh, adv, mask = _batch(1, False)
    s = peer_ppo(_clean(logp, mask), None, beh, adv, mask, 0.2, 0.2, None)
    ours_v = float(losses.aggregate(s, mask, "seq-mean-token-sum-norm"))
    rows = (mask.sum(1) > 0).sum()
    chex.assert_trees_all_close(
        ours_v, verl_agg_late(s, mask, "seq-mean-token-sum-norm") * rows / B, rtol=1e-6
    )
    chex.assert_trees_all_close(
        ours_v * T, tunix_agg(s, mask, "sequence-mean-token-sum-norm"), rtol=1e-6
    )
    assert rows < B  # the difference is real on this batch


# ----------------------------------------------------------------------------------------------
# 2. GSPO's sequence log-ratio cap.
# ----------------------------------------------------------------------------------------------


def _extreme_gspo_batch(per_token_adv):
    """Rows: below the cap; a one-token row at log r = 12; a 3-token row averaging 11; empty; a
    row whose mean is below the cap although one token is at +9.5."""
    logp, beh, adv, mask = _batch(2, per_token_adv, scale=0.05)
    shift = np.zeros((B, T), np.float32)
    shift[3, 0] = 12.0  # a one-token row above the cap
    mask[2, :3] = True  # row 2: three tokens at 10, 11, 12 (mean 11 > cap)
    shift[2, :3] = [10.0, 11.0, 12.0]
    shift[4, 0] = 9.5
    return (beh + shift).astype(np.float32), beh, adv, mask


@pytest.mark.parametrize("per_token_adv", [False, True], ids=["seq-adv", "token-adv"])
@pytest.mark.parametrize(
    "mode,peer_mode",
    [
        ("token-mean", "token-mean"),
        ("seq-mean-token-mean", "sequence-mean-token-mean"),
        ("seq-mean-token-sum-norm-active", "sequence-mean-token-scale"),
    ],
)
def test_gspo_token_cap_equals_tunix(mode, peer_mode, per_token_adv):
    logp, beh, adv, mask = _extreme_gspo_batch(per_token_adv)
    got = ours(losses.gspo_token, logp, beh, adv, mask, eps_low=0.2, eps_high=0.2, aggregation=mode)
    want = peer_value_and_grad(
        lambda x, fr: tunix_gspo_token(x, fr, beh, adv, mask, 0.2, 0.2),
        lambda x, m: tunix_agg(x, m, peer_mode),
        _clean(logp, mask),
        mask,
    )
    _close(got, want)
    uncapped = ours(
        losses.gspo_token,
        logp,
        beh,
        adv,
        mask,
        eps_low=0.2,
        eps_high=0.2,
        aggregation=mode,
        seq_log_ratio_cap=None,
    )[0]
    assert abs(uncapped) > 2 * abs(got[0])  # the cap binds on this batch


@pytest.mark.parametrize("per_token_adv", [False, True], ids=["seq-adv", "token-adv"])
def test_gspo_cap_equals_verl(per_token_adv):
    """verl's ``gspo`` loss mode is the GSPO-token form, aggregated seq-mean-token-mean; with
    sequence advantages our sequence-form ``gspo`` has the same value and gradient."""
    logp, beh, adv, mask = _extreme_gspo_batch(per_token_adv)
    want = peer_value_and_grad(
        lambda x, fr: verl_gspo(x, fr, beh, adv, mask, 0.2, 0.2),
        lambda x, m: verl_agg_late(x, m, "seq-mean-token-mean"),
        _clean(logp, mask),
        mask,
    )
    fns = [losses.gspo_token] + ([] if per_token_adv else [losses.gspo])
    for fn in fns:
        got = ours(
            fn, logp, beh, adv, mask, eps_low=0.2, eps_high=0.2, aggregation="seq-mean-token-mean"
        )
        _close(got, want)


def test_verl_averages_unclamped_tokens():
    """The one stated GSPO difference: a token with |log r| > 20 enters verl's mean unclamped,
    ours (and tunix's) at ±20."""
    logp, beh, adv, mask = _batch(3, False, scale=0.05)
    logp, adv = logp.copy(), adv.copy()
    logp[0, 0], adv[0] = beh[0, 0] - 50.0, 1.0  # A > 0 and ρ < 1 − ε: the unclipped branch
    clean = _clean(logp, mask)
    tunix_v = tunix_agg(
        tunix_gspo_token(clean, clean, beh, adv, mask, 0.2, 0.2), mask, "sequence-mean-token-mean"
    )
    verl_v = verl_agg_late(
        verl_gspo(clean, clean, beh, adv, mask, 0.2, 0.2), mask, "seq-mean-token-mean"
    )
    got = ours(
        losses.gspo_token,
        logp,
        beh,
        adv,
        mask,
        eps_low=0.2,
        eps_high=0.2,
        aggregation="seq-mean-token-mean",
    )[0]
    chex.assert_trees_all_close(got, tunix_v, rtol=1e-5)
    assert abs(tunix_v - verl_v) > 1e-4


def test_one_token_row_above_the_cap_hand():
    """One one-token row at log r = 12, A = −1: the peers' loss is e^10, the uncapped one e^12."""
    logp, beh, adv, mask = np.array([[12.0]]), np.array([[0.0]]), np.array([-1.0]), np.ones((1, 1))
    for fn in (losses.gspo, losses.gspo_token, losses.seqclip, losses.sat_gspo):
        kw = {"low": 0.0 + 1e-9, "high": 1e9} if fn is losses.seqclip else {}
        capped = fn(logp, beh, adv, mask, eps_low=0.2, eps_high=0.2, **kw)
        uncapped = fn(logp, beh, adv, mask, eps_low=0.2, eps_high=0.2, seq_log_ratio_cap=None, **kw)
        chex.assert_trees_all_close(capped.loss, math.exp(10.0), rtol=1e-6)
        chex.assert_trees_all_close(uncapped.loss, math.exp(12.0), rtol=1e-6)
        grad = jax.grad(
            lambda x, f=fn, k=kw: f(x, beh, adv, mask, eps_low=0.2, eps_high=0.2, **k).loss
        )(jnp.asarray(logp))
        assert float(grad[0, 0]) == 0.0  # above the cap: no gradient, as in the peers
    clean = np.array([[12.0]])
    want = verl_agg_late(
        verl_gspo(clean, clean, beh, adv, mask.astype(bool), 0.2, 0.2),
        mask.astype(bool),
        "seq-mean-token-mean",
    )
    chex.assert_trees_all_close(want, math.exp(10.0), rtol=1e-7)  # verl's token mean has n + 1e-8


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "sat_gspo", "seqclip"])
def test_gspo_family_finite_and_bounded_on_extreme_rows(name):
    """Huge, −inf and beyond-clamp log-ratios, one-token and empty rows: finite loss, metrics and
    gradient in every aggregation, and |loss| ≤ e^cap·max|A| in the averaging modes."""
    fn = losses.get(name)
    beh = np.full((4, 5), -1.0, np.float32)
    logp = beh + np.array(
        [
            [1e4, -1e4, 30.0, -30.0, 0.0],
            [12.0, 0.0, 0.0, 0.0, 0.0],
            [25.0, 25.0, 25.0, 25.0, 25.0],
            [0.0, 0.0, 0.0, 0.0, 0.0],
        ],
        np.float32,
    )
    logp[3, 1] = -np.inf  # a sampled token the trainer gives probability 0
    mask = np.array([[1] * 5, [1, 0, 0, 0, 0], [1] * 5, [1, 1, 0, 0, 0]], bool)
    adv = np.array([-2.0, -1.0, -3.0, 1.5], np.float32)
    kw = {"low": 1e-12, "high": 1e12} if name == "seqclip" else {}
    for mode in losses.AGGREGATIONS:

        def f(x, m=mode):
            out = fn(x, beh, adv, mask, eps_low=0.2, eps_high=0.2, aggregation=m, **kw)
            return out.loss, out.metrics

        (value, metrics), grad = jax.value_and_grad(f, has_aux=True)(logp)
        assert np.isfinite(value) and np.all(np.isfinite(grad)), (name, mode)
        assert all(np.isfinite(v) for v in metrics.values()), (name, mode)
        if mode in (
            "token-mean",
            "seq-mean-token-mean",
            "seq-mean-token-sum-norm",
            "seq-mean-token-sum-norm-active",
        ):
            assert abs(float(value)) <= math.exp(CAP) * 3.0 * (1 + 1e-6), (name, mode)


# ----------------------------------------------------------------------------------------------
# 3. GSPO-token's gradient equals GSPO's with sequence advantages, in every aggregation.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
def test_gspo_token_gradient_equals_gspo(mode):
    logp, beh, adv, mask = _batch(4, False, scale=0.1)
    kw = {"eps_low": 0.05, "eps_high": 0.05, "aggregation": mode}
    seq = ours(losses.gspo, logp, beh, adv, mask, **kw)
    tok = ours(losses.gspo_token, logp, beh, adv, mask, **kw)
    chex.assert_trees_all_close(tok[0], seq[0], rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(tok[1], seq[1], rtol=1e-5, atol=1e-8)
    assert np.abs(seq[1]).max() > 1e-3  # not a vacuous comparison of zeros
    # Per-token advantages: GSPO-token's gradient follows each token's own advantage; GSPO's not.
    adv_t = np.random.default_rng(5).normal(size=(B, T)).astype(np.float32)
    g_seq = ours(losses.gspo, logp, beh, adv_t, mask, **kw)[1]
    g_tok = ours(losses.gspo_token, logp, beh, adv_t, mask, **kw)[1]
    assert not np.allclose(g_seq, g_tok, rtol=1e-3, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# 4. DPPO: the paper's clip × mask, and verl's mask-instead-of-clip.
# ----------------------------------------------------------------------------------------------


def _dppo_batch(per_token_adv):
    logp, beh, adv, mask = _batch(6, per_token_adv, scale=0.6)
    logp, beh, adv = logp.copy(), beh.copy(), adv.copy()
    beh[0, 0], logp[0, 0] = np.log(0.02), np.log(0.9)  # r = 45 > 20: verl's ratio cap ...
    adv[0] = -1.0  # ... on a pull-back move, which the mask keeps
    return logp, beh, adv, mask


@pytest.mark.parametrize("per_token_adv", [False, True], ids=["seq-adv", "token-adv"])
@pytest.mark.parametrize("divergence,delta", [("tv", 0.05), ("kl", 0.02)])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_dppo_verl_variant_has_verls_gradient(divergence, delta, mode, per_token_adv):
    logp, beh, adv, mask = _dppo_batch(per_token_adv)
    got = ours(
        losses.dppo,
        logp,
        beh,
        adv,
        mask,
        delta=delta,
        divergence=divergence,
        variant="verl",
        aggregation=mode,
    )
    peer_mode = {"token-mean": "token-mean", "seq-mean-token-mean": "seq-mean-token-mean"}[mode]
    clean = _clean(logp, mask)
    _, want_g = peer_value_and_grad(
        lambda x, fr: verl_dppo(x, fr, beh, adv, mask, delta, divergence),
        lambda x, m: verl_agg_late(x, m, peer_mode),
        clean,
        mask,
    )
    chex.assert_trees_all_close(got[1], want_g, rtol=1e-4, atol=1e-6)
    # Value: keep·min(r, 20)·A aggregated (verl reports −A·w·log π: same gradient, other value).
    keep = verl_dppo(np.ones_like(clean), clean, beh, adv, mask, delta, divergence) != 0
    w = np.minimum(np.exp(clean - beh), 20.0)
    a2 = _adv2d(adv, clean.shape)
    chex.assert_trees_all_close(
        got[0], -verl_agg_late(np.where(keep, w * a2, 0.0), mask, mode), rtol=1e-5, atol=1e-6
    )
    assert ((np.exp(clean - beh) > 20.0) & keep & mask).any() and not keep[mask].all()


def test_dppo_variants_differ_exactly_where_the_clip_binds():
    """A kept token beyond PPO's edge: the paper's variant clips it (no gradient), verl's not."""
    logp = np.log(np.array([[0.6, 0.3]], np.float32))
    beh = np.log(np.array([[0.45, 0.3]], np.float32))  # token 0: r = 4/3 > 1.2, |π − μ| = 0.15
    adv, mask = np.array([1.0], np.float32), np.ones((1, 2), bool)
    g = {
        v: jax.grad(lambda x, v=v: losses.dppo(x, beh, adv, mask, delta=0.2, variant=v).loss)(logp)
        for v in ("paper", "verl")
    }
    chex.assert_trees_all_close(
        g["paper"], np.asarray([[0.0, -0.5]]), atol=1e-7
    )  # −r·A/2 on token 1 only
    chex.assert_trees_all_close(g["verl"], np.asarray([[-(0.6 / 0.45) / 2, -0.5]]), rtol=1e-5)
    # With δ below |π − μ| the token is masked in both, and both gradients vanish on it.
    for v in ("paper", "verl"):
        gm = jax.grad(lambda x, v=v: losses.dppo(x, beh, adv, mask, delta=0.1, variant=v).loss)(
            logp
        )
        assert float(gm[0, 0]) == 0.0


# ----------------------------------------------------------------------------------------------
# 5. TIS and IcePop against verl's rollout correction.
# ----------------------------------------------------------------------------------------------


def _engine_batch():
    rng = np.random.default_rng(7)
    beh = np.log(rng.uniform(0.05, 0.9, (B, T))).astype(np.float32)
    # k spans [0.1, 10] with values a hair inside and outside the bounds 0.5 and 5.
    k = np.exp(rng.uniform(math.log(0.1), math.log(10.0), (B, T)))
    k[0, :4] = [0.5 * (1 - 1e-3), 0.5 * (1 + 1e-3), 5.0 * (1 - 1e-3), 5.0 * (1 + 1e-3)]
    old = (beh + np.log(k)).astype(np.float32)
    return old, beh, _mask()


def test_tis_and_icepop_weights_equal_verl_rollout_is():
    old, beh, mask = _engine_batch()
    chex.assert_trees_all_close(
        losses.tis(old, beh, mask, 2.0), verl_is_weights(old, beh, mask, 2.0), rtol=1e-6
    )
    chex.assert_trees_all_close(
        losses.icepop(old, beh, mask, 0.5, 5.0),
        verl_is_weights(old, beh, mask, (0.5, 5.0)),
        rtol=1e-6,
    )


@pytest.mark.parametrize("low,high", [(0.5, 5.0), (0.8, 1.25), (0.25, 2.0)])
def test_icepop_is_verl_token_k1_with_reciprocal_bounds(low, high):
    """token_k1 keeps log a ≤ −log k ≤ log b, i.e. 1/b ≤ k ≤ 1/a: icepop(0.5, 5) is "0.2_2"."""
    old, beh, mask = _engine_batch()
    keep = np.asarray(losses.icepop(old, beh, mask, low, high, binary=True)) > 0
    np.testing.assert_array_equal(keep, verl_rs_token_k1(old, beh, mask, 1 / high, 1 / low))
    if (low, high) == (0.5, 5.0):
        np.testing.assert_array_equal(keep, verl_rs_token_k1(old, beh, mask, 0.2, 2.0))
        assert 0 < keep[mask].sum() < mask.sum()


def test_verl_rejection_leaves_the_denominator_icepop_weights_do_not():
    """verl's rejection edits the response mask; IcePop weights keep the token in the count.
    ``mask & keep`` reproduces the first, ``token_weights`` the second."""
    old, beh, mask = _engine_batch()
    rng = np.random.default_rng(8)
    logp = (beh + rng.normal(0.0, 0.1, beh.shape)).astype(np.float32)
    adv = rng.normal(size=(B,)).astype(np.float32)
    keep = verl_rs_token_k1(old, beh, mask, 0.2, 2.0)
    binary = np.asarray(losses.icepop(old, beh, mask, 0.5, 5.0, binary=True))
    rs = ours(losses.ppo, logp, beh, adv, mask & (binary > 0), aggregation="token-mean")
    want = peer_value_and_grad(
        lambda x, fr: peer_ppo(x, fr, beh, adv, keep, 0.2, 0.2, None),
        lambda x, m: verl_agg_late(x, m, "token-mean"),
        _clean(logp, keep),
        keep,
    )
    _close(rs, want)
    weighted = ours(losses.ppo, logp, beh, adv, mask, token_weights=binary)
    chex.assert_trees_all_close(weighted[0] * mask.sum(), rs[0] * keep.sum(), rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# 6. Arguments, and the new modes and options under data-parallel sharding.
# ----------------------------------------------------------------------------------------------


def test_new_options_fail_at_the_boundary():
    logp, beh, adv, mask = _batch(9, False)
    for fn in (losses.gspo, losses.gspo_token, losses.sat_gspo, losses.seqclip):
        for bad in (0.0, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="`seq_log_ratio_cap`"):
                fn(logp, beh, adv, mask, seq_log_ratio_cap=bad)
    with pytest.raises(ValueError, match="`variant` must be 'paper' or 'verl'"):
        losses.dppo(logp, beh, adv, mask, variant="clip")
    with pytest.raises(ValueError, match="`ratio_cap`"):
        losses.dppo(logp, beh, adv, mask, variant="verl", ratio_cap=0.0)
    with pytest.raises(ValueError, match="seq-sum-token-sum-norm"):
        losses.ppo(logp, beh, adv, mask, aggregation="seq-sum")


NDEV = 8
SHARDED = [
    ("ppo", {"aggregation": "seq-mean-token-sum-norm-active"}),
    ("ppo", {"aggregation": "seq-sum-token-sum-norm"}),
    ("gspo_token", {"eps_low": 0.2, "eps_high": 0.2, "aggregation": "seq-mean-token-sum-norm"}),
    ("dppo", {"variant": "verl", "delta": 0.05}),
]


@pytest.mark.parametrize("name,hp", SHARDED, ids=[f"{n}-{i}" for i, (n, _) in enumerate(SHARDED)])
def test_shard_map_equals_unsharded(name, hp):
    assert jax.device_count() >= NDEV, "tests/conftest.py should provide 8 CPU devices"
    mesh = jax.make_mesh((NDEV,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rng = np.random.default_rng(10)
    rows = 2 * NDEV
    beh = np.log(rng.uniform(0.05, 0.9, (rows, T))).astype(np.float32)
    logp = np.minimum(beh + rng.normal(0, 0.3, (rows, T)), -1e-3).astype(np.float32)
    logp[5, 0] = beh[5, 0] + 12.0  # above GSPO's cap (a one-token row below)
    adv = rng.normal(size=(rows,)).astype(np.float32)
    lengths = rng.integers(0, T + 1, size=rows)
    lengths[:2], lengths[5] = 0, 1  # device 0 holds only empty rows
    mask = np.arange(T)[None, :] < lengths[:, None]
    fn = losses.get(name)

    def body(lp, b, a, m, axis_name=None):
        def loss(x):
            out = fn(x, b, a, m, axis_name=axis_name, **hp)
            return out.loss, out.metrics

        (v, met), g = jax.value_and_grad(loss, has_aux=True)(lp)
        return v, met, g

    want = jax.jit(body)(logp, beh, adv, mask)
    sharded = jax.jit(
        jax.shard_map(
            lambda *a: body(*a, axis_name="data"),
            mesh=mesh,
            in_specs=(P("data"),) * 4,
            out_specs=(P(), P(), P("data")),
        )
    )
    sharding = jax.sharding.NamedSharding(mesh, P("data"))
    got = sharded(*(jax.device_put(x, sharding) for x in (logp, beh, adv, mask)))
    chex.assert_trees_all_close(got[0], want[0], rtol=1e-5, atol=1e-7)
    assert set(got[1]) == set(want[1])
    for k in want[1]:
        chex.assert_trees_all_close(got[1][k], want[1][k], rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_close(got[2], want[2], rtol=1e-5, atol=1e-8)
    assert float(jnp.abs(want[2]).max()) > 0
