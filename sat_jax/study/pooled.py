"""A protocol's runs pooled over several study directories (a study and its re-runs on seeds it
did not use), as an **exploratory** analysis: the same tests as the protocol's primary ones, on
every seed of every directory, labelled as not pre-registered.

Each directory's ``results.csv`` (written by ``sat-jax compare --grid``) is read; a run (method,
lag, learning rate, seed) found in two directories is refused, since pooling would count its seed
twice, as is a directory whose arms or lags differ from the first one's. Per control, every arm
is tested against it as :func:`sat_jax.study.stats.primary_tests` does (the lag interaction with
a paired t interval and the exact Wilcoxon p, exact McNemar on collapses). With ``--lag L``, the
tests are those of a protocol whose primary comparison is a difference at one lag (study 2):
the treatment against the one control, then against each other arm, at lag L
(:func:`sat_jax.study.stats.difference_tests`).

    python -m sat_jax.study.pooled --treatment sat_gspo --control gspo --control gspo_tight \\
        --out docs/results/stale/pooled.md studies/stale studies/stale-rerun
    python -m sat_jax.study.pooled --treatment sat_gspo --control gspo_tight --lag 8 \\
        --out docs/results/stale2/pooled.md studies/stale2 studies/stale2-rerun
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from sat_jax.study import report, tables
from sat_jax.study.calibration import read_rows


def read(study_dirs: Sequence[str]) -> list[dict[str, Any]]:
    """The finished runs of every directory, each row with ``study`` (the directory), checked to
    be one protocol's runs on disjoint seeds."""
    if not study_dirs:
        raise ValueError("pooled: give at least one study directory")
    rows, seen, shape = [], {}, None
    for d in study_dirs:
        found = read_rows(d)
        if not found:
            raise ValueError(f"{d}: results.csv holds no finished run")
        cells = {(r["method"], r["lag"], r["lr"]) for r in found}
        if shape is None:
            shape = (d, cells)
        elif cells != shape[1]:
            raise ValueError(
                f"{d} holds the arms (method, lag, lr) {sorted(cells)}, {shape[0]} "
                f"{sorted(shape[1])}: pool only the runs of one protocol"
            )
        for r in found:
            key = (r["method"], r["lag"], r["lr"], r["seed"])
            if key in seen:
                raise ValueError(
                    f"run {key} is in both {seen[key]} and {d}: pooling would count seed "
                    f"{r['seed']} twice"
                )
            seen[key] = d
            rows.append({**r, "study": d})
    return rows


def markdown(
    rows: Sequence[dict[str, Any]],
    treatment: str,
    controls: Sequence[str],
    *,
    title: str,
    command: str = "",
    lag: int | None = None,
) -> str:
    """The pooled report: what was pooled, the arm table, and one table of tests per control
    (the lag interaction); with ``lag``, one table of the treatment against the one control and
    each other arm at that lag."""
    methods = {r["method"] for r in rows}
    missing = [m for m in (treatment, *controls) if m not in methods]
    if missing:
        raise ValueError(f"no runs of {missing} in the pooled studies (arms: {sorted(methods)})")
    if lag is not None and len(controls) != 1:
        raise ValueError(
            f"--lag {lag} tests the treatment against one control (the primary comparator) and "
            f"then every other arm; got controls {list(controls)}"
        )
    studies = list(dict.fromkeys(r["study"] for r in rows))
    seeds = {s: sorted({r["seed"] for r in rows if r["study"] == s}) for s in studies}
    lines = [
        f"# {title} (exploratory)",
        "",
        "**Exploratory, not pre-registered**: the runs of several studies of one protocol, "
        "pooled after they were run. Each study's own pre-registered tests are in its report; "
        "this page only adds power, and its intervals are not corrected for having looked at "
        "the studies first.",
        "",
        *[
            f"* `{s}`: seeds {tables.seed_span(seeds[s])} "
            f"({sum(r['study'] == s for r in rows)} runs); "
            + report.provenance_line([r for r in rows if r["study"] == s], s)
            for s in studies
        ],
        "",
    ]
    if command:
        lines += [f"Written by `{command}`.", ""]
    lines += [
        "Endpoint tail20 (held-out pass@1 averaged over the last 20% of evaluations), per arm:",
        "",
        report.arm_table(rows),
        "",
    ]
    if lag is not None:
        t, c = report.label(treatment), report.label(controls[0])
        return "\n".join(
            [
                *lines,
                f"## At lag {lag}",
                "",
                f"Per seed, {t} − arm at lag {lag} on tail20: mean, paired 95% t interval, seeds "
                f"above 0 and the exact Wilcoxon p; exact McNemar on sustained collapses. {c} "
                "first, as the protocol's primary comparator; each other arm on the seeds it ran.",
                "",
                report.difference_table(rows, treatment, controls[0], lag),
            ]
        )
    for control in controls:
        c = report.label(control)
        lines += [
            f"## Against {c}",
            "",
            f"Per seed, (arm − {c} at the high lag) − (arm − {c} at the low lag) on tail20: mean, "
            "paired 95% t interval, seeds above 0 and the exact Wilcoxon p; exact McNemar on "
            "sustained collapses.",
            "",
            report.interaction_table(rows, treatment, control),
            "",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("studies", nargs="+", help="study directories (each with results.csv)")
    parser.add_argument("--treatment", required=True, help="the arm tested first (primary)")
    parser.add_argument(
        "--control", action="append", required=True, help="a control arm (repeatable)"
    )
    parser.add_argument(
        "--lag",
        type=int,
        help="test the treatment against the one control and each other arm at this lag, "
        "instead of the lag interaction per control",
    )
    parser.add_argument("--title", default="Pooled analysis", help="the page's heading")
    parser.add_argument("--out", help="also write the page to this file (it is always printed)")
    args = parser.parse_args(argv)
    try:
        rows = read(args.studies)
        text = markdown(
            rows,
            args.treatment,
            args.control,
            title=args.title,
            lag=args.lag,
            command="python -m sat_jax.study.pooled "
            + shlex.join(sys.argv[1:] if argv is None else argv),
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"pooled: error: {e}", file=sys.stderr)
        return 2
    tables.write_page(args.out, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
