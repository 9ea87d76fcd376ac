"""Which stabilizer against which staleness: every arm of one or more staleness studies set
against the same base, on one page (``docs/results/stabilizers.md``).

Each study is named and given as its directories (a study and its re-runs on other seeds pool
their seeds; the page says so), its base method, its low and high lag. Per arm, paired on seed
on the study's endpoint (tail20 by default):

* **against staleness**: arm − base at the high lag, and the share of the base's staleness cost
  (base at the low lag − base at the high lag, mean over seeds) that the arm's mean recovers;
* **when fresh**: arm − base at the low lag (where the arm ran there);
* **against SAT**: the treatment − arm at the high lag, with the exact Wilcoxon p;
* sustained collapses at the high lag.

Each difference is read out by its 95% interval alone: "better" or "worse" when the interval
excludes 0, "no difference detected" when it holds 0. The page computes; what a study found is
its own report's to say, and its pre-registered tests are there.

    python -m sat_jax.study.guide --treatment sat_gspo --base gspo \\
        --study "fixed lag 4=studies/stale,studies/stale-rerun" \\
        --study "heterogeneous lag, mean 8=studies/stale2" --out docs/results/stabilizers.md
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from sat_jax.study import pooled, stats, tables


@dataclasses.dataclass(frozen=True)
class Study:
    """One study of the page: ``name`` and the directories whose ``results.csv`` it reads."""

    name: str
    dirs: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Study:
        """``"NAME=DIR[,DIR...]"``."""
        name, sep, dirs = text.partition("=")
        found = tuple(d.strip() for d in dirs.split(",") if d.strip())
        if not sep or not name.strip() or not found:
            raise ValueError(f"--study must be NAME=DIR[,DIR...], got {text!r}")
        return cls(name.strip(), found)


def verdict(p: Mapping[str, Any] | None) -> str:
    """A difference (higher is better) read by its interval: better / worse / no difference
    detected."""
    if p is None or p["n"] < 2 or not math.isfinite(p["lo"]):
        return "–"
    if p["lo"] > 0:
        return "better"
    if p["hi"] < 0:
        return "worse"
    return "no difference detected"


def _one(values: set, what: str, study: str):
    if len(values) != 1:
        raise ValueError(f"{study}: the guide compares arms at one {what}; found {sorted(values)}")
    return next(iter(values))


def effects(
    rows: Sequence[Mapping[str, Any]],
    *,
    base: str,
    treatment: str,
    study: str = "study",
    key: str = "tail20",
) -> dict[str, Any]:
    """The numbers of one study's block (see the module docstring).

    Raises:
      ValueError: the base or the treatment is missing at the high lag, the base at the low lag,
        or the rows mix learning rates or lag modes.
    """
    lr = _one({float(r["lr"]) for r in rows}, "learning rate", study)
    mode = _one({r["lag_mode"] for r in rows}, "lag mode", study)
    lags = sorted({int(r["lag"]) for r in rows})
    if len(lags) < 2:
        raise ValueError(f"{study}: needs a low and a high lag; found {lags}")
    lo, hi = lags[0], lags[-1]

    def at(method, lag):
        return stats.by_seed(rows, method, lag, lr, key)

    for method, lag in ((base, hi), (base, lo), (treatment, hi)):
        if not at(method, lag):
            raise ValueError(f"{study}: no run of {method} at lag {lag}")
    base_hi, base_lo = at(base, hi), at(base, lo)
    cost = stats.paired(base_lo, base_hi)
    arms = [m for m in dict.fromkeys(r["method"] for r in rows) if m != base]
    arms.sort(key=lambda m: m != treatment)
    label = {r["method"]: r.get("label") or r["method"] for r in rows}
    # The treatment against each other arm at the high lag: the protocols' own test.
    sat_minus = {t["method"]: t["diff"] for t in stats.difference_tests(rows, treatment, base, hi)}
    out = []
    for m in (base, *arms):
        x_hi, x_lo = at(m, hi), at(m, lo)
        mean_hi, sd_hi, n_hi = stats.mean_sd(x_hi.values())
        entry = {
            "method": m,
            "label": label[m],
            "tail_hi": (mean_hi, sd_hi, n_hi),
            "collapses_hi": sum(
                r.get("collapse_step") not in (None, "")
                for r in rows
                if r["method"] == m and int(r["lag"]) == hi
            ),
        }
        if m != base:
            vs_hi = stats.paired(x_hi, base_hi)
            entry["vs_base_hi"] = vs_hi
            # The base's cost on the seeds this arm ran: an arm on fewer seeds than the base is
            # divided by what staleness cost the base on those seeds, not on all of them.
            # (``paired`` reads only the seeds both sides have.)
            own_cost = stats.paired(
                {s: base_lo[s] for s in vs_hi["seeds"] if s in base_lo}, base_hi
            )
            entry["recovered"] = (
                vs_hi["mean"] / own_cost["mean"]
                if vs_hi["n"] and own_cost["n"] and own_cost["mean"] > 0
                else math.nan
            )
            entry["cost_n"] = own_cost["n"]
            entry["vs_base_lo"] = stats.paired(x_lo, base_lo) if x_lo else None
        if m not in (base, treatment):
            entry["sat_minus"] = sat_minus[m]
        out.append(entry)
    return {"lr": lr, "lag_mode": mode, "lo": lo, "hi": hi, "cost": cost, "arms": out, "key": key}


_JAX = re.compile(r"^- JAX (\S+?),", re.M)


def jax_versions(dirs: Sequence[str]) -> list[str]:
    """The JAX versions the directories' ``results.md`` provenance records."""
    found = []
    for d in dirs:
        path = os.path.join(d, "results.md")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                found += _JAX.findall(f.read())
    return sorted(set(found))


