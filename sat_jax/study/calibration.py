"""Phase 0 of the staleness study: manipulation checks that choose the study's setting before any
counted run, from the mismatch a setting produces and the harm staleness does to the baseline,
never from how SAT fares against it.

A *setting* is one study directory of ``sat-jax compare --grid`` runs (its knobs are
the ``--set`` overrides it was run with) at one learning rate, holding a baseline and the SAT
method on that baseline (a *family*: GRPO and SAT-GRPO, GSPO and SAT-GSPO, ...) at a low and a
high lag. Where a cell (method, lag, learning rate) holds several seeds, its numbers are their
means (``_cell``), over the seeds the entry's cells share. It passes when all four checks hold:

1. **harm**: the baseline at the high lag ends lower than at the low lag (mean held-out pass@1 over
   the last 20% of evaluations, ``tail20``, lower by at least :data:`HARM_MARGIN`), or collapses
   (``collapse_step`` set: :class:`sat_jax.study.stats.SustainedCollapse`);
2. **mismatch in range**: the baseline's d̄_π at the high lag (trailing 25% of steps) lies in
   :data:`MISMATCH_RANGE`, the paper's regime;
3. **SAT can act**: SAT's quantile q at the high lag is below log(1 + ε_high), where its upper
   contraction can bind at all;
4. **SAT binds**: SAT's binding rate at the high lag is at least :data:`BINDING_MIN` of active
   tokens;
5. **heterogeneous mismatch** (read where the runs log d̄_π by staleness, a batch mixing ages:
   ``lag_mode=sampled``): the baseline's d̄_π over tokens at least 8 versions old is at least
   :data:`HETERO_RATIO` times its d̄_π over tokens at most 2 versions old, at the high lag.

Among passing settings the one chosen has the highest binding rate (ties: the lower learning
rate). SAT's own accuracy is not read here.

    python -m sat_jax.study.calibration --baseline grpo,gspo --sat sat_grpo,sat_gspo \\
        --out docs/results/stale/phase0.md studies/phase0/*

(``--baseline`` and ``--sat`` name the families pairwise; each directory is read for every family
whose baseline it holds.)
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sat_jax.study import tables

HARM_MARGIN = 0.02
MISMATCH_RANGE = (0.01, 0.05)
BINDING_MIN = 0.03
HETERO_RATIO = 2.0

_FLOATS = (
    "lr",
    "tail20",
    "mismatch_t25",
    "q_t25",
    "binding_t25",
    "clip_t25",
    "reward_t25",
    "final",
    "base",
    "lag_le2_t25",
    "lag_ge8_t25",
    "m2po_masked_t25",
    "bapo_moved",
)


def _number(v) -> float:
    """A results.csv cell as a float: NaN where empty."""
    return math.nan if v in (None, "") else float(v)


def read_rows(study_dir: str) -> list[dict[str, Any]]:
    """The finished runs' rows of ``study_dir/results.csv`` with numbers parsed (empty cells:
    NaN / None); a run still going (``status`` partial) is not read."""
    path = os.path.join(study_dir, "results.csv")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no results.csv in {study_dir} (run sat-jax compare --grid first)")
    with open(path, newline="", encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r.get("status", "finished") in ("", "finished")]
    for r in rows:
        for k in _FLOATS:
            r[k] = _number(r.get(k))
        r["lag"] = int(r["lag"])
        r["seed"] = int(r.get("seed") or 0)
        r["collapse_step"] = int(r["collapse_step"]) if r.get("collapse_step") else None
    return rows


def _cell(rows, method: str, lag: int, lr: float) -> dict[str, Any] | None:
    """A (method, lag, lr) cell over its seeds: each number the mean over the seeds (NaN where
    a run lacks it), ``seeds`` their count, ``collapses`` how many collapsed, and
    ``collapse_step`` the step of a single seed's collapse (None with several seeds)."""
    found = [r for r in rows if r["method"] == method and r["lag"] == lag and r["lr"] == lr]
    if not found:
        return None
    out: dict[str, Any] = {k: float(np.mean([_number(r.get(k)) for r in found])) for k in _FLOATS}
    out["seeds"] = len(found)
    out["collapses"] = sum(r.get("collapse_step") not in (None, "") for r in found)
    out["collapse_step"] = (found[0].get("collapse_step") or None) if len(found) == 1 else None
    return out


