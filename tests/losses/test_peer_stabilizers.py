"""The stabilizers against their peers' own code, restated here in NumPy (float64).

The peers (read, not copied; docs/losses.md has the table):

* AReaL, ``inclusionAI/AReaL``:
  ``areal/utils/functional.py`` @ ``56bad8b`` (``ppo_actor_loss_fn`` with
  ``behav_imp_weight_cap``: a token whose π_prox/μ exceeds the cap gets weight 0 and stays in the
  token count); ``areal/utils/functional/functional.py`` @ ``2274616`` (the cap replaced by
  ``rejection_sampling``, ``apply_rejection_sampling``: ``action="mask"`` zeroes, ``"clamp"``
  clamps, and ``rejection_sampling=None`` applies no behaviour weight at all); an intermediate
  version of that file (commit not shown) with ``behave_imp_weight_mode`` ``token_mask`` /
  ``token_truncate`` / ``disabled``; ``areal/trainer/ppo/actor.py`` @ ``00ed924``
  (``grpo_loss_fn``, ``_apply_m2po_masking``, ``_get_m2po_loss_mask``,
  ``compute_prox_logp_approximations``). The loss is Σ over active tokens / their count, per
  micro-batch; M2PO edits the loss mask before the loss, so its count is of the kept tokens.
* The BAPO authors, ``WooooDyy/BAPO``: ``recipe/bapo/policy_loss.py`` @ ``3b8389c``
  (``compute_policy_loss_bapo``, ``_compute_effective_advantage``); ``recipe/bapo/config.py``,
  ``recipe/bapo/config/bapo_trainer.yaml`` and ``recipe/bapo/run_bapo_example.sh`` @ ``820d9c0``
  (``adv_ratio_target`` 1, ranges [0.6, 0.8] and [1.2, 2.0], steps 0.05; the script: 0.5,
  [0.8, 0.95] step 0.05, [1.2, 2.0] step 0.1); ``README.md`` @ ``2e33eef`` (ρ₀ = 0.5, [0.6, 0.9],
  [1.2, 3.0]). The earlier ``policy_loss.py`` @ ``820d9c0`` read the bounds as ε and does not run.
* verl, ``volcengine/verl``: ``verl/trainer/ppo/rollout_corr_helper.py`` @ ``e190410``
  (``compute_rollout_correction_weights``; ``compute_rollout_rejection_mask`` with
  ``seq_sum_k1`` / ``seq_mean_k1``) and @ ``0b4e2a8`` (the earlier ``rollout_rs="sequence"`` /
  ``"geometric"``); the ``RolloutCorrectionConfig`` presets ``decoupled_seq_is_rs`` and
  ``decoupled_geo_rs`` of ``verl/trainer/config/algorithm.py`` (a stored copy, commit not shown).
* SkyRL, ``NovaSky-AI/SkyRL``: ``skyrl-train/skyrl_train/utils/ppo_utils.py`` @ ``9210371``
  (``compute_policy_loss_cispo``, ``_safe_exp_delta``, ``reduce_loss``).

Each loss reference computes a loss from ``logp`` with its detached parts taken at ``frozen`` (or
at the clean ``logp`` itself), so central finite differences give the peer's autograd gradient.
Batches have an empty row, a row with holes in its mask and a one-token row.
"""

import math

import chex
import jax
import numpy as np
import pytest
from _loss_reference import central_difference

from sat_jax import losses

B, T = 5, 6
CLAMP = 20.0


# ----------------------------------------------------------------------------------------------
# Shared helpers.
# ----------------------------------------------------------------------------------------------


def _mask():
    m = np.ones((B, T), bool)
    m[1] = [1, 0, 1, 1, 0, 1]  # holes
    m[2] = False  # empty row
    m[3, 1:] = False  # one token
    m[4, 4:] = False
    return m


def _adv2d(adv, shape):
    return adv if adv.ndim == 2 else np.broadcast_to(adv[:, None], shape)


def _token_mean(x, m):
    """Σ over active tokens / their count (AReaL's loss, verl's and SkyRL's ``token-mean``)."""
    return np.where(m, x, 0.0).sum() / max(m.sum(), 1)


def _clean(logp, mask):
    return np.where(mask, logp, 0.0).astype(np.float64)


def peer_value_and_grad(per_token, agg, logp, h=1e-6):
    """Value and central finite-difference gradient of agg(per_token(logp, frozen=logp))."""
    logp = np.asarray(logp, np.float64)
    return central_difference(lambda x: agg(per_token(x, logp)), logp, h)


def ours(fn, logp, beh, adv, mask, **kw):
    """Our loss value and gradient in logp, with NaN on the padding (it must never matter)."""
    lp = np.where(mask, logp, np.nan).astype(np.float32)
    value, grad = jax.value_and_grad(lambda x: fn(x, beh, adv, mask, **kw).loss)(lp)
    return np.float64(value), np.asarray(grad, np.float64)


def _close(got, want, rtol=1e-5, atol=1e-6):
    chex.assert_trees_all_close(got[0], want[0], rtol=rtol, atol=atol)
    chex.assert_trees_all_close(got[1], want[1], rtol=1e-4, atol=atol)