def _block(study: Study, rows, e: Mapping[str, Any], treatment: str) -> list[str]:
    lo, hi, key = e["lo"], e["hi"], e["key"]
    seeds = sorted({int(r["seed"]) for r in rows})
    base = e["arms"][0]
    lines = [
        f"## {study.name}",
        "",
        f"From {', '.join(f'`{d}`' for d in study.dirs)}: lag mode `{e['lag_mode']}`, lags "
        f"{lo} and {hi}, learning rate {e['lr']:g}, seeds {tables.seed_span(seeds)}"
        + (
            " (pooled over the directories: exploratory, not pre-registered; each study's own "
            "tests are in its report)"
            if len(study.dirs) > 1
            else ""
        )
        + f". Endpoint `{key}`. From lag {lo} to lag {hi}, staleness costs the base "
        f"({base['label']}) {_cost(e['cost'])} of it.",
        "",
    ]
    head = [
        "arm",
        f"{key} at lag {hi} (mean ± sd, n)",
        f"− base at lag {hi} [95% CI]",
        "share of the staleness cost recovered",
        f"− base at lag {lo} (when fresh)",
        f"{treatment_label(e, treatment)} − arm at lag {hi} (Wilcoxon p)",
        f"collapses at lag {hi}",
    ]
    body = []
    for a in e["arms"]:
        mean, sd, n = a["tail_hi"]
        sat = a.get("sat_minus")
        body.append(
            [
                a["label"] + (" (base)" if a is base else ""),
                f"{tables.fmt_pm(mean, sd)} (n={n})",
                _read(a.get("vs_base_hi")),
                "–" if a is base else _share(a["recovered"], a["cost_n"], e["cost"]["n"]),
                _read(a.get("vs_base_lo")) if a is not base else "–",
                "–"
                if sat is None
                else f"{_read(sat)}; p {tables.fmt(sat['wilcoxon'].get('p', math.nan), 3)}",
                str(a["collapses_hi"]),
            ]
        )
    return [*lines, tables.markdown_table(head, body), ""]


def treatment_label(e: Mapping[str, Any], treatment: str) -> str:
    return next((a["label"] for a in e["arms"] if a["method"] == treatment), treatment)


def _cost(p: Mapping[str, Any]) -> str:
    """The base's loss from the low lag to the high one: ``0.210 [0.174, 0.246] (n=16, lower on
    16/16 seeds)``."""
    if not p["n"]:
        return "–"
    s = tables.fmt(p["mean"])
    if math.isfinite(p["lo"]):
        s += f" [{tables.fmt(p['lo'])}, {tables.fmt(p['hi'])}]"
    return s + f" (n={p['n']}, lower on {p['wins']}/{p['n']} seeds)"


def _share(x: float, n: int, n_all: int) -> str:
    """``79%``, or ``91% (of the base's cost on these 8 seeds)`` where the arm ran on fewer
    seeds than the base's cost line reads."""
    if not math.isfinite(x):
        return "–"
    return f"{100 * x:.0f}%" + (f" (of the base's cost on these {n} seeds)" if n != n_all else "")


def _read(p: Mapping[str, Any] | None) -> str:
    if p is None or not p["n"]:
        return "–"
    return f"{tables.fmt_paired(p)}: {verdict(p)}"


def markdown(
    studies: Sequence[Study],
    *,
    base: str,
    treatment: str,
    title: str,
    command: str = "",
    key: str = "tail20",
) -> str:
    lines = [
        f"# {title}",
        "",
        "Every arm of each staleness study against the same base, paired on seed. A difference "
        "reads *better* or *worse* when its 95% interval excludes 0 and *no difference "
        "detected* when it holds 0. The share recovered is the arm's mean gain over the base "
        "at the high lag divided by the base's mean loss from the low lag to the high one, "
        "both over the seeds the arm ran. "
        "Each study's pre-registered tests, protocol and plots are in its own report.",
        "",
    ]
    versions = []
    for study in studies:
        rows = pooled.read(study.dirs)
        e = effects(rows, base=base, treatment=treatment, study=study.name, key=key)
        lines += _block(study, rows, e, treatment)
        versions += jax_versions(study.dirs)
    jax = ", ".join(sorted(set(versions))) or "unrecorded"
    prov = f"*Computed from the studies' `results.csv`; JAX {jax} (as their reports record)."
    if command:
        prov += f" Command: `{command}`."
    return "\n".join([*lines, prov + "*", ""])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sat_jax.study.guide", description=__doc__)
    parser.add_argument("--study", action="append", required=True, help="NAME=DIR[,DIR...]")
    parser.add_argument("--base", required=True)
    parser.add_argument("--treatment", required=True)
    parser.add_argument("--key", default="tail20")
    parser.add_argument("--title", default="Which stabilizer against which staleness")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        studies = [Study.parse(s) for s in args.study]
        command = shlex.join(["python", "-m", "sat_jax.study.guide", *(argv or sys.argv[1:])])
        text = markdown(
            studies,
            base=args.base,
            treatment=args.treatment,
            title=args.title,
            command=command,
            key=args.key,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tables.write_page(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