def checks(
    setting: str,
    rows: Sequence[Mapping[str, Any]],
    *,
    baseline: str,
    sat: str,
    eps_high: float = 0.2,
) -> list[dict[str, Any]]:
    """One entry per learning rate of ``rows`` and each higher lag the baseline has beside its
    lowest (lags 1, 8 and 16: the entries 1 / 8 and 1 / 16): the numbers the checks read and
    whether each holds (None where a run is missing)."""
    out = []
    for lr in sorted({r["lr"] for r in rows}):
        lags = sorted({r["lag"] for r in rows if r["method"] == baseline and r["lr"] == lr})
        out += [_entry(setting, rows, baseline, sat, eps_high, lr, lags[0], hi) for hi in lags[1:]]
    return out


def _paired(rows, baseline, sat, lr, lo, hi) -> list[Mapping[str, Any]]:
    """``rows`` restricted to the seeds the entry's cells share, so that every mean of an entry
    is over the same seeds: those the baseline ran at both lags and, where SAT ran at the high
    lag, SAT there too (a lag run on seeds 0-3 beside another run on seed 0 reads seed 0)."""

    def seeds(method, lag):
        return {
            r["seed"] for r in rows if r["method"] == method and r["lag"] == lag and r["lr"] == lr
        }

    common = seeds(baseline, lo) & seeds(baseline, hi)
    if common & seeds(sat, hi):
        common &= seeds(sat, hi)
    return [r for r in rows if r["seed"] in common]


def _entry(setting, rows, baseline, sat, eps_high, lr, lo, hi) -> dict[str, Any]:
    """The checks of one (learning rate, low lag, high lag) of a setting, over the seeds its
    cells share (:func:`_paired`)."""
    rows = _paired(rows, baseline, sat, lr, lo, hi)
    b_lo, b_hi = _cell(rows, baseline, lo, lr), _cell(rows, baseline, hi, lr)
    s_lo, s_hi = _cell(rows, sat, lo, lr), _cell(rows, sat, hi, lr)
    drop = b_lo["tail20"] - b_hi["tail20"]
    # One seed: it collapses at the high lag and not at the low one. Several: more seeds
    # collapse at the high lag than at the low one, and at least half of them.
    collapsed = b_hi["collapses"] > b_lo["collapses"] and 2 * b_hi["collapses"] >= b_hi["seeds"]
    mismatch = b_hi["mismatch_t25"]
    q = s_hi["q_t25"] if s_hi else math.nan
    binding = s_hi["binding_t25"] if s_hi else math.nan
    entry = {
        "setting": setting,
        "arms": (baseline, sat),
        "lr": lr,
        "lags": (lo, hi),
        "base_tail20": (b_lo["tail20"], b_hi["tail20"]),
        "base_collapse": (b_lo["collapse_step"], b_hi["collapse_step"]),
        "base_collapses": (b_lo["collapses"], b_hi["collapses"]),
        # Seeds behind the numbers: the fewest of the four cells.
        "seeds": min(c["seeds"] for c in (b_lo, b_hi, s_lo, s_hi) if c is not None),
        "mismatch": (b_lo["mismatch_t25"], mismatch),
        "q": (s_lo["q_t25"] if s_lo else math.nan, q),
        "binding": (s_lo["binding_t25"] if s_lo else math.nan, binding),
        # Clip fractions at the high lag (baseline, SAT): what a matched-step control matches.
        "clipped": (
            b_hi.get("clip_t25", math.nan),
            s_hi.get("clip_t25", math.nan) if s_hi else math.nan,
        ),
        "harm": bool(drop >= HARM_MARGIN or collapsed),
        "in_range": bool(MISMATCH_RANGE[0] <= mismatch <= MISMATCH_RANGE[1]),
        "can_act": None if s_hi is None else bool(q < math.log1p(eps_high)),
        "binds": None if s_hi is None else bool(binding >= BINDING_MIN),
        # d̄_π of the baseline at the high lag over tokens <= 2 and >= 8 versions old.
        "by_age": (b_hi["lag_le2_t25"], b_hi["lag_ge8_t25"]),
    }
    young, old = entry["by_age"]
    entry["hetero"] = (
        None
        if not (math.isfinite(young) and math.isfinite(old))
        else bool(old >= HETERO_RATIO * young)
    )
    entry["passes"] = all(entry[k] for k in ("harm", "in_range", "can_act", "binds")) and (
        entry["hetero"] is not False
    )
    return entry