def _clip_pg(ratio, adv, lo, hi, c=None):
    """Per-token loss max(−A·r, −A·clip(r, lo, hi)); dual clip min(·, −c·A) on A < 0."""
    loss = np.maximum(-adv * ratio, -adv * np.clip(ratio, lo, hi))
    if c is not None:
        loss = np.where(adv < 0, np.minimum(loss, -c * adv), loss)
    return loss


# ----------------------------------------------------------------------------------------------
# 1. AReaL's decoupled PPO (ppo_actor_loss_fn) and its A-3PO proximal policy.
# ----------------------------------------------------------------------------------------------


def areal_behaviour_weight(prox, beh, m, cap, mode):
    """w = π_prox/μ. ``mode``: "mask" zeroes w > cap (``behav_imp_weight_cap``, ``token_mask``,
    ``rejection_sampling(action="mask")``), "clamp" takes min(w, cap) (``token_truncate``,
    ``action="clamp"``), "none" applies no weight (``rejection_sampling=None``, ``disabled``)."""
    w = np.exp(prox - beh)
    if mode == "none":
        w = np.ones_like(w)
    elif cap is not None and mode == "mask":
        w = np.where(w <= cap, w, 0.0)
    elif cap is not None and mode == "clamp":
        w = np.minimum(w, cap)
    return np.where(m, w, 0.0)


def areal_decoupled(logp, prox, beh, adv, m, eps_low, eps_high, cap=None, mode="mask"):
    """Per-token AReaL loss: max(−A·u, −A·clip(u, 1 − ε, 1 + ε_high))·w, u = π_θ/π_prox (no ±20
    clamp), w from :func:`areal_behaviour_weight` (detached: it has no π_θ in it)."""
    u = np.where(m, np.exp(logp - prox), 0.0)
    pg = _clip_pg(u, _adv2d(adv, logp.shape), 1 - eps_low, 1 + eps_high)
    return pg * areal_behaviour_weight(prox, beh, m, cap, mode)


def areal_loglinear_prox(beh, frozen, versions, current_version):
    """AReaL's ``loglinear`` proximal log-prob: α = (v_prox − v_beh)/(v_θ − v_beh) with
    v_prox = v_θ − 1, clamped to [0, 1] (0 where v_θ ≤ v_beh);
    log π_prox = log μ + α·(sg log π_θ − log μ)."""
    diff = current_version - versions.astype(np.float64)
    gap = (current_version - 1) - versions.astype(np.float64)
    alpha = np.clip(np.where(diff > 0, gap / np.where(diff > 0, diff, 1.0), 0.0), 0.0, 1.0)
    return beh + alpha * (frozen - beh)


def _decoupled_batch(seed, per_token_adv, prox_scale=0.3):
    rng = np.random.default_rng(seed)
    beh = np.log(rng.uniform(0.05, 0.9, (B, T))).astype(np.float32)
    prox = (beh + rng.normal(0.0, prox_scale, (B, T))).astype(np.float32)
    logp = (prox + rng.normal(0.0, 0.15, (B, T))).astype(np.float32)
    adv = rng.normal(size=(B, T) if per_token_adv else (B,)).astype(np.float32)
    return logp, prox, beh, adv, _mask()


@pytest.mark.parametrize("per_token_adv", [False, True], ids=["seq-adv", "token-adv"])
def test_decoupled_ppo_equals_areal_without_a_cap(per_token_adv):
    """No cap: AReaL's early ``behav_imp_weight_cap=None`` (and ``token_mask`` with no cap)
    weighs every token by π_prox/μ, as ours does; value and gradient are the same."""
    logp, prox, beh, adv, mask = _decoupled_batch(0, per_token_adv)
    got = ours(losses.decoupled_ppo, logp, beh, adv, mask, prox_logp=prox, eps_high=0.28)
    want = peer_value_and_grad(
        lambda x, fr: areal_decoupled(x, prox, beh, adv, mask, 0.2, 0.28, None),
        lambda x: _token_mean(x, mask),
        _clean(logp, mask),
    )
    _close(got, want)
    u = np.exp(logp - prox)[mask]
    assert (u > 1.28).any() or (u < 0.8).any()  # the clip binds somewhere


