"""Statistics of a study a reader can trust (pure numpy): per-run summaries from ``metrics.jsonl``
records, the collapse rules, mean ± sd over seeds, paired differences with Student-t intervals
and the staleness study's tests; the rows they give are written out by ``sat_jax.study.tables``.

Paired differences. Runs of two methods on the same seed and lag start from the same warm-up and
see the same prompts, so the seed-to-seed spread they share cancels in the per-seed difference
``d_s = x_s(method) − x_s(baseline)``. With ``n`` paired seeds, mean ``d̄`` and sample standard
deviation ``s_d`` (ddof 1), the 95% interval is

    d̄ ± t_{0.975, n−1} · s_d / √n

(undefined for n = 1). ``t_{p, ν}`` is Student's t quantile, computed here from the t CDF
(regularized incomplete beta, Lentz's continued fraction) by bisection: t_{0.975,4} = 2.776.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

PASS = "eval/pass@1"
#: Trailing-window diagnostics: column name -> metric key in metrics.jsonl.
TRAILING = {
    "mismatch": "loss/mismatch",  # d̄_π
    "q": "loss/sat/q",  # SAT's quantile of |log r|
    "binding": "loss/sat/binding_rate",
    "clip": "loss/clip_frac",  # share of active tokens whose ratio is clipped (any objective)
    "lag": "lag/mean",  # realized lag
    "reward": "train/reward_mean",
    "m2po_masked": "loss/m2po/masked_frac",  # share of active tokens M2PO masks
}

#: BAPO's per-step count of bound moves (0: both bounds stayed at their start); summarised as
#: ``bapo_moved``, the share of training steps on which they moved.
BAPO_STEPS = "loss/bapo/steps"

#: The trainer's staleness buckets of d̄_π (``mismatch/<name>`` and ``mismatch/<name>_share``),
#: summarised as ``<name>_t25`` over the trailing steps that hold tokens of the bucket.
LAG_BUCKETS = ("lag_le2", "lag_ge8")


# ---------------------------------------------------------------------------------------------
# Student's t quantile.


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * _betainc(0.5 * df, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile ``t_{p, df}`` (``p`` in (0, 1), ``df`` > 0), by bisection on
    :func:`t_cdf` to 1e-12. E.g. ``t_quantile(0.975, 4) = 2.7764``."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if not df > 0:
        raise ValueError(f"df must be > 0, got {df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return 0.5 * (lo + hi)


# ---------------------------------------------------------------------------------------------
# Per-run summary and the collapse rule.


@dataclasses.dataclass(frozen=True)
class CollapseRule:
    """A run *collapsed* when its final held-out pass@1 is below the base policy's (the step-0
    evaluation, after the warm-up) by more than ``margin``, or when it ends below ``(1 − fall)``
    of its best evaluation after step 0 (a fall of more than half, by default, not recovered by
    the end)."""

    margin: float = 0.0
    fall: float = 0.5

    def __call__(self, base: float, best: float, final: float) -> bool:
        if not math.isfinite(final):
            return False
        below_base = math.isfinite(base) and final < base - self.margin
        fell = math.isfinite(best) and best > 0 and final < (1.0 - self.fall) * best
        return bool(below_base or fell)

    def describe(self) -> str:
        base = (
            "below the base policy's (its step-0 evaluation, after the warm-up)"
            if self.margin == 0
            else f"more than {self.margin:g} below the base policy's "
            "(its step-0 evaluation, after the warm-up)"
        )
        return (
            f"a run **collapsed** if its final held-out pass@1 is {base}, or if it is "
            f"below {1 - self.fall:g} × its best held-out pass@1 after step 0 (a fall of "
            f"more than {self.fall:.0%} from its best that has not recovered by the end). "
            "Collapsed runs stay in every mean; the tables count them."
        )


def _by_step(records: Iterable[Mapping[str, Any]], key: str) -> dict[int, float]:
    out = {}
    for r in records:
        if key in r and "step" in r:
            out[int(r["step"])] = float(r[key])  # a later duplicate (a resumed step) wins
    return out


def train_steps(records: Iterable[Mapping[str, Any]]) -> list[int]:
    """A run's training steps, in order: the steps that log ``loss/mismatch``, which every
    objective logs once per update."""
    return sorted(_by_step(records, "loss/mismatch"))


def trailing_steps(steps: Sequence[int], trailing: float = 0.25) -> set[int]:
    """The last ``trailing`` share (at least one) of ``steps`` (:func:`train_steps`)."""
    if not 0 < trailing <= 1:
        raise ValueError(f"trailing must be in (0, 1], got {trailing}")
    return set(steps[-max(1, math.ceil(trailing * len(steps))) :]) if steps else set()


def trailing_mean(records: Iterable[Mapping[str, Any]], key: str, window: set[int]) -> float:
    """The mean of ``key`` over the steps of ``window`` (:func:`trailing_steps`) that log it
    finite; NaN where none does."""
    values = [v for s, v in _by_step(records, key).items() if s in window and math.isfinite(v)]
    return float(np.mean(values)) if values else math.nan


#: The rule results.md states and applies.
DEFAULT_RULE = CollapseRule()


def summarize_run(
    records: Sequence[Mapping[str, Any]],
    *,
    trailing: float = 0.25,
    rule: CollapseRule = DEFAULT_RULE,
) -> dict[str, Any]:
    """One run's numbers from its ``metrics.jsonl`` records.

    * ``base``: pass@1 at step 0 (the warm-up's policy); ``best`` / ``best_step``: the highest
      evaluation after step 0; ``final`` / ``final_step``: the last evaluation.
    * ``<name>_t25`` for each of :data:`TRAILING`: the mean over the last ``trailing`` share of
      training steps (at least one step) of that metric; NaN where the run does not log it
      (``q`` and ``binding`` exist only for SAT objectives, ``m2po_masked`` only for M2PO's);
      ``lag_le2_t25`` and ``lag_ge8_t25`` (:data:`LAG_BUCKETS`) average only the steps whose
      batch held tokens of that staleness.
    * ``bapo_moved``: the share of all training steps on which BAPO's bounds left their start
      (:data:`BAPO_STEPS` > 0); NaN for other objectives.
    * ``steps``: training steps logged; ``collapsed``: ``rule(base, best, final)``.
    * ``tail20``: :func:`tail_mean` (the last 20% of evaluations); ``collapse_step``: the step
      :data:`SUSTAINED_RULE` finds the run collapsed at, or None.
    * ``warmup_loss``: the supervised warm-up's final loss (``sft/final_loss``; NaN where the
      warm-up was read from the cache or there is none); ``warmup_digest``: the warm-up's
      parameter digest (``sft/digest``, logged whether trained or cached; NaN where not logged).
      Runs of one seed started from the same base policy when their digests are equal.
    """
    steps = train_steps(records)
    window = trailing_steps(steps, trailing)
    evals = _by_step(records, PASS)
    base = evals.get(0, math.nan)
    later = {s: v for s, v in evals.items() if s > 0}
    if later:
        best_step = max(later, key=lambda s: (later[s], -s))
        best = later[best_step]
        final_step = max(later)
        final = later[final_step]
    else:
        best = final = math.nan
        best_step = final_step = -1
    out: dict[str, Any] = {
        "base": base,
        "best": best,
        "best_step": best_step,
        "final": final,
        "final_step": final_step,
        "steps": len(steps),
    }
    for name, key in TRAILING.items():
        out[f"{name}_t25"] = trailing_mean(records, key, window)
    # d̄_π by staleness bucket: over the trailing steps whose batch held tokens of the bucket.
    for name in LAG_BUCKETS:
        share = _by_step(records, f"mismatch/{name}_share")
        values = [
            v
            for s, v in _by_step(records, f"mismatch/{name}").items()
            if s in window and share.get(s, 0.0) > 0 and math.isfinite(v)
        ]
        out[f"{name}_t25"] = float(np.mean(values)) if values else math.nan
    moves = [v for v in _by_step(records, BAPO_STEPS).values() if math.isfinite(v)]
    out["bapo_moved"] = float(np.mean([v > 0 for v in moves])) if moves else math.nan
    out["collapsed"] = rule(base, best, final)
    out["tail20"] = tail_mean(records, 0.2)
    out["collapse_step"] = SUSTAINED_RULE.step(records)
    for name, key in (("warmup_loss", "sft/final_loss"), ("warmup_digest", "sft/digest")):
        out[name] = float(next((r[key] for r in records if key in r), math.nan))
    return out


def _finite(v) -> float | None:
    if v in (None, ""):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def unpaired_seeds(rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """Seeds whose runs did not all start from the same warm-up: more than one distinct
    ``warmup_digest`` among them, or, among runs without a digest, more than one distinct
    ``warmup_loss`` (runs with neither are not counted: :func:`unverified_seeds`)."""
    seen: dict[tuple[int, str], set[float]] = {}
    for r in rows:
        for name in ("warmup_digest", "warmup_loss"):
            v = _finite(r.get(name))
            if v is not None:
                seen.setdefault((int(r["seed"]), name), set()).add(v)
                break
    return sorted({seed for (seed, _), vs in seen.items() if len(vs) > 1})


def unverified_seeds(rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """Seeds with a run that logged no warm-up digest (runs before ``sft/digest`` existed), so
    that their pairing on one base policy cannot be checked."""
    return sorted({int(r["seed"]) for r in rows if _finite(r.get("warmup_digest")) is None})


# ---------------------------------------------------------------------------------------------
# Aggregates.


def mean_sd(values: Iterable[float]) -> tuple[float, float, int]:
    """(mean, sample sd with ddof 1, n) over the finite values; NaN where undefined."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], np.float64)
    if v.size == 0:
        return math.nan, math.nan, 0
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else math.nan, int(v.size)


def paired(
    x: Mapping[int, float], y: Mapping[int, float], *, level: float = 0.95
) -> dict[str, Any]:
    """Paired difference ``x − y`` over the seeds both have (finite values).

    Returns ``n``, ``mean``, ``sd`` (ddof 1), ``lo`` / ``hi`` (the ``level`` Student-t interval,
    NaN for n < 2), ``wins`` (seeds with x > y) and ``seeds``.
    """
    seeds = sorted(s for s in set(x) & set(y) if math.isfinite(x[s]) and math.isfinite(y[s]))
    d = np.asarray([x[s] - y[s] for s in seeds], np.float64)
    n = int(d.size)
    out = {
        "n": n,
        "seeds": seeds,
        "wins": int((d > 0).sum()),
        "mean": math.nan,
        "sd": math.nan,
        "lo": math.nan,
        "hi": math.nan,
    }
    if n == 0:
        return out
    out["mean"] = float(d.mean())
    if n > 1:
        sd = float(d.std(ddof=1))
        half = t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
        out.update(sd=sd, lo=out["mean"] - half, hi=out["mean"] + half)
    return out


def _cell(row: Mapping[str, Any]) -> tuple:
    return (row["method"], row["lag_mode"], int(row["lag"]), float(row["lr"]))


def cells(rows: Sequence[Mapping[str, Any]]) -> dict[tuple, list[Mapping[str, Any]]]:
    """Rows grouped by (method, lag_mode, lag, lr), in first-seen order."""
    out: dict[tuple, list] = {}
    for r in rows:
        out.setdefault(_cell(r), []).append(r)
    return out


def cell_summary(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per cell: n seeds, mean ± sd of best and final pass@1, collapsed count, trailing means."""
    out = []
    for (method, mode, lag, lr), group in cells(rows).items():
        entry = {
            "method": method,
            "lag_mode": mode,
            "lag": lag,
            "lr": lr,
            "n": len(group),
            "collapsed": sum(bool(r.get("collapsed")) for r in group),
        }
        for key in ("base", "best", "final", "bapo_moved", *(f"{k}_t25" for k in TRAILING)):
            entry[key], entry[key + "_sd"], _ = mean_sd(r.get(key, math.nan) for r in group)
        out.append(entry)
    return out


def by_seed(
    rows: Iterable[Mapping[str, Any]],
    method: str,
    lag: int,
    lr: float,
    key: str,
    lag_mode: str | None = None,
) -> dict[int, float]:
    return {
        int(r["seed"]): float(r[key])
        for r in rows
        if r["method"] == method
        and int(r["lag"]) == lag
        and float(r["lr"]) == lr
        and (lag_mode is None or r["lag_mode"] == lag_mode)
    }


def paired_rows(
    rows: Sequence[Mapping[str, Any]], baseline: str, keys: Sequence[str] = ("best", "final")
) -> list[dict[str, Any]]:
    """Each method against ``baseline`` on the same seed, lag and learning rate."""
    out = []
    for method, mode, lag, lr in cells(rows):
        if method == baseline:
            continue
        entry = {"method": method, "lag_mode": mode, "lag": lag, "lr": lr}
        for key in keys:
            entry[key] = paired(
                by_seed(rows, method, lag, lr, key, mode),
                by_seed(rows, baseline, lag, lr, key, mode),
            )
        out.append(entry)
    return out


def lag_rows(
    rows: Sequence[Mapping[str, Any]], keys: Sequence[str] = ("best", "final")
) -> list[dict[str, Any]]:
    """Each method at each lag against itself at the smallest lag of the grid, on the same seed
    and learning rate: does staleness hurt it?"""
    out = []
    lowest = min((int(r["lag"]) for r in rows), default=None)
    for method, mode, lag, lr in cells(rows):
        if lag == lowest:
            continue
        entry = {"method": method, "lag_mode": mode, "lag": lag, "lr": lr, "from_lag": lowest}
        for key in keys:
            entry[key] = paired(
                by_seed(rows, method, lag, lr, key, mode),
                by_seed(rows, method, lowest, lr, key, mode),
            )
        out.append(entry)
    return out


def envelope_map(
    rows: Sequence[Mapping[str, Any]],
    *,
    baseline: str = "grpo",
    sat: str = "sat_grpo",
    eps: float = 0.2,
) -> list[dict[str, Any]]:
    """Per (lr, lag) cell: ``baseline``'s paired change of final pass@1 from lag 1 (same seed and
    lr; NaN without lag-1 runs), its trailing d̄_π, ``sat``'s trailing q and binding rate, whether
    q < log(1 + eps) (SAT's trust region can bind), and ``sat``'s paired difference to
    ``baseline`` in final pass@1."""
    lags = sorted({int(r["lag"]) for r in rows})
    lrs = sorted({float(r["lr"]) for r in rows})
    out = []
    for lr in lrs:
        for lag in lags:
            base_final = by_seed(rows, baseline, lag, lr, "final")
            if not base_final and not by_seed(rows, sat, lag, lr, "final"):
                continue
            q = mean_sd(by_seed(rows, sat, lag, lr, "q_t25").values())[0]
            out.append(
                {
                    "lr": lr,
                    "lag": lag,
                    "base_drop": paired(base_final, by_seed(rows, baseline, 1, lr, "final"))
                    if lag != 1
                    else None,
                    "base_final": mean_sd(base_final.values())[0],
                    "mismatch": mean_sd(by_seed(rows, baseline, lag, lr, "mismatch_t25").values())[
                        0
                    ],
                    "q": q,
                    "sat_can_act": bool(math.isfinite(q) and q < math.log1p(eps)),
                    "binding": mean_sd(by_seed(rows, sat, lag, lr, "binding_t25").values())[0],
                    "sat_diff": paired(by_seed(rows, sat, lag, lr, "final"), base_final),
                }
            )
    return out


# ---------------------------------------------------------------------------------------------
# The pre-registered staleness study (docs/results/stale/PROTOCOL.md): its endpoint, its collapse
# rule and its tests.


def tail_mean(records: Sequence[Mapping[str, Any]], share: float = 0.2, key: str = PASS) -> float:
    """Mean of the last ``share`` of a run's evaluations after step 0 (at least one): the study's
    primary endpoint, less noisy than the last evaluation alone. NaN without evaluations."""
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    evals = [v for s, v in sorted(_by_step(records, key).items()) if s > 0 and math.isfinite(v)]
    if not evals:
        return math.nan
    return float(np.mean(evals[-max(1, math.ceil(share * len(evals))) :]))


@dataclasses.dataclass(frozen=True)
class SustainedCollapse:
    """A run *collapses* at evaluation step t when it has lost at least ``loss_share`` of its gain
    over the base policy and stays there for at least ``hold`` steps.

    With base b (the step-0 evaluation) and running best p_t (the highest evaluation in (0, t]),
    the gain at t is g_t = p_t − b and the floor is f_t = b + (1 − loss_share)·g_t. The run
    collapses at the first t with g_t ≥ ``min_gain``, v_t ≤ f_t, an evaluation at or after
    t + ``hold``, and every evaluation in [t, t + hold] at or below f_t. ``min_gain`` keeps
    evaluation noise around a run that never improved from counting as a collapse.
    """

    loss_share: float = 0.5
    hold: int = 50
    min_gain: float = 0.05

    def __post_init__(self):
        if not 0 < self.loss_share <= 1:
            raise ValueError(f"loss_share must be in (0, 1], got {self.loss_share}")
        if self.hold < 0 or self.min_gain < 0:
            raise ValueError(f"hold and min_gain must be >= 0, got {self.hold}, {self.min_gain}")

    def step(self, records: Sequence[Mapping[str, Any]], key: str = PASS) -> int | None:
        """The collapse step, or None if the run did not collapse (or has no base evaluation)."""
        evals = sorted((s, v) for s, v in _by_step(records, key).items() if math.isfinite(v))
        base = dict(evals).get(0)
        if base is None:
            return None
        later = [(s, v) for s, v in evals if s > 0]
        peak = -math.inf
        for i, (t, v) in enumerate(later):
            peak = max(peak, v)
            gain = peak - base
            floor = base + (1 - self.loss_share) * gain
            if gain < self.min_gain or v > floor:
                continue
            window = [(s, w) for s, w in later[i:] if s <= t + self.hold]
            if later[-1][0] >= t + self.hold and all(w <= floor for _, w in window):
                return t
        return None

    def describe(self) -> str:
        return (
            f"a run **collapses** at the first evaluation where it has lost at least "
            f"{self.loss_share:.0%} of its gain over the base policy (gain = best held-out pass@1 "
            f"so far − the step-0 evaluation, at least {self.min_gain:g}) and stays at or below "
            f"that level for at least {self.hold} steps (every evaluation in the window, the "
            "run reaching its end)"
        )


def wilcoxon_signed_rank(d: Sequence[float]) -> dict[str, Any]:
    """Two-sided Wilcoxon signed-rank test of ``d`` (paired differences) against 0.

    Zeros are dropped (Wilcoxon's convention); tied |d| take their average rank. W+ is the sum
    of the ranks of the positive differences. For n ≤ 20 non-zero differences the p-value is
    exact, from the null distribution of W+ over all 2^n sign assignments of the observed ranks
    (ties included); above, the normal approximation with the tie-corrected variance.

    Returns ``n`` (non-zero differences), ``w_plus`` and ``p`` (1.0 for n = 0).
    """
    x = np.asarray([v for v in d if math.isfinite(v)], np.float64)
    x = x[x != 0]
    n = int(x.size)
    if n == 0:
        return {"n": 0, "w_plus": 0.0, "p": 1.0}
    a = np.abs(x)
    order = np.argsort(a, kind="stable")
    ranks = np.empty(n, np.float64)
    i = 0
    while i < n:  # average ranks over runs of ties
        j = i
        while j + 1 < n and a[order[j + 1]] == a[order[i]]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    w_plus = float(ranks[x > 0].sum())
    mean = float(ranks.sum()) / 2
    if n <= 20:
        twice = np.rint(2 * ranks).astype(np.int64)  # integer support (half ranks exist)
        dist = np.zeros(int(twice.sum()) + 1, np.float64)
        dist[0] = 1.0
        for r in twice:
            shifted = np.zeros_like(dist)
            shifted[r:] = dist[: dist.size - r]
            dist = 0.5 * (dist + shifted)
        support = np.arange(dist.size) / 2
        p = float(dist[np.abs(support - mean) >= abs(w_plus - mean) - 1e-9].sum())
    else:
        var = float((ranks**2).sum()) / 4
        z = abs(w_plus - mean) / math.sqrt(var)
        p = math.erfc(z / math.sqrt(2))
    return {"n": n, "w_plus": w_plus, "p": min(1.0, p)}


#: The staleness study's collapse rule (docs/results/stale/PROTOCOL.md).
SUSTAINED_RULE = SustainedCollapse()


def mcnemar_exact(x: Mapping[int, bool], y: Mapping[int, bool]) -> dict[str, Any]:
    """Exact two-sided McNemar test on paired booleans (e.g. collapsed?) over the common seeds:
    ``b`` seeds with x and not y, ``c`` with y and not x; p = min(1, 2·P(B ≤ min(b, c))) for
    B ~ Binomial(b + c, ½) (1.0 when b + c = 0)."""
    seeds = sorted(set(x) & set(y))
    b = sum(bool(x[s]) and not bool(y[s]) for s in seeds)
    c = sum(bool(y[s]) and not bool(x[s]) for s in seeds)
    m = b + c
    tail = sum(math.comb(m, k) for k in range(min(b, c) + 1)) / 2**m if m else 1.0
    return {"n": len(seeds), "b": b, "c": c, "p": min(1.0, 2 * tail) if m else 1.0}


def interaction(
    method_hi: Mapping[int, float],
    base_hi: Mapping[int, float],
    method_lo: Mapping[int, float],
    base_lo: Mapping[int, float],
    *,
    level: float = 0.95,
) -> dict[str, Any]:
    """The study's primary test: per seed s, the difference-in-differences

        d_s = (method − base at the high lag) − (method − base at the low lag),

    over the seeds all four runs have: :func:`paired`'s mean, sd, Student-t interval and count of
    d_s > 0, with ``wilcoxon`` (:func:`wilcoxon_signed_rank` of the d_s)."""
    seeds = set(method_hi) & set(base_hi) & set(method_lo) & set(base_lo)
    hi = {s: method_hi[s] - base_hi[s] for s in seeds}
    lo = {s: method_lo[s] - base_lo[s] for s in seeds}
    out = paired(hi, lo, level=level)
    out["wilcoxon"] = wilcoxon_signed_rank([hi[s] - lo[s] for s in out["seeds"]])
    return out


def _collapsed(rows, method: str, lag: int, lr: float) -> dict[int, bool]:
    return {
        int(r["seed"]): r.get("collapse_step") not in (None, "")
        for r in rows
        if r["method"] == method and int(r["lag"]) == lag and float(r["lr"]) == lr
    }


def primary_tests(
    rows: Sequence[Mapping[str, Any]], treatment: str, control: str, *, key: str = "tail20"
) -> list[dict[str, Any]]:
    """Per learning rate and each method of ``rows`` other than ``control``: the interaction of
    (method − control) between the lowest and the highest lag on ``key`` (:func:`interaction`),
    and exact McNemar tests of sustained collapse (``collapse_step`` set) against ``control`` at
    each of the two lags. The entry of ``treatment`` comes first and has ``primary`` True."""
    out = []
    methods = list(dict.fromkeys(r["method"] for r in rows if r["method"] != control))
    methods.sort(key=lambda m: m != treatment)
    for lr in sorted({float(r["lr"]) for r in rows}):
        lags = sorted({int(r["lag"]) for r in rows if float(r["lr"]) == lr})
        if len(lags) < 2:
            continue
        lo, hi = lags[0], lags[-1]
        for m in methods:
            x = {lag: by_seed(rows, m, lag, lr, key) for lag in (lo, hi)}
            c = {lag: by_seed(rows, control, lag, lr, key) for lag in (lo, hi)}
            out.append(
                {
                    "method": m,
                    "primary": m == treatment,
                    "lr": lr,
                    "lags": (lo, hi),
                    "interaction": interaction(x[hi], c[hi], x[lo], c[lo]),
                    "diff_lo": paired(x[lo], c[lo]),
                    "diff_hi": paired(x[hi], c[hi]),
                    **{
                        f"mcnemar_{name}": mcnemar_exact(
                            _collapsed(rows, m, lag, lr), _collapsed(rows, control, lag, lr)
                        )
                        for name, lag in (("lo", lo), ("hi", hi))
                    },
                }
            )
    return out


def difference_tests(
    rows: Sequence[Mapping[str, Any]],
    treatment: str,
    control: str,
    lag: int,
    *,
    key: str = "tail20",
) -> list[dict[str, Any]]:
    """Per learning rate, at ``lag``: ``treatment`` minus ``control`` (first, ``primary`` True)
    and minus each other method of ``rows``, paired on seed on ``key`` (:func:`paired`, with
    ``wilcoxon``, :func:`wilcoxon_signed_rank` of the differences), and the exact McNemar test of
    sustained collapse (``collapse_step`` set) between the two. The primary test of a protocol
    whose staleness differs within a batch (study 2), where no low-lag contrast is needed.

    Raises:
      ValueError: ``treatment`` or ``control`` has no run at ``lag``.
    """
    at_lag = [r for r in rows if int(r["lag"]) == int(lag)]
    present = {r["method"] for r in at_lag}
    missing = [m for m in (treatment, control) if m not in present]
    if missing:
        raise ValueError(f"difference tests: no run of {missing} at lag {lag}")
    others = [
        m for m in dict.fromkeys(r["method"] for r in at_lag) if m not in (treatment, control)
    ]
    out = []
    for lr in sorted({float(r["lr"]) for r in at_lag}):
        for other in (control, *others):
            x = by_seed(at_lag, treatment, lag, lr, key)
            y = by_seed(at_lag, other, lag, lr, key)
            diff = paired(x, y)
            diff["wilcoxon"] = wilcoxon_signed_rank([x[s] - y[s] for s in diff["seeds"]])
            out.append(
                {
                    "method": other,
                    "primary": other == control,
                    "lr": lr,
                    "lag": int(lag),
                    "diff": diff,
                    "mcnemar": mcnemar_exact(
                        _collapsed(at_lag, treatment, lag, lr), _collapsed(at_lag, other, lag, lr)
                    ),
                }
            )
    return out


def arm_summary(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per (method, lag, lr): seeds, tail20 mean ± sd, sustained collapses and their steps."""
    out = []
    for (method, mode, lag, lr), group in cells(rows).items():
        steps = sorted(
            int(r["collapse_step"]) for r in group if r.get("collapse_step") not in (None, "")
        )
        mean, sd, n = mean_sd(r.get("tail20", math.nan) for r in group)
        out.append(
            {
                "method": method,
                "lag_mode": mode,
                "lag": lag,
                "lr": lr,
                "n": len(group),
                "tail20": mean,
                "tail20_sd": sd,
                "collapses": len(steps),
                "collapse_steps": steps,
            }
        )
    return out
