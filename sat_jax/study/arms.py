"""Study 2's arm constants from the calibration's sweeps, by the rules stated before them.

``docs/results/stale2/CALIBRATION.md`` fixes one rule per arm, each read on the sweep
directories ``<root>/<prefix><value>`` that ``sat-jax compare --grid stale2-calib --lags 8
--set ...`` writes (one value each, seeds 0–3, mean lag 8):

* ``tight-eps<E>`` (``gspo_tight``): the highest mean tail20; values within ``TIE`` of it are
  ties, and the larger ε wins.
* ``age-kappa<K>`` (``age_clip_gspo``): the highest mean tail20; ties (within ``TIE``): the
  smaller κ.
* ``m2po-tau<T>`` (``m2po_gspo``): the paper's τ if it **acts** (masks ≥ 1% of active tokens,
  ``loss/m2po/masked_frac`` over the trailing 25% of steps, mean over the seeds); else, of the
  listed τ that act, the one whose masked share is closest to SAT-GSPO's mean binding rate at
  the setting (``<root>/setting``); none acting: the arm is dropped.
* ``bapo-rho<R>`` (``bapo_gspo``): the paper's ρ₀ if its bounds **act** (leave their start,
  ``loss/bapo/steps`` > 0, on ≥ 10% of steps, mean over the seeds); else the smallest listed
  ρ₀ that acts; else the arm is dropped.

A rule is applied only when every value it needs has all its seeds finished; until then the
page says what it waits for. Accuracy decides only the two clips, which are tuned by design;
M2PO's and BAPO's constants are fixed by whether they act.

Usage::

    python -m sat_jax.study.arms --out docs/results/stale2/arms.md studies/stale2-calib
    python -m sat_jax.study.arms --next studies/stale2-calib   # the sweeps still to run
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sat_jax.run.metrics import read_metrics
from sat_jax.study import calibration, stats, tables

SEEDS = 4
LAG = 8
TIE = 0.005
M2PO_ACTS = 0.01
BAPO_ACTS = 0.10


#: Arm -> (directory prefix, the config keys its constant sets, method, constant, the values
#: CALIBRATION.md lists, the paper's value or None, the rule). The lists are the plan's; a
#: directory of another value is refused.
ARMS: dict[str, dict[str, Any]] = {
    "tight": {
        "prefix": "tight-eps",
        "keys": ("loss.eps_low", "loss.eps_high"),
        "method": "gspo_tight",
        "constant": "ε",
        "values": (0.05, 0.07, 0.1, 0.14),
        "rule": "accuracy",
        "tie_break": max,
    },
    "age": {
        "prefix": "age-kappa",
        "keys": ("loss.kappa",),
        "method": "age_clip_gspo",
        "constant": "κ",
        "values": (0.03, 0.1, 0.3, 1.0),
        "rule": "accuracy",
        "tie_break": min,
    },
    "m2po": {
        "prefix": "m2po-tau",
        "keys": ("loss.tau",),
        "method": "m2po_gspo",
        "constant": "τ",
        "values": (0.04, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5),
        "paper": 0.04,
        "rule": "m2po",
    },
    "bapo": {
        "prefix": "bapo-rho",
        "keys": ("loss.rho_target",),
        "method": "bapo_gspo",
        "constant": "ρ₀",
        "values": (0.4, 0.5, 0.6),
        "paper": 0.4,
        "rule": "bapo",
    },
}


def read_sweep(sweep_dir: str, method: str) -> dict[str, Any]:
    """One value's runs at lag 8: finished seeds, mean tail20, M2PO's trailing masked share and
    the share of steps on which BAPO's bounds left their start (each the mean over seeds)."""
    try:
        rows = calibration.read_rows(sweep_dir)
    except FileNotFoundError:
        rows = []
    rows = [r for r in rows if r["method"] == method and r["lag"] == LAG]
    masked, moved = [], []
    for r in rows:
        records = read_metrics(os.path.join(sweep_dir, "runs", os.path.basename(r["run_dir"])))
        # The same per-run figures as the study reports' (``stats.summarize_run``).
        summary = stats.summarize_run(records)
        masked.append(summary["m2po_masked_t25"])
        moved.append(summary["bapo_moved"])

    def mean(values):
        return float(np.mean(values)) if values else math.nan

    return {
        "seeds": sorted(r["seed"] for r in rows),
        "tail20": mean([r["tail20"] for r in rows]),
        "masked": mean(masked),
        "moved": mean(moved),
    }


def _value_of(name: str, prefix: str) -> float:
    try:
        return float(name[len(prefix) :])
    except ValueError:
        raise ValueError(f"sweep directory {name!r}: no number after {prefix!r}") from None


