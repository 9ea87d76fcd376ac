"""Any logged metric of a study's runs, per cell, over the runs' trailing steps: a descriptive
table for the questions a study's report does not answer by itself (what radius SAT settled on,
how often a stabilizer acted), read from each finished run's ``metrics.jsonl`` with the report's
own window (the last 25% of training steps).

Per cell (method, lag, learning rate), for each ``--metric``: the mean over seeds of each run's
trailing mean, its sd and the number of runs that log it. A metric no run logs is refused with
the keys the runs do log, before anything is written. Every logged step of the window counts,
so a metric logged as 0 on steps where it does not apply (``mismatch/lag_ge8`` on a batch
without such tokens) is averaged with those zeros; the report's ``lag_le2``/``lag_ge8`` columns
read only the steps whose batch held the bucket.

    python -m sat_jax.study.trailing --metric loss/sat/eps_low_mean \\
        --metric loss/sat/eps_high_mean --metric loss/clip_frac studies/stale2
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from sat_jax.run.metrics import read_metrics
from sat_jax.study import report, stats, tables
from sat_jax.study.calibration import read_rows


def cell_means(
    study_dir: str,
    metrics: Sequence[str],
    trailing: float = 0.25,
    rows: Sequence[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Per cell of ``study_dir``'s finished runs (in ``results.csv`` order; ``rows``: those
    already read by ``read_rows``): ``method``, ``lag``, ``lr`` and, per metric, ``(mean, sd,
    n)`` over the seeds of the runs' trailing means (n: the runs that log the metric in their
    trailing window).

    Raises:
      ValueError: no metric is given, ``trailing`` is outside (0, 1], the study has no finished
        run, or a metric is logged by none of its runs.
    """
    if not metrics:
        raise ValueError("trailing: name at least one --metric")
    if not 0 < trailing <= 1:
        raise ValueError(f"--trailing must be in (0, 1], got {trailing}")
    if rows is None:
        rows = read_rows(study_dir)
    if not rows:
        raise ValueError(f"{study_dir}: results.csv holds no finished run")
    values: dict[tuple, dict[str, list[float]]] = {}
    logged: set[str] = set()
    for r in rows:
        records = read_metrics(os.path.join(study_dir, r["run_dir"]))
        for rec in records:
            logged.update(rec)
        window = stats.trailing_steps(stats.train_steps(records), trailing)
        cell = values.setdefault((r["method"], r["lag"], r["lr"]), {m: [] for m in metrics})
        for m in metrics:
            v = stats.trailing_mean(records, m, window)
            if not math.isnan(v):  # NaN: the run does not log it in its window
                cell[m].append(v)
    missing = [m for m in metrics if m not in logged]
    if missing:
        raise ValueError(
            f"{study_dir}: no run logs {missing}; the runs log {sorted(logged - {'step', 'time'})}"
        )
    return [
        {
            "method": method,
            "lag": lag,
            "lr": lr,
            **{m: stats.mean_sd(vs) for m, vs in by_metric.items()},
        }
        for (method, lag, lr), by_metric in values.items()
    ]


def markdown(
    study_dir: str,
    cells: Sequence[dict[str, Any]],
    metrics: Sequence[str],
    *,
    trailing: float = 0.25,
    command: str = "",
    provenance: str = "",
) -> str:
    """The page: what was read (``provenance``: :func:`report.provenance_line`), then one row
    per cell and a column per metric."""
    lines = [
        f"# `{study_dir}`: logged metrics over the trailing {trailing:.0%} of training steps",
        "",
        "Descriptive: per cell, the mean ± sd over seeds of each run's mean over its last "
        f"{trailing:.0%} of training steps, and in brackets the runs that log the metric there. "
        "No test is made here; the study's report holds its tests.",
        "",
    ]
    if command:
        lines += [f"Written by `{command}`.", ""]
    if provenance:
        lines += [f"Provenance: {provenance}.", ""]
    lines.append(
        tables.markdown_table(
            ["method", "lag", "lr", *[f"`{m}`" for m in metrics]],
            [
                [
                    report.label(c["method"]),
                    c["lag"],
                    f"{c['lr']:g}",
                    *[
                        f"{tables.fmt_pm(c[m][0], c[m][1], 4)} ({c[m][2]})" if c[m][2] else "–"
                        for m in metrics
                    ],
                ]
                for c in cells
            ],
        )
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", help="a study directory (with results.csv and runs/)")
    parser.add_argument(
        "--metric", action="append", required=True, help="a key of metrics.jsonl (repeatable)"
    )
    parser.add_argument(
        "--trailing", type=float, default=0.25, help="the share of training steps read (0, 1]"
    )
    parser.add_argument("--out", help="also write the page to this file (it is always printed)")
    args = parser.parse_args(argv)
    try:
        rows = read_rows(args.study)
        cells = cell_means(args.study, args.metric, args.trailing, rows)
        provenance = report.provenance_line(rows, args.study)
    except (ValueError, FileNotFoundError) as e:
        print(f"trailing: error: {e}", file=sys.stderr)
        return 2
    text = markdown(
        args.study,
        cells,
        args.metric,
        trailing=args.trailing,
        provenance=provenance,
        command="python -m sat_jax.study.trailing "
        + shlex.join(sys.argv[1:] if argv is None else argv),
    )
    tables.write_page(args.out, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
