"""M2PO's and BAPO's own activity in a run's summary, ``results.csv`` and the report's per-cell
table: M2PO's masked share over the trailing 25% of steps (``m2po_masked_t25``) and the share of
steps on which BAPO's bounds left their start (``bapo_moved``), shown only where a grid runs
them; and the lag table of the report, which pairs only the arms that ran at lag 1."""

import csv
import json
import math
import os

from _study_cli import invoke

from sat_jax.study import grid as study_grid
from sat_jax.study import runner, stats


def m2po_records(masked):
    return [
        {"step": s, "loss/mismatch": 0.01, "loss/m2po/masked_frac": m}
        for s, m in enumerate(masked, start=1)
    ]


def test_summary_reads_each_stabilizers_activity():
    # 8 steps: the trailing 25% are steps 7 and 8.
    out = stats.summarize_run(m2po_records([0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.02, 0.04]))
    assert math.isclose(out["m2po_masked_t25"], 0.03)
    assert math.isnan(out["bapo_moved"])
    bapo = [
        {"step": s, "loss/mismatch": 0.01, "loss/bapo/steps": float(moves)}
        for s, moves in enumerate([0, 3, 0, 0, 1, 0, 0, 0, 0, 2], start=1)
    ]
    out = stats.summarize_run(bapo)
    assert math.isclose(out["bapo_moved"], 0.3)  # over every step, not the trailing window
    assert math.isnan(out["m2po_masked_t25"])


def write_run(config, records, evals=(0.2, 0.3)):
    os.makedirs(config.workdir)
    with open(os.path.join(config.workdir, "metrics.jsonl"), "w", encoding="utf-8") as f:
        for i, v in enumerate(evals):
            f.write(json.dumps({"step": 4 * i, "eval/pass@1": v}) + "\n")
        for r in records:
            f.write(json.dumps(r) + "\n")
    runner.mark_finished(config, {"wall_seconds": 1.0, "end_step": 4})


def report(tmp_path, capsys, methods):
    out = tmp_path / "-".join(methods)
    runs = study_grid.expand(
        study_grid.resolve("stale2-calib", methods=list(methods), lags=[8], seeds=1), str(out)
    )
    for spec, config in runs:
        records = m2po_records([0.0, 0.1, 0.2, 0.06]) if spec.method == "m2po_gspo" else []
        write_run(config, records)
    args = [f"--methods={','.join(methods)}", f"--baseline={methods[0]}", f"--out={out}"]
    assert (
        invoke("compare", "--grid=stale2-calib", "--lags=8", "--seeds=1", *args, "--report_only")
        == 0
    )
    capsys.readouterr()
    with open(out / "results.csv", encoding="utf-8") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    return rows, (out / "results.md").read_text(encoding="utf-8")


def test_report_shows_the_activity_columns_only_where_a_grid_runs_them(tmp_path, capsys):
    rows, md = report(tmp_path, capsys, ("gspo", "m2po_gspo"))
    assert float(rows["m2po_gspo"]["m2po_masked_t25"]) == 0.06  # the last of 4 steps
    assert rows["gspo"]["m2po_masked_t25"] == "" and rows["gspo"]["bapo_moved"] == ""
    head = next(line for line in md.splitlines() if line.startswith("| method | lag |"))
    assert head.endswith("| realized lag | M2PO masked |")
    row = next(line for line in md.splitlines() if line.startswith("| M2PO"))
    assert row.endswith("| 0.0600 |")
    _, md = report(tmp_path, capsys, ("gspo",))
    head = next(line for line in md.splitlines() if line.startswith("| method | lag |"))
    assert head.endswith("| realized lag |")


def test_lag_table_leaves_out_and_names_the_arms_without_a_lag_1_run(tmp_path, capsys):
    # study 2's layout: GSPO, SAT-GSPO and the tight clip at mean lags 1 and 8, the other arms at 8.
    out = tmp_path / "stale2"
    for spec, config in study_grid.expand(study_grid.resolve("stale2", seeds=1), str(out)):
        write_run(config, [], evals=(0.2, 0.5 if spec.lag == 1 else 0.4))
    assert invoke("compare", "--grid=stale2", "--seeds=1", f"--out={out}", "--report_only") == 0
    capsys.readouterr()
    md = (out / "results.md").read_text(encoding="utf-8")
    section = md.split("## Each method against itself at lag 1")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split(" | ")[0] for r in rows[1:]] == [
        "| GSPO",
        "| SAT-GSPO",
        "| GSPO, tight clip",
    ]
    # final 0.4 at lag 8 against 0.5 at lag 1, one seed
    assert all(r.endswith("| -0.100 (n=1, 0/1 up) |") for r in rows[1:])
    assert (
        "Without a lag-1 run to pair with, left out: Age-aware clip (GSPO), M2PO-GSPO, BAPO-GSPO."
        in section
    )
