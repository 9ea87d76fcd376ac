"""The staleness study's statistics: the tail endpoint, the sustained-collapse rule, the exact
Wilcoxon signed-rank and McNemar tests, and the interaction (difference-in-differences)."""

import math

import pytest

from sat_jax.study import stats


def _evals(pairs):
    return [{"step": s, stats.PASS: v} for s, v in pairs]


def test_tail_mean_takes_the_last_share_of_evaluations_after_step_0():
    rec = _evals([(0, 0.9), (10, 0.1), (20, 0.2), (30, 0.3), (40, 0.4), (50, 0.5)])
    assert stats.tail_mean(rec, 0.2) == pytest.approx(0.5)  # ceil(0.2 * 5) = 1 evaluation
    assert stats.tail_mean(rec, 0.4) == pytest.approx(0.45)
    assert stats.tail_mean(rec, 1.0) == pytest.approx(0.3)  # step 0 never counts
    assert math.isnan(stats.tail_mean(_evals([(0, 0.5)])))
    with pytest.raises(ValueError, match="share must be in"):
        stats.tail_mean(rec, 0.0)


def test_sustained_collapse_needs_half_the_gain_lost_for_the_whole_window():
    rule = stats.SustainedCollapse(loss_share=0.5, hold=50, min_gain=0.05)
    # base 0.2, peak 0.6 -> floor 0.4; at or below it from step 100 to the end (step 160).
    rec = _evals([(0, 0.2), (50, 0.6), (100, 0.4), (130, 0.3), (160, 0.35)])
    assert rule.step(rec) == 100
    # Back above the floor inside the window: not sustained there; the later drop at 180 has
    # no evaluation 50 steps on, so it cannot be confirmed.
    rec = _evals([(0, 0.2), (50, 0.6), (100, 0.3), (130, 0.5), (180, 0.3)])
    assert rule.step(rec) is None
    rec = _evals([(0, 0.2), (50, 0.6), (100, 0.3), (130, 0.5), (180, 0.3), (230, 0.2)])
    assert rule.step(rec) == 180
    # A run that never gained min_gain cannot collapse, however it ends.
    rec = _evals([(0, 0.2), (50, 0.24), (100, 0.0), (200, 0.0)])
    assert rule.step(rec) is None
    # The floor follows the running best: the peak at step 100 raises it to 0.45.
    rec = _evals([(0, 0.1), (50, 0.5), (100, 0.8), (150, 0.45), (200, 0.45)])
    assert rule.step(rec) == 150
    assert rule.step(_evals([(50, 0.5), (100, 0.0), (200, 0.0)])) is None  # no base evaluation
    assert "50%" in rule.describe() and "50 steps" in rule.describe()
    with pytest.raises(ValueError, match="loss_share"):
        stats.SustainedCollapse(loss_share=0.0)


@pytest.mark.parametrize(
    "d,n,w_plus,p",
    [
        ([1, 2, 3, 4, 5], 5, 15.0, 2 / 32),  # every sign positive: 2 of 2^5 patterns as extreme
        ([0.3, -0.1, 0.2, 0.5, -0.4, 0.6, 0.7, 0.1], 8, 29.5, 30 / 256),  # tied |0.1|: half ranks
        ([1, 1, -1, 2, 2, -2, 3, 0.0], 7, 21.0, 42 / 128),  # the zero dropped, ties
        ([0.0, 0.0], 0, 0.0, 1.0),
    ],
)
def test_wilcoxon_exact_against_enumeration(d, n, w_plus, p):
    # The p-values agree with scipy.stats.wilcoxon (zero_method="wilcox", exact), which enumerates
    # the same null distribution.
    out = stats.wilcoxon_signed_rank(d)
    assert (out["n"], out["w_plus"]) == (n, w_plus)
    assert out["p"] == pytest.approx(p, abs=1e-12)


def test_wilcoxon_normal_approximation_above_20():
    d = [float(i) for i in range(1, 26)]  # all positive: z = (325 - 162.5) / sqrt(1381.25)
    out = stats.wilcoxon_signed_rank(d)
    z = 162.5 / math.sqrt(25 * 26 * 51 / 24)
    assert out["p"] == pytest.approx(math.erfc(z / math.sqrt(2)))


def test_mcnemar_exact():
    x = {s: s < 1 for s in range(8)}  # collapsed under x on seed 0 only
    y = {s: 1 <= s < 7 for s in range(8)}  # collapsed under y on seeds 1..6
    out = stats.mcnemar_exact(x, y)
    assert (out["n"], out["b"], out["c"]) == (8, 1, 6)
    assert out["p"] == pytest.approx(2 * (1 + 7) / 2**7)  # 2 * P(B <= 1), B ~ Bin(7, 1/2)
    assert stats.mcnemar_exact({0: True}, {0: True})["p"] == 1.0


def test_interaction_is_the_paired_difference_in_differences():
    sat_hi = {0: 0.5, 1: 0.6, 2: 0.4}
    base_hi = {0: 0.3, 1: 0.5, 2: 0.1}
    sat_lo = {0: 0.5, 1: 0.5, 2: 0.5, 3: 0.9}  # seed 3 lacks the other runs: left out
    base_lo = {0: 0.4, 1: 0.5, 2: 0.4, 3: 0.1}
    out = stats.interaction(sat_hi, base_hi, sat_lo, base_lo)
    # d = (0.2 - 0.1, 0.1 - 0.0, 0.3 - 0.1) = (0.1, 0.1, 0.2)
    assert out["seeds"] == [0, 1, 2] and out["wins"] == 3
    assert out["mean"] == pytest.approx(0.4 / 3)
    sd = math.sqrt(((0.1 - 0.4 / 3) ** 2 * 2 + (0.2 - 0.4 / 3) ** 2) / 2)
    assert out["sd"] == pytest.approx(sd)
    half = stats.t_quantile(0.975, 2) * sd / math.sqrt(3)
    assert (out["lo"], out["hi"]) == pytest.approx((0.4 / 3 - half, 0.4 / 3 + half))
    assert out["wilcoxon"]["n"] == 3 and out["wilcoxon"]["p"] == pytest.approx(2 / 8)
