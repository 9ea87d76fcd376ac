"""Statistics of a study a reader can trust (pure numpy): per-run summaries from ``metrics.jsonl``
records, the collapse rule, mean ± sd over seeds, paired differences with Student-t intervals,
and the tables of ``results.md`` / ``results.csv``.

Paired differences. Runs of two methods on the same seed and lag start from the same warm-up and
see the same prompts, so the seed-to-seed spread they share cancels in the per-seed difference
``d_s = x_s(method) − x_s(baseline)``. With ``n`` paired seeds, mean ``d̄`` and sample standard
deviation ``s_d`` (ddof 1), the 95% interval is

    d̄ ± t_{0.975, n−1} · s_d / √n

(undefined for n = 1). ``t_{p, ν}`` is Student's t quantile, computed here from the t CDF
(regularized incomplete beta, Lentz's continued fraction) by bisection: t_{0.975,4} = 2.776.
"""

from __future__ import annotations

import csv
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
    "lag": "lag/mean",  # realized lag
    "reward": "train/reward_mean",
}


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
      (``q`` and ``binding`` exist only for SAT objectives).
    * ``steps``: training steps logged; ``collapsed``: ``rule(base, best, final)``.
    """
    if not 0 < trailing <= 1:
        raise ValueError(f"trailing must be in (0, 1], got {trailing}")
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
    train_steps = sorted(_by_step(records, "loss/mismatch"))
    out: dict[str, Any] = {
        "base": base,
        "best": best,
        "best_step": best_step,
        "final": final,
        "final_step": final_step,
        "steps": len(train_steps),
    }
    window = (
        set(train_steps[-max(1, math.ceil(trailing * len(train_steps))) :])
        if train_steps
        else set()
    )
    for name, key in TRAILING.items():
        values = [v for s, v in _by_step(records, key).items() if s in window and math.isfinite(v)]
        out[f"{name}_t25"] = float(np.mean(values)) if values else math.nan
    out["collapsed"] = rule(base, best, final)
    return out


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
        for key in ("base", "best", "final", *(f"{k}_t25" for k in TRAILING)):
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
# Formatting.


def fmt(x: float, digits: int = 3) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def fmt_pm(mean: float, sd: float, digits: int = 3) -> str:
    if not math.isfinite(mean):
        return "–"
    return f"{mean:.{digits}f}" + (f" ± {sd:.{digits}f}" if math.isfinite(sd) else "")


def fmt_paired(p: Mapping[str, Any] | None, digits: int = 3) -> str:
    """``+0.031 [−0.012, +0.074] (n=5, 4/5 up)``."""
    if p is None or not p["n"]:
        return "–"
    s = f"{p['mean']:+.{digits}f}"
    if math.isfinite(p["lo"]):
        s += f" [{p['lo']:+.{digits}f}, {p['hi']:+.{digits}f}]"
    return s + f" (n={p['n']}, {p['wins']}/{p['n']} up)"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table; ``|`` inside a cell is escaped."""

    def cell(v):
        return str(v).replace("|", "\\|")

    lines = [
        "| " + " | ".join(cell(h) for h in headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
    ]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells for {len(headers)} headers: {row}")
        lines.append("| " + " | ".join(cell(v) for v in row) + " |")
    return "\n".join(lines)


def write_csv(path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(
                {
                    k: (
                        ""
                        if isinstance(r.get(k), float) and not math.isfinite(r[k])
                        else r.get(k, "")
                    )
                    for k in columns
                }
            )