@pytest.mark.parametrize("per_token_adv", [False, True], ids=["seq-adv", "token-adv"])
def test_decoupled_ppo_cap_clamps_where_areal_token_mask_zeroes(per_token_adv):
    """With a cap ours is AReaL's ``token_truncate`` / ``rejection_sampling(action="clamp")``
    exactly, and AReaL's default ``token_mask`` / ``action="mask"`` (the early cap too) differs by
    exactly the over-cap tokens' terms at weight C; with no weight above C all three agree."""
    logp, prox, beh, adv, mask = _decoupled_batch(1, per_token_adv, prox_scale=0.5)
    cap = 1.3
    w = np.exp(prox.astype(np.float64) - beh)
    over = mask & (w > cap)
    assert over.any() and (mask & (w <= cap) & (w > 1.0)).any()
    got = ours(losses.decoupled_ppo, logp, beh, adv, mask, prox_logp=prox, behav_weight_cap=cap)
    clean = _clean(logp, mask)
    agg = lambda x: _token_mean(x, mask)  # noqa: E731
    clamp = peer_value_and_grad(
        lambda x, fr: areal_decoupled(x, prox, beh, adv, mask, 0.2, 0.2, cap, "clamp"), agg, clean
    )
    _close(got, clamp)
    zeroed = peer_value_and_grad(
        lambda x, fr: areal_decoupled(x, prox, beh, adv, mask, 0.2, 0.2, cap, "mask"), agg, clean
    )
    u = np.exp(clean - prox)
    pg = _clip_pg(u, _adv2d(adv, clean.shape), 0.8, 1.2)
    difference = np.where(over, cap * pg, 0.0).sum() / mask.sum()
    chex.assert_trees_all_close(got[0] - zeroed[0], difference, rtol=1e-5, atol=1e-7)
    assert abs(difference) > 1e-3
    # The gradients differ exactly on the over-cap tokens (AReaL's are 0 there).
    chex.assert_trees_all_close(np.where(over, 0.0, got[1]), zeroed[1], rtol=1e-4, atol=1e-6)
    assert np.all(zeroed[1][over] == 0.0) and np.abs(got[1][over]).max() > 1e-3
    # A cap no weight reaches: ours, AReaL's mask and clamp are one loss.
    high = float(w[mask].max()) * 1.01
    got_high = ours(
        losses.decoupled_ppo, logp, beh, adv, mask, prox_logp=prox, behav_weight_cap=high
    )
    for mode in ("mask", "clamp"):
        _close(
            got_high,
            peer_value_and_grad(
                lambda x, fr, md=mode: areal_decoupled(x, prox, beh, adv, mask, 0.2, 0.2, high, md),
                agg,
                clean,
            ),
        )


def test_areal_without_rejection_sampling_is_ppo_on_the_proximal_ratio():
    """AReaL's current ``rejection_sampling=None`` (the old ``disabled``) multiplies no behaviour
    weight: its loss is ours ``ppo`` with ``behavior_logp=prox_logp``, not ``decoupled_ppo``."""
    logp, prox, beh, adv, mask = _decoupled_batch(2, False)
    want = peer_value_and_grad(
        lambda x, fr: areal_decoupled(x, prox, beh, adv, mask, 0.2, 0.2, None, "none"),
        lambda x: _token_mean(x, mask),
        _clean(logp, mask),
    )
    _close(ours(losses.ppo, logp, prox, adv, mask), want)
    decoupled = ours(losses.decoupled_ppo, logp, beh, adv, mask, prox_logp=prox)
    assert abs(decoupled[0] - want[0]) > 1e-3


@pytest.mark.parametrize("per_token_adv", [False, True], ids=["seq-adv", "token-adv"])
def test_a3po_equals_areal_loglinear_proximal_policy(per_token_adv):
    """Ours A-3PO (``staleness=d``) is AReaL's ``prox_logp_method="loglinear"`` with versions
    v_θ − d: α = (d − 1)/d for d ≥ 1, 0 for d = 0 (AReaL's clamp), the same as our 1 − 1/d."""
    logp, _, beh, adv, mask = _decoupled_batch(3, per_token_adv)
    rng = np.random.default_rng(4)
    stale = rng.integers(0, 5, size=(B, T)).astype(np.int32)
    stale[0, :5] = [0, 1, 2, 3, 4]
    version = 10
    got = ours(losses.decoupled_ppo, logp, beh, adv, mask, staleness=stale)
    want = peer_value_and_grad(
        lambda x, fr: areal_decoupled(
            x, areal_loglinear_prox(beh, fr, version - stale, version), beh, adv, mask, 0.2, 0.2
        ),
        lambda x: _token_mean(x, mask),
        _clean(logp, mask),
    )
    _close(got, want)


# ----------------------------------------------------------------------------------------------
# 2. AReaL's M2PO mask (_apply_m2po_masking, _get_m2po_loss_mask).
# ----------------------------------------------------------------------------------------------


def areal_m2po_keep(beh, prox, m, tau):
    """M2 = (log μ − log π_prox)² over the active tokens; sorted largest first, the first k are
    masked, k the first index whose suffix mean is < τ (strict), or n − 1 if none is (so one
    token always stays). A stable sort stands in for torch's order among ties."""
    m2 = np.square(beh.astype(np.float64) - prox)[m]
    if m2.size == 0:
        return m.copy()
    order = np.argsort(-m2, kind="stable")
    s = m2[order]
    suffix = np.cumsum(s[::-1])[::-1] / np.arange(s.size, 0, -1)
    below = np.nonzero(suffix < tau)[0]
    k = below[0] if below.size else s.size - 1
    keep_sorted = np.arange(s.size) >= k
    keep_active = np.empty(s.size, bool)
    keep_active[order] = keep_sorted
    keep = np.zeros_like(m)
    keep[m] = keep_active
    return keep


def _m2po_batch(seed, per_token_adv):
    rng = np.random.default_rng(seed)
    beh = np.log(rng.uniform(0.05, 0.9, (B, T))).astype(np.float32)
    prox = (beh + rng.normal(0.0, 0.3, (B, T))).astype(np.float32)
    adv = rng.normal(size=(B, T) if per_token_adv else (B,)).astype(np.float32)
    return prox, beh, adv, _mask()


