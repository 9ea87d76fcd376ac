"""Hand-written ``results.csv`` files, as ``sat-jax compare --grid`` writes them (shared by the
study tests)."""

import csv

from sat_jax.study.report import CSV_COLUMNS


def write_results(d, rows, **defaults):
    """``d/results.csv`` (``d`` created) with ``rows``, each over ``defaults``; columns the report
    does not write are dropped."""
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(CSV_COLUMNS), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({**defaults, **r})