def collect(root: str) -> dict[str, dict[float, dict[str, Any]]]:
    """Arm -> value -> :func:`read_sweep`, for every ``<prefix><value>`` directory of ``root``.

    Raises:
      ValueError: a directory's value is not one the plan lists for its arm.
    """
    found: dict[str, dict[float, dict[str, Any]]] = {arm: {} for arm in ARMS}
    for name in sorted(os.listdir(root)):
        for arm, spec in ARMS.items():
            if name.startswith(spec["prefix"]) and os.path.isdir(os.path.join(root, name)):
                value = _value_of(name, spec["prefix"])
                if value not in spec["values"]:
                    raise ValueError(
                        f"{os.path.join(root, name)}: {spec['constant']} {value} is not one of "
                        f"the values CALIBRATION.md lists for the {arm} arm {spec['values']}"
                    )
                found[arm][value] = read_sweep(os.path.join(root, name), spec["method"])
    return found


def _missing(sweeps: Mapping[float, Mapping[str, Any]], values: Sequence[float]) -> list[float]:
    """The values of ``values`` still missing seeds."""
    return [v for v in values if len(sweeps.get(v, {}).get("seeds", ())) < SEEDS]


def decide(arm: str, sweeps: Mapping[float, Mapping[str, Any]], sat_binding: float) -> dict:
    """The rule's outcome: ``{"status": "chosen", "value": v, "why": ...}``, ``"dropped"`` or
    ``"waiting"`` (with the values that still miss seeds)."""
    spec = ARMS[arm]
    c = spec["constant"]
    if spec["rule"] == "accuracy":
        missing = _missing(sweeps, spec["values"])
        if missing:
            return {"status": "waiting", "missing": missing}
        best = max(sweeps[v]["tail20"] for v in spec["values"])
        ties = [v for v in spec["values"] if sweeps[v]["tail20"] >= best - TIE]
        value = spec["tie_break"](ties)
        why = f"the highest mean tail20 ({best:.3f})"
        if len(ties) > 1:
            side = "larger" if spec["tie_break"] is max else "smaller"
            why += f"; {', '.join(map(str, ties))} within {TIE} of it: the {side} {c}"
        return {"status": "chosen", "value": value, "why": why}
    paper = spec["paper"]
    if spec["rule"] == "m2po":
        if _missing(sweeps, [paper]):
            return {"status": "waiting", "missing": [paper]}
        if sweeps[paper]["masked"] >= M2PO_ACTS:
            share = sweeps[paper]["masked"]
            return {"status": "chosen", "value": paper, "why": f"it masks {share:.2%} ≥ 1%"}
        rest = [v for v in spec["values"] if v != paper]
        missing = _missing(sweeps, rest)
        if missing:
            return {"status": "waiting", "missing": missing}
        acting = [v for v in rest if sweeps[v]["masked"] >= M2PO_ACTS]
        if not acting:
            return {"status": "dropped", "why": "no listed τ masks ≥ 1% of active tokens"}
        if not math.isfinite(sat_binding):
            return {"status": "waiting", "missing": ["SAT-GSPO's binding rate at the setting"]}
        value = min(acting, key=lambda v: (abs(sweeps[v]["masked"] - sat_binding), -v))
        return {
            "status": "chosen",
            "value": value,
            "why": f"τ {paper} masks {sweeps[paper]['masked']:.2%} < 1%; of the τ that act, "
            f"its masked share {sweeps[value]['masked']:.2%} is closest to SAT-GSPO's binding "
            f"rate {sat_binding:.2%}",
        }
    for value in spec["values"]:  # BAPO: the paper's, then the larger ρ₀ in order
        if _missing(sweeps, [value]):
            return {"status": "waiting", "missing": [value]}
        if sweeps[value]["moved"] >= BAPO_ACTS:
            moved = sweeps[value]["moved"]
            return {
                "status": "chosen",
                "value": value,
                "why": f"its bounds leave their start on {moved:.1%} of steps ≥ 10%",
            }
    return {"status": "dropped", "why": "no listed ρ₀ moves the bounds on ≥ 10% of steps"}


#: The order in which :func:`next_sweeps` lists the arms' missing sweeps.
ORDER = ("m2po", "bapo", "tight", "age")


def sweep_command(root: str, arm: str, value: float) -> list[str]:
    """``CALIBRATION.md``'s command for one value of one arm: four seeds at mean lag 8 into
    ``root/<prefix><value>``."""
    spec = ARMS[arm]
    if value not in spec["values"]:
        raise ValueError(f"{arm}: {value!r} is not one of the listed values {spec['values']}")
    method = spec["method"]
    cmd = ["sat-jax", "compare", "--grid", "stale2-calib", "--lags", str(LAG)]
    cmd += ["--methods", method, "--baseline", method]
    cmd += ["--out", os.path.join(root, f"{spec['prefix']}{float(value)!r}")]
    for key in spec["keys"]:
        cmd += ["--set", f"{key}={float(value)!r}"]
    return cmd