@pytest.mark.parametrize("per_token_adv", [False, True], ids=["seq-adv", "token-adv"])
def test_m2po_keep_and_gradient_equal_areal_at_the_proximal_policy(per_token_adv):
    """At π_θ = π_prox (AReaL's first minibatch of an update, where its log μ − log π_prox is our
    log r) the kept tokens are the same, and AReaL's decoupled loss (u = 1, w = r, no cap) is
    ours times n/n_kept: AReaL removes the dropped tokens from the count, we keep them."""
    prox, beh, adv, mask = _m2po_batch(5, per_token_adv)
    tau = 0.04
    keep = areal_m2po_keep(beh, prox, mask, tau)
    n, n_kept = mask.sum(), keep.sum()
    assert 0 < n_kept < n
    want = peer_value_and_grad(
        lambda x, fr: np.where(keep, areal_decoupled(x, fr, beh, adv, keep, 0.2, 0.2), 0.0),
        lambda x: _token_mean(x, keep),
        _clean(prox, mask),
    )
    got = ours(losses.m2po, prox, beh, adv, mask, tau=tau)
    _close((got[0] * n / n_kept, got[1] * n / n_kept), want)
    out = losses.m2po(prox, beh, adv, mask, tau=tau)
    chex.assert_trees_all_close(out.metrics["m2po/masked_frac"], 1 - n_kept / n, rtol=1e-6)
    a = _adv2d(adv, mask.shape)
    assert np.all(got[1][mask & ~keep] == 0.0) and np.all(got[1][keep & (a != 0)] != 0.0)


def test_m2po_stops_at_equality_where_areal_drops_one_more():
    """M2 = 4, 0.5625, 0.0625, 0, 0 and τ = 0.15625: after the 4 the mean is exactly τ. Ours
    (≤ τ) stops there; AReaL (< τ) drops the 0.5625 too. All values are exact in float32."""
    beh = np.full((1, 5), -3.0, np.float32)
    lr = np.array([[2.0, 0.75, 0.25, 0.0, 0.0]], np.float32)
    adv, mask, tau = np.ones(1, np.float32), np.ones((1, 5), bool), 0.15625
    out = losses.m2po(beh + lr, beh, adv, mask, tau=tau)
    np.testing.assert_allclose(out.metrics["m2po/masked_frac"], 1 / 5, rtol=1e-6)
    assert float(out.metrics["m2po/m2_after"]) == tau
    np.testing.assert_array_equal(
        areal_m2po_keep(beh, beh + lr, mask, tau), [[False, False, True, True, True]]
    )
    r = np.exp(lr.astype(np.float64))
    chex.assert_trees_all_close(out.loss, -(r[0, 1:]).sum() / 5, rtol=1e-6)
    # With τ a hair larger the two agree (the 4 alone is dropped).
    np.testing.assert_array_equal(
        areal_m2po_keep(beh, beh + lr, mask, tau * (1 + 1e-6)), [[False, True, True, True, True]]
    )