def choose(entries: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The passing entry with the highest SAT binding rate at the high lag (ties: lower lr)."""
    passing = [e for e in entries if e["passes"]]
    if not passing:
        return None
    return max(passing, key=lambda e: (e["binding"][1], -e["lr"]))


def _mark(v) -> str:
    return "–" if v is None else ("yes" if v else "no")


def _percents(p) -> str:
    return " / ".join("–" if not math.isfinite(v) else f"{v:.2%}" for v in p)


def _collapses(e) -> str:
    """Collapse steps (one seed) or collapsed seeds of the count (several), low / high lag."""
    if e["seeds"] == 1:
        return " / ".join("–" if s is None else str(s) for s in e["base_collapse"])
    return " / ".join(f"{k}/{e['seeds']}" for k in e["base_collapses"])


def _pair(p, digits=3) -> str:
    return f"{tables.fmt(p[0], digits)} / {tables.fmt(p[1], digits)}"


#: by_staleness's columns: name -> metric key (trailing-window means per realized lag).
STALENESS_COLUMNS = {
    "d̄_π": "loss/mismatch",
    "q": "loss/sat/q",
    "gate": "loss/sat/gate_rate",
    "binding": "loss/sat/binding_rate",
    "clipped": "loss/clip_frac",
}


def by_staleness(
    records: Sequence[Mapping[str, Any]], *, trailing: float = 0.25
) -> list[dict[str, Any]]:
    """A run's diagnostics by the staleness of each step's batch (``lag/mean`` rounded, in
    versions), over the last ``trailing`` share of its training steps: one row per staleness,
    ``{"lag", "steps", <column>: mean, ...}`` (NaN where the run does not log a column).

    Under a broadcast lag n a step's batch is 1…n versions old (the broadcast's cycle), so a run's
    mean mixes fresh and stale steps; this separates them (a fixed lag k has one row, k)."""
    if not 0 < trailing <= 1:
        raise ValueError(f"trailing must be in (0, 1], got {trailing}")
    steps = sorted(
        {int(r["step"]): r for r in records if "lag/mean" in r and "loss/mismatch" in r}.items()
    )
    window = [r for _, r in steps[len(steps) - max(1, math.ceil(trailing * len(steps))) :]]
    groups: dict[int, list[Mapping[str, Any]]] = {}
    for r in window if steps else ():
        groups.setdefault(int(round(float(r["lag/mean"]))), []).append(r)
    return [
        {
            "lag": lag,
            "steps": len(rows),
            **{
                name: (
                    math.fsum(float(r[key]) for r in rows) / len(rows)
                    if all(key in r for r in rows)
                    else math.nan
                )
                for name, key in STALENESS_COLUMNS.items()
            },
        }
        for lag, rows in sorted(groups.items())
    ]


def staleness_markdown(run_dirs: Sequence[str]) -> str:
    """One :func:`by_staleness` table per run directory (binding as a percentage)."""
    from sat_jax.run.metrics import read_metrics

    lines = []
    for d in run_dirs:
        rows = by_staleness(read_metrics(d))
        lines += [f"`{os.path.basename(os.path.normpath(d))}` (trailing 25% of steps)", ""]
        table = [
            [r["lag"], r["steps"]]
            + [
                _percents((r[k],)) if k in ("gate", "binding", "clipped") else tables.fmt(r[k], 4)
                for k in STALENESS_COLUMNS
            ]
            for r in rows
        ]
        lines += [tables.markdown_table(["staleness", "steps", *STALENESS_COLUMNS], table), ""]
    return "\n".join(lines)


#: The page's heading unless ``--title`` gives another (study 1's phase 0 wrote this one).
TITLE = "Staleness study, phase 0: the calibration map"


#: The checks' names on the page, by their entry keys (``passes`` needs every one; a ``None``
#: value means the runs could not be checked for it).
CHECK_NAMES = {
    "harm": "harm",
    "in_range": "d̄_π in range",
    "can_act": "q < log(1+ε)",
    "binds": "binds ≥ 3%",
    "hetero": "heterogeneous",
}


def verdict(e: Mapping[str, Any]) -> str:
    """One entry's checks in words, for a setting already registered (nothing is chosen): which
    held, which did not, and which the runs could not be checked for."""
    held = [n for k, n in CHECK_NAMES.items() if e[k]]
    failed = [n for k, n in CHECK_NAMES.items() if e[k] is False]
    unknown = [n for k, n in CHECK_NAMES.items() if e[k] is None]
    where = f"`{e['setting']}` (`{e['arms'][0]}` / `{e['arms'][1]}`, lr {e['lr']:g}, lags "
    where += f"{e['lags'][0]} / {e['lags'][1]}, {e['seeds']} seeds)"
    words = [f"{len(held)} of {len(CHECK_NAMES)} checks hold"]
    if failed:
        words.append("**not held: " + ", ".join(failed) + "**")
    if unknown:
        words.append("not checkable from these runs: " + ", ".join(unknown))
    return f"- {where}: " + "; ".join(words) + "."


def markdown(
    entries: Sequence[Mapping[str, Any]],
    *,
    families: Sequence[tuple[str, str]],
    command: str,
    eps_high: float,
    title: str = TITLE,
    registered: bool = False,
) -> str:
    """The checks' page. ``registered``: the setting was fixed before these runs (a protocol's
    counted seeds), so each entry's outcome is stated and no setting is chosen."""
    from sat_jax.study.report import provenance

    prov = provenance()
    chosen = choose(entries)
    lines = [
        f"# {title}",
        "",
        "Runs of a baseline and SAT on it ("
        + ", ".join(f"`{b}` and `{s}`" for b, s in families)
        + ") at a low and a high lag, per setting (a study directory: its knobs) and learning "
        "rate, on one seed or, where the seeds column says more, the means over that many "
        "(the harm check then reads the mean drop, and a collapse counts when more seeds "
        "collapse at the high lag than at the low one and at least half do). The checks are "
        "`sat_jax/study/calibration.py`'s: harm (baseline tail20 lower at the high lag by "
        f"≥ {HARM_MARGIN}, or a sustained collapse), d̄_π at the high lag in "
        f"[{MISMATCH_RANGE[0]}, {MISMATCH_RANGE[1]}], q < log(1 + {eps_high}) = "
        f"{math.log1p(eps_high):.3f}, binding ≥ {BINDING_MIN:.0%}, and, where the runs log d̄_π "
        f"by staleness, d̄_π of tokens ≥ 8 versions old ≥ {HETERO_RATIO:g} × that of tokens ≤ 2 "
        "old. SAT's accuracy is not shown and was not used.",
        "",
        f"- command: `{command}`",
        f"- commit: {prov['commit']}; JAX {prov['jax']}, Python {prov['python']}; {prov['host']}",
        f"- written: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
        "",
    ]
    # The checks shown before the by-age column; heterogeneity follows it.
    checks = ("harm", "in_range", "can_act", "binds")
    headers = [
        "setting",
        "baseline / SAT",
        "lr",
        "lags",
        "seeds",
        "baseline tail20 lo / hi",
        "collapse step lo / hi",
        "d̄_π lo / hi",
        "SAT q lo / hi",
        "SAT binding lo / hi",
        "clipped hi: base / SAT",
        *(CHECK_NAMES[k] for k in checks),
        "d̄_π hi, age ≤ 2 / ≥ 8",
        CHECK_NAMES["hetero"],
        "passes",
    ]
    table = [
        [
            e["setting"],
            " / ".join(f"`{a}`" for a in e["arms"]),
            f"{e['lr']:g}",
            f"{e['lags'][0]} / {e['lags'][1]}",
            str(e["seeds"]),
            _pair(e["base_tail20"]),
            _collapses(e),
            _pair(e["mismatch"], 4),
            _pair(e["q"]),
            _percents(e["binding"]),
            _percents(e["clipped"]),
            *(_mark(e[k]) for k in checks),
            _pair(e["by_age"], 4),
            _mark(e["hetero"]),
            "**yes**" if e["passes"] else "no",
        ]
        for e in entries
    ]
    lines += [tables.markdown_table(headers, table), ""]
    if registered:
        lines += [
            "The setting was registered before these runs; the checks are reported, not used to "
            "choose:",
            "",
            *(verdict(e) for e in entries),
        ]
    elif chosen:
        lines.append(
            f"**Chosen**: setting `{chosen['setting']}`, `{chosen['arms'][0]}` and "
            f"`{chosen['arms'][1]}`, at lr {chosen['lr']:g} (lags "
            f"{chosen['lags'][0]} and {chosen['lags'][1]}): every check holds, and its binding "
            f"rate ({chosen['binding'][1]:.2%}) is the highest of the passing settings."
        )
    else:
        lines.append(
            "**No setting passes every check.** No phase-1 setting is chosen from this map."
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study_dirs", nargs="+", help="phase-0 study directories")
    parser.add_argument(
        "--baseline", required=True, help="baseline method(s), comma-separated, e.g. grpo,gspo"
    )
    parser.add_argument(
        "--sat", required=True, help="SAT method on each baseline, in order, e.g. sat_grpo,sat_gspo"
    )
    parser.add_argument("--eps-high", type=float, default=0.2)
    parser.add_argument("--out", required=True, help="markdown file to write")
    parser.add_argument("--title", default=TITLE, help="the page's heading")
    parser.add_argument(
        "--registered",
        action="store_true",
        help="the runs are a registered setting's counted seeds: state each entry's checks, "
        "choose no setting",
    )
    parser.add_argument(
        "--by-staleness",
        nargs="+",
        default=[],
        metavar="RUN_DIR",
        help="also tabulate these runs' d̄_π, q, gate, binding and clip by each step's staleness",
    )
    args = parser.parse_args(argv)
    baselines, sats = args.baseline.split(","), args.sat.split(",")
    if len(baselines) != len(sats):
        parser.error(f"--baseline {args.baseline!r} and --sat {args.sat!r} name unequal counts")
    families = list(zip(baselines, sats, strict=True))
    entries = []
    for d in args.study_dirs:
        try:
            rows = read_rows(d)
        except FileNotFoundError as e:
            print(f"calibration: {e}", file=sys.stderr)
            return 2
        for baseline, sat in families:
            entries += checks(
                os.path.basename(os.path.normpath(d)),
                rows,
                baseline=baseline,
                sat=sat,
                eps_high=args.eps_high,
            )
    command = "python -m sat_jax.study.calibration " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    text = markdown(
        entries,
        families=families,
        command=command,
        eps_high=args.eps_high,
        title=args.title,
        registered=args.registered,
    )
    if args.by_staleness:
        text += (
            "\n## By staleness\n\nEach step's batch is as many versions old as its `lag/mean`; "
            "the runs' trailing-window diagnostics grouped by it.\n\n"
            + staleness_markdown(args.by_staleness)
        )
    tables.write_page(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
