"""Writing a study's results out: number formats, Markdown tables and CSV files (for
``results.md`` / ``results.csv`` and the calibration report); the numbers come from
``sat_jax.study.stats``."""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any


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


def seed_span(seeds: Sequence[int]) -> str:
    """``4–11`` for a run of three or more consecutive seeds, else the list."""
    seeds = sorted(seeds)
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}–{seeds[-1]}"
    return ", ".join(map(str, seeds))


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


def write_page(path: str | None, text: str) -> None:
    """Writes a markdown page (its folder created) and echoes it to stdout, as the study
    commands do; with no ``path``, only echoes it."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    print(text)