def test_m2po_edge_cases_that_differ_from_areal():
    """Every M2 above τ: ours drops every token (loss 0), AReaL keeps the smallest one. Ties:
    M2 = 1, 1, 0 × 5, τ = 0.2: dropping one 1 gives 1/6 ≤ τ, so AReaL drops one of the pair
    (which one follows its sort), ours drops both (ties go together)."""
    beh = np.full((1, 4), -2.0, np.float32)
    lr = np.array([[1.0, -1.5, 0.5, 2.0]], np.float32)  # M2 ≥ 0.25 > τ
    mask = np.ones((1, 4), bool)
    out = losses.m2po(beh + lr, beh, np.ones(1, np.float32), mask, tau=0.2)
    assert float(out.metrics["m2po/masked_frac"]) == 1.0 and float(out.loss) == 0.0
    np.testing.assert_array_equal(
        areal_m2po_keep(beh, beh + lr, mask, 0.2), [[False, False, True, False]]
    )
    beh = np.full((1, 7), -2.0, np.float32)
    lr = np.array([[1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    mask = np.ones((1, 7), bool)
    out = losses.m2po(beh + lr, beh, np.ones(1, np.float32), mask, tau=0.2)
    np.testing.assert_allclose(out.metrics["m2po/masked_frac"], 2 / 7, rtol=1e-6)
    assert (~areal_m2po_keep(beh, beh + lr, mask, 0.2)).sum() == 1


# ----------------------------------------------------------------------------------------------
# 3. BAPO: the authors' recipe (recipe/bapo/policy_loss.py) against ours.
# ----------------------------------------------------------------------------------------------


def recipe_pos_neg_ratio(r, adv, m, c_low, c_high, eps=1e-8):
    """P/N on clamped contributions: P = Σ_{A≥0} min(r, c_high)·A, N = Σ_{A<0} max(r, c_low)·|A|
    (every active token counts, clipped or not); N ≤ 0 gives ∞."""
    eff = np.where(adv >= 0, np.minimum(r, c_high), np.maximum(r, c_low)) * adv * m
    p, n = np.clip(eff, 0.0, None).sum(), (-np.clip(eff, None, 0.0)).sum()
    return math.inf if n <= 0 else p / (n + eps)


def recipe_search(r, adv, m, target, low, high, step_low, step_high):
    """The recipe's loop: raise c_low by its step (capped at its max) while P/N < target, then
    c_high. Returns (c_low, c_high, [(c_low, c_high, P/N) after each evaluation])."""
    (c_low, low_max), (c_high, high_max) = low, high
    trace = [(c_low, c_high, recipe_pos_neg_ratio(r, adv, m, c_low, c_high))]
    while trace[-1][2] < target and c_low < low_max and step_low > 0:
        c_low = min(c_low + step_low, low_max)
        trace.append((c_low, c_high, recipe_pos_neg_ratio(r, adv, m, c_low, c_high)))
    while trace[-1][2] < target and c_high < high_max and step_high > 0:
        c_high = min(c_high + step_high, high_max)
        trace.append((c_low, c_high, recipe_pos_neg_ratio(r, adv, m, c_low, c_high)))
    return c_low, c_high, trace


def recipe_loss(logp, beh, adv, m, c_low, c_high, c=3.0):
    """Per-token loss of ``compute_policy_loss_bapo``: PPO clip at the explicit bounds, r from the
    ±20-clamped log-ratio, the dual clip c (the actor's ``clip_ratio_c``, 3) on A < 0."""
    r = np.exp(np.clip(logp - beh, -CLAMP, CLAMP))
    return _clip_pg(r, _adv2d(adv, logp.shape), c_low, c_high, c)


def _bapo_metrics(lr, adv, mask, **kw):
    m = losses.bapo(lr, np.zeros_like(lr), adv, mask, **kw).metrics
    return float(m["bapo/c_low"]), float(m["bapo/c_high"]), float(m["bapo/rho"]), m


RANGES = {"low_range": (0.6, 0.9), "high_range": (1.2, 3.0), "step_high": 0.05, "step_low": 0.02}


def test_bapo_equals_the_recipe_when_both_keep_the_start_bounds():
    """A positive-heavy batch both searches accept at the start (ours ρ ≥ 0.5, the recipe's
    P/N ≥ 1 = 0.5/(1 − 0.5)), ratios inside and outside the bounds, a negative token past the dual
    clip: with ``dual_clip=3.0`` ours is the recipe's loss, value and gradient."""
    rng = np.random.default_rng(6)
    lr = rng.normal(0.0, 0.5, (B, T)).astype(np.float32)
    lr[0, :3] = [np.log(4.0), np.log(0.3), np.log(1.5)]
    adv = np.abs(rng.normal(size=(B, T))).astype(np.float32)
    adv[0, :2] = -0.2  # r = 4 > 3 and r = 0.3 < 0.6 with A < 0
    mask = _mask()
    r = np.exp(lr.astype(np.float64))
    cl, ch, trace = recipe_search(r, adv, mask, 1.0, (0.6, 0.9), (1.2, 3.0), 0.02, 0.05)
    assert (cl, ch) == (0.6, 1.2) and len(trace) == 1
    got_cl, got_ch, rho, m = _bapo_metrics(lr, adv, mask, rho_target=0.5, **RANGES)
    np.testing.assert_allclose([got_cl, got_ch], [0.6, 1.2], rtol=1e-6)
    assert float(m["bapo/steps"]) == 0 and rho >= 0.5
    got = ours(losses.bapo, lr, np.zeros_like(lr), adv, mask, rho_target=0.5, dual_clip=3.0)
    want = peer_value_and_grad(
        lambda x, fr: recipe_loss(x, np.zeros_like(x), adv, mask, 0.6, 1.2),
        lambda x: _token_mean(x, mask),
        _clean(lr, mask),
    )
    _close(got, want)
    without = ours(losses.bapo, lr, np.zeros_like(lr), adv, mask, rho_target=0.5)
    assert abs(without[0] - got[0]) > 1e-3  # the dual clip binds on this batch


def test_bapo_rho_is_the_recipe_ratio_mapped_when_ratios_sit_inside_the_start_bounds():
    """With every ratio inside [a⁻, a⁺] both count the same contributions, so the recipe's
    P/N = ρ/(1 − ρ) and its test P/N ≥ ρ₀/(1 − ρ₀) is ours ρ ≥ ρ₀: both keep or both leave the
    start bounds for any ρ₀ (``adv_ratio_target`` 1 is ρ₀ = 0.5, the example script's 0.5 is
    ρ₀ = 1/3)."""
    rng = np.random.default_rng(7)
    r = rng.uniform(0.61, 1.19, (B, T))
    lr = np.log(r).astype(np.float32)
    adv = rng.normal(size=(B,)).astype(np.float32)
    mask = _mask()
    r = np.exp(lr.astype(np.float64))
    _, _, rho, _ = _bapo_metrics(lr, adv, mask, rho_target=0.0, **RANGES)
    pn = recipe_pos_neg_ratio(r, _adv2d(adv, r.shape), mask, 0.6, 1.2)
    chex.assert_trees_all_close(pn, rho / (1 - rho), rtol=1e-5)
    for rho0 in (rho * 0.98, rho * 1.02):
        _, _, _, m = _bapo_metrics(lr, adv, mask, rho_target=rho0, **RANGES)
        trace = recipe_search(
            r, _adv2d(adv, r.shape), mask, rho0 / (1 - rho0), (0.6, 0.9), (1.2, 3.0), 0.02, 0.05
        )[2]
        assert (float(m["bapo/steps"]) > 0) == (len(trace) > 1) == (rho0 > rho)


def test_bapo_search_differs_from_the_recipe_as_stated():
    """The two searches on concrete batches (ρ₀ = 0.5, the recipe's target 1, the same ranges
    and steps):

    * negatives at r = 0.3 (below c_low): ours leaves them out of N (they carry no gradient) and
      one c_high step meets ρ₀; the recipe counts them at max(r, c_low), so each c_low step (it
      moves c_low first) raises N and lowers P/N: c_low runs to its maximum, then c_high to its.
    * positives above c_high: the recipe counts them at min(r, c_high) and keeps the start
      bounds; ours leaves them out of P and raises c_high until they carry gradient.
    Each loss is its own bounds' clipped objective, and the two differ."""
    mask = np.ones((1, 12), bool)
    r = np.array([[0.3] * 6 + [1.0, 1.0] + [1.0, 1.4, 1.24, 1.3]])
    adv = np.array([[-1.0] * 8 + [1.0] * 4], np.float32)
    lr = np.log(r).astype(np.float32)
    r = np.exp(lr.astype(np.float64))
    cl, ch, trace = recipe_search(r, adv, mask, 1.0, (0.6, 0.9), (1.2, 3.0), 0.02, 0.05)
    assert (cl, ch) == (0.9, 3.0) and trace[-1][2] < 1.0
    low_phase = [pn for c_low, c_high, pn in trace if c_high == 1.2]
    assert len(low_phase) == 16 and np.all(np.diff(low_phase) < 0)  # 15 c_low steps, each down
    got_cl, got_ch, rho, m = _bapo_metrics(lr, adv, mask, rho_target=0.5, **RANGES)
    np.testing.assert_allclose([got_cl, got_ch], [0.6, 1.25], rtol=1e-6)
    assert float(m["bapo/steps"]) == 1 and rho >= 0.5
    clean = lr.astype(np.float64)
    zero = np.zeros_like(clean)
    ours_loss = float(losses.bapo(lr, zero, adv, mask, rho_target=0.5, **RANGES).loss)
    want_ours = _token_mean(_clip_pg(r, adv, got_cl, got_ch), mask)
    chex.assert_trees_all_close(ours_loss, want_ours, rtol=1e-6)
    recipe = _token_mean(recipe_loss(clean, zero, adv, mask, cl, ch), mask)
    assert abs(recipe - ours_loss) > 1e-2
    # Positives above c_high: the recipe keeps (0.6, 1.2), ours raises c_high to 1.3.
    r = np.array([[1.0, 1.28, 1.6, 2.2, 0.7, 1.0, 0.5, 0.4]])
    adv = np.array([[1.0] * 4 + [-1.0] * 4], np.float32)
    lr = np.log(r).astype(np.float32)
    mask = np.ones_like(lr, bool)
    cl, ch, trace = recipe_search(
        np.exp(lr.astype(np.float64)), adv, mask, 1.0, (0.6, 0.9), (1.2, 3.0), 0.02, 0.05
    )
    assert (cl, ch) == (0.6, 1.2) and len(trace) == 1
    got_cl, got_ch, _, _ = _bapo_metrics(lr, adv, mask, rho_target=0.5, **RANGES)
    np.testing.assert_allclose([got_cl, got_ch], [0.6, 1.3], rtol=1e-6)


# ----------------------------------------------------------------------------------------------
# 4. verl's sequence-level rollout correction (rollout_corr_helper.py).
# ----------------------------------------------------------------------------------------------


def verl_seq_is_weight(old, rollout, m, threshold):
    """``rollout_is="sequence"``: min(exp(clip(Σ_t m·log k, ±20)), C)·m; the tokens' log k enter
    the sum unclamped, the sum is clamped."""
    s = np.where(m, old - rollout, 0.0).sum(-1, keepdims=True)
    return np.minimum(np.exp(np.clip(s, -CLAMP, CLAMP)) * m, threshold)


def _k1(old, rollout):
    return -np.clip(old - rollout, -CLAMP, CLAMP)  # verl's token_k1 statistic, −log k


def verl_rs_seq_sum_k1(old, rollout, m, lower, upper):
    """``rollout_rs="seq_sum_k1"``, threshold ``"lower_upper"``: keep log lower ≤ Σ_t −log k ≤
    log upper (tokens clamped at ±20 first)."""
    s = np.where(m, _k1(old, rollout), 0.0).sum(-1, keepdims=True)
    return m & (s >= math.log(lower)) & (s <= math.log(upper))


def verl_rs_seq_mean_k1(old, rollout, m, lower, upper):
    """``rollout_rs="seq_mean_k1"``: the same bounds on mean_t −log k."""
    n = m.sum(-1, keepdims=True)
    s = np.where(m, _k1(old, rollout), 0.0).sum(-1, keepdims=True) / np.maximum(n, 1)
    return m & (s >= math.log(lower)) & (s <= math.log(upper))


def verl_rs_early(old, rollout, m, upper, lower=None, level="sequence"):
    """The earlier ``rollout_rs="sequence"`` / ``"geometric"`` (@ 0b4e2a8): exp(clip(Σ or mean of
    the unclamped log k, ±20)) ∈ [lower, upper], lower 1/upper by default."""
    lower = 1.0 / upper if lower is None else lower
    s = np.where(m, old - rollout, 0.0).sum(-1, keepdims=True)
    if level == "geometric":
        s = s / np.maximum(m.sum(-1, keepdims=True), 1)
    w = np.exp(np.clip(s, -CLAMP, CLAMP))
    return m & (w >= lower) & (w <= upper)


def _rows(log_targets, mask, seed, spread=0.4, mean=False):
    """Per-token log k with each row's sum (or mean) at the target, on μ around e^−1."""
    rng = np.random.default_rng(seed)
    beh = np.log(rng.uniform(0.2, 0.6, mask.shape))
    lk = rng.normal(0.0, spread, mask.shape) * mask
    for b, target in enumerate(log_targets):
        n = mask[b].sum()
        if n:
            lk[b] = np.where(mask[b], lk[b] - lk[b].sum() / n + target / (1 if mean else n), 0.0)
    beh = beh.astype(np.float32)
    return (beh + lk).astype(np.float32), beh


def _seq_mask():
    m = np.ones((7, T), bool)
    m[1] = [1, 0, 1, 1, 0, 1]
    m[2] = False
    m[3, 1:] = False
    m[5, 3:] = False
    return m


def test_seq_mis_equals_verl_sequence_is_with_rejection():
    """``seq_mis(cap=2, low=0.5, high=2)`` is verl's ``decoupled_seq_is_rs`` preset
    (``rollout_is="sequence"``, threshold 2, ``rollout_rs="seq_sum_k1"``, ``"0.5_2.0"``) and the
    earlier ``rollout_rs="sequence"`` with threshold 2: the same weights, a hair inside and outside
    both bounds, an empty row and a one-token row included. A rejected response has weight 0 here;
    verl removes it from the response mask (pass ``mask & (w > 0)`` to match)."""
    mask = _seq_mask()
    log2 = math.log(2.0)
    targets = [log2 * (1 + 1e-3), log2 * (1 - 1e-3), 0.0, -log2 * (1 + 1e-3), -log2 * (1 - 1e-3)]
    targets += [math.log(1.3), math.log(0.7)]
    old, beh = _rows(targets, mask, 8)
    got = np.asarray(losses.seq_mis(old, beh, mask, cap=2.0, low=0.5, high=2.0), np.float64)
    o, b = old.astype(np.float64), beh.astype(np.float64)
    keep_k1 = verl_rs_seq_sum_k1(o, b, mask, 0.5, 2.0)
    np.testing.assert_array_equal(keep_k1, verl_rs_early(o, b, mask, 2.0))
    want = verl_seq_is_weight(o, b, mask, 2.0) * keep_k1
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(got > 0, keep_k1)
    assert keep_k1[[1, 4, 5, 6]].any(-1).all() and not keep_k1[[0, 2, 3]].any()


def test_seq_mis_asymmetric_band_is_verls_reciprocal_k1_threshold():
    """seq_sum_k1 bounds −log Π k, so ``seq_mis(low=a, high=b)`` is ``"{1/b}_{1/a}"`` (the earlier
    ``rollout_rs="sequence"`` bounded Π k itself: lower a, upper b). ``"0.25_3"`` read as our
    band would differ on Π k = 3.5 (verl keeps, ours rejects) and Π k = 0.3 (the other way)."""
    mask = _seq_mask()
    targets = [math.log(v) for v in (3.5, 0.3, 1.0, 2.9, 0.26, 3.9, 0.34)]
    old, beh = _rows(targets, mask, 9)
    got = np.asarray(losses.seq_mis(old, beh, mask, cap=10.0, low=0.25, high=3.0)) > 0
    o, b = old.astype(np.float64), beh.astype(np.float64)
    np.testing.assert_array_equal(got, verl_rs_seq_sum_k1(o, b, mask, 1 / 3.0, 1 / 0.25))
    np.testing.assert_array_equal(got, verl_rs_early(o, b, mask, 3.0, 0.25))
    literal = verl_rs_seq_sum_k1(o, b, mask, 0.25, 3.0)
    # Π k = 3.5: ours rejects, the literal reading keeps; Π k = 0.3: the other way round.
    assert not got[0].any() and literal[0].all() and got[1].any() and not literal[1].any()


def test_geo_rs_is_verl_seq_mean_k1_with_reciprocal_bounds_not_its_preset():
    """``geo_rs(0.999, 1.001)`` is the earlier ``rollout_rs="geometric"`` (upper 1.001, lower
    0.999) and ``seq_mean_k1`` with ``"{1/1.001}_{1/0.999}"``; verl's ``decoupled_geo_rs`` preset
    ``"0.999_1.001"`` keeps the geometric-mean band [1/1.001, 1/0.999], which differs from ours
    by about 1e-6 at each end: a mean log k of −0.0010001 is in ours only, 0.0009998 in verl's
    only."""
    mask = _seq_mask()
    beh = np.zeros(mask.shape, np.float32)  # log k = old exactly, at 1e-11
    means = [-0.0010001, 0.0009998, 0.0, -0.0011, 0.0004, 0.0011, -0.000999]
    old = np.where(mask, np.array(means, np.float32)[:, None], 0.0).astype(np.float32)
    got = np.asarray(losses.geo_rs(old, beh, mask, low=0.999, high=1.001)) > 0
    o, b = old.astype(np.float64), beh.astype(np.float64)
    np.testing.assert_array_equal(got, verl_rs_early(o, b, mask, 1.001, 0.999, level="geometric"))
    np.testing.assert_array_equal(got, verl_rs_seq_mean_k1(o, b, mask, 1 / 1.001, 1 / 0.999))
    preset = verl_rs_seq_mean_k1(o, b, mask, 0.999, 1.001)
    differ = (got != preset).any(-1)
    np.testing.assert_array_equal(differ, [True, True, False, False, False, False, False])
    assert got[0].all() and not preset[0].any() and preset[1].any() and not got[1].any()


def test_seq_mis_weight_differs_from_verl_beyond_the_safety_bound():
    """verl clamps the *sum* of unclamped log k at ±20, we clamp each token at ±20 and not the sum:
    Σ log k = −25 (kept by a wide band) weighs e^−25 here, e^−20 in verl; tokens at +30 and −29.5
    weigh 1 here (20 − 20), e^0.5 in verl. Inside those bounds the weights are the same."""
    mask = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]], bool)
    beh = np.full(mask.shape, -1.0, np.float32)
    old = beh + np.array([[-5.0] * 5 + [0.0], [30.0, -29.5] + [0.0] * 4], np.float32)
    got = np.asarray(losses.seq_mis(old, beh, mask, cap=2.0, low=1e-12, high=1e12), np.float64)
    want = verl_seq_is_weight(old.astype(np.float64), beh, mask, 2.0)
    chex.assert_trees_all_close(got[0, :5], np.full(5, math.exp(-25.0)), rtol=1e-5)
    chex.assert_trees_all_close(want[0, :5], np.full(5, math.exp(-20.0)), rtol=1e-6)
    chex.assert_trees_all_close(got[1, :2], np.ones(2), rtol=1e-6)
    chex.assert_trees_all_close(want[1, :2], np.full(2, math.exp(0.5)), rtol=1e-6)
    # verl's rejection statistic clamps each token, as we do: both keep row 1 in [0.5, 2].
    keep = np.asarray(losses.seq_mis(old, beh, mask, cap=2.0, low=0.5, high=2.0)) > 0
    np.testing.assert_array_equal(keep[1], verl_rs_seq_sum_k1(old, beh, mask, 0.5, 2.0)[1])
    assert keep[1, :2].all()