def next_sweeps(root: str, by_seed: bool = False) -> list[list[str]]:
    """The commands of every sweep a rule still waits for (arms in :data:`ORDER`, values in the
    plan's order); empty once every arm is decided. A half-finished sweep is listed too: its
    command resumes it.

    ``by_seed``: only the next round of a seed-by-seed order, the sweeps still without the
    lowest seed any of them lacks, each command with ``--seeds`` up to that seed (it runs that
    seed alone; the finished ones are skipped). Run round after round, every seed's runs of all
    the sweeps come one after another, so they share one machine (and one warm-up) unless a
    session ends in the middle of a round."""
    found, binding = collect(root), sat_binding_rate(root)
    waiting = []
    for arm in ORDER:
        outcome = decide(arm, found[arm], binding)
        if outcome["status"] == "waiting":
            waiting += [(arm, v) for v in outcome["missing"]]
    if not by_seed:
        return [sweep_command(root, arm, v) for arm, v in waiting]

    def next_seed(arm, value):
        done = set(found[arm].get(value, {}).get("seeds", []))
        return min(set(range(SEEDS)) - done, default=SEEDS)

    if not waiting:
        return []
    seed = min(next_seed(arm, v) for arm, v in waiting)
    return [
        sweep_command(root, arm, v) + ["--seeds", str(seed + 1)]
        for arm, v in waiting
        if next_seed(arm, v) == seed
    ]


def sat_binding_rate(root: str) -> float:
    """SAT-GSPO's mean trailing binding rate at lag 8 in ``root/setting`` (NaN without it)."""
    try:
        rows = calibration.read_rows(os.path.join(root, "setting"))
    except FileNotFoundError:
        return math.nan
    values = [r["binding_t25"] for r in rows if r["method"] == "sat_gspo" and r["lag"] == LAG]
    return float(np.mean(values)) if values else math.nan


def markdown(root: str, command: str) -> str:
    from sat_jax.study.report import provenance

    found, binding = collect(root), sat_binding_rate(root)
    prov = provenance()
    lines = [
        "# Staleness study 2: each arm's constant",
        "",
        "Each arm's sweep at mean lag 8 on seeds 0–3, read by the rules CALIBRATION.md stated "
        "before the runs (`sat_jax/study/arms.py`). tail20 decides only the two clips, tuned "
        "by design; M2PO's τ and BAPO's ρ₀ are fixed by whether they act. SAT-GSPO's tail20 "
        "is not read.",
        "",
        f"- command: `{command}`",
        f"- commit: {prov['commit']}; JAX {prov['jax']}, Python {prov['python']}; {prov['host']}",
        f"- SAT-GSPO's binding rate at the setting, mean lag 8 (M2PO's target): {binding:.2%}",
        "",
    ]
    for arm, spec in ARMS.items():
        sweeps = found[arm]
        outcome = decide(arm, sweeps, binding)
        lines += [f"## {arm}: `{spec['method']}`, {spec['constant']}", ""]
        column, read = {
            "accuracy": ("mean tail20", lambda x: tables.fmt(x["tail20"], 3)),
            "m2po": ("masked (trailing 25%)", lambda x: f"{x['masked']:.2%}"),
            "bapo": ("steps whose bounds moved", lambda x: f"{x['moved']:.1%}"),
        }[spec["rule"]]
        rows = []
        for v in spec["values"]:
            s = sweeps.get(v)
            if s is None or not s["seeds"]:
                rows.append([v, "not run" if s is None else f"0/{SEEDS}", ""])
            else:
                rows.append([v, f"{len(s['seeds'])}/{SEEDS}", read(s)])
        header = [spec["constant"], "seeds finished", column]
        lines += [tables.markdown_table(header, rows), ""]
        if outcome["status"] == "chosen":
            lines.append(f"**Chosen**: {spec['constant']} = {outcome['value']}: {outcome['why']}.")
        elif outcome["status"] == "dropped":
            lines.append(f"**Dropped**: {outcome['why']}.")
        else:
            waiting = ", ".join(map(str, outcome["missing"]))
            lines.append(f"**Not decided yet**: waiting for {waiting} (seeds 0–3 each).")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", help="the calibration's directory (setting/ and the sweeps)")
    parser.add_argument("--out", help="markdown file to write")
    parser.add_argument(
        "--next",
        action="store_true",
        help="print the command of every sweep a rule still waits for, one a line, instead",
    )
    parser.add_argument(
        "--by-seed",
        action="store_true",
        help="with --next: only the next seed-by-seed round, each command with --seeds",
    )
    args = parser.parse_args(argv)
    if not os.path.isdir(args.root):
        print(f"arms: no directory {args.root}", file=sys.stderr)
        return 2
    if args.next:
        for cmd in next_sweeps(args.root, by_seed=args.by_seed):
            print(shlex.join(cmd))
        return 0
    if not args.out:
        print("arms: give --out (the page to write) or --next", file=sys.stderr)
        return 2
    command = "python -m sat_jax.study.arms " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    text = markdown(args.root, command)
    tables.write_page(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