# ----------------------------------------------------------------------------------------------
# 5. SkyRL's CISPO (compute_policy_loss_cispo).
# ----------------------------------------------------------------------------------------------


def skyrl_cispo(logp, frozen, old, adv, m, eps_low, eps_high):
    """−A·sg(clamp(exp(clip(log π − log π_old, ±20)), 1 − ε_low, 1 + ε_high))·log π."""
    w = np.clip(np.exp(np.clip(frozen - old, -CLAMP, CLAMP)), 1 - eps_low, 1 + eps_high)
    return -_adv2d(adv, logp.shape) * w * logp


@pytest.mark.parametrize("eps", [(1.0, 4.0), (0.2, 0.28)], ids=["scalerl", "ppo-like"])
@pytest.mark.parametrize("per_token_adv", [False, True], ids=["seq-adv", "token-adv"])
def test_cispo_gradient_equals_skyrl(eps, per_token_adv):
    """SkyRL's loss, reduced ``token_mean`` (Σ/max(n, 1)), has our gradient; its value is
    −A·ŵ·log π, ours −A·ŵ (the same gradient in log π, the value the weighted advantage)."""
    rng = np.random.default_rng(10)
    beh = np.log(rng.uniform(0.05, 0.9, (B, T))).astype(np.float32)
    logp = np.minimum(beh + rng.normal(0.0, 1.0, (B, T)), -1e-3).astype(np.float32)
    beh[0, 0], logp[0, 0] = np.log(0.05), np.log(0.9)  # r = 18, above both upper bounds
    adv = rng.normal(size=(B, T) if per_token_adv else (B,)).astype(np.float32)
    mask = _mask()
    lo, hi = eps
    got = ours(losses.cispo, logp, beh, adv, mask, cispo_eps_low=lo, cispo_eps_high=hi)
    clean = _clean(logp, mask)
    _, want_g = peer_value_and_grad(
        lambda x, fr: skyrl_cispo(x, fr, beh, adv, mask, lo, hi),
        lambda x: _token_mean(x, mask),
        clean,
    )
    chex.assert_trees_all_close(got[1], want_g, rtol=1e-4, atol=1e-6)
    w = np.clip(np.exp(clean - beh), 1 - lo, 1 + hi)
    chex.assert_trees_all_close(
        got[0], _token_mean(-_adv2d(adv, clean.shape) * w, mask), rtol=1e-5, atol=1e-7
    )
    r = np.exp(clean - beh)[mask]
    assert ((r > 1 + hi) | (r < 1 - lo)).any()  # the clamp binds
