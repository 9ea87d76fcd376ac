"""A study's outputs from its run directories: ``results.csv`` (one row per run),
``results.md`` (provenance, definitions, per-cell table, paired differences, the envelope map)
and the plots under ``DIR/plots``."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Mapping, Sequence
from typing import Any

from sat_jax.run.metrics import read_metrics
from sat_jax.study import plots as study_plots
from sat_jax.study import runner, stats, tables
from sat_jax.study.grid import LABELS, Grid

CSV_COLUMNS = (
    "method",
    "label",
    "lag_mode",
    "lag",
    "lr",
    "seed",
    "status",
    "steps",
    "base",
    "best",
    "best_step",
    "final",
    "final_step",
    "collapsed",
    "tail20",
    "collapse_step",
    "mismatch_t25",
    "q_t25",
    "binding_t25",
    "clip_t25",
    "lag_t25",
    "reward_t25",
    "lag_le2_t25",
    "lag_ge8_t25",
    "m2po_masked_t25",
    "bapo_moved",
    "warmup_loss",
    "warmup_digest",
    "wall_s",
    "run_dir",
)


def collect(
    runs: Sequence[tuple[Any, Any]],
    *,
    out_dir: str = ".",
    rule: stats.CollapseRule = stats.DEFAULT_RULE,
) -> tuple[list[dict], list[tuple]]:
    """(rows, (spec, records) pairs) of the runs that have logged anything; a run without
    ``done.json`` is ``partial``."""
    rows, traces = [], []
    for spec, config in runs:
        try:
            records = read_metrics(config.workdir)
        except FileNotFoundError:
            continue
        finished = runner.is_finished(config)
        rows.append(
            {
                "method": spec.method,
                "label": LABELS.get(spec.method, spec.method),
                "lag_mode": spec.lag_mode,
                "lag": spec.lag,
                "lr": spec.lr,
                "seed": spec.seed,
                "status": "finished" if finished else "partial",
                "wall_s": runner.run_wall_seconds(config.workdir) if finished else None,
                "run_dir": os.path.relpath(config.workdir, out_dir),
                **stats.summarize_run(records, rule=rule),
            }
        )
        traces.append((spec, records))
    return rows, traces


def provenance() -> dict[str, str]:
    """Commit (with a note when ``sat_jax/`` has uncommitted changes), JAX and Python versions,
    the backend's devices and the host (``runner.run_provenance``'s, which every run records)."""
    run = runner.run_provenance()
    return {
        **{k: run[k] for k in ("commit", "jax", "python", "devices")},
        "host": f"{platform.node()}, {run['cpu']}",
    }


def run_provenance_counts(
    rows, out_dir: str, keys: Sequence[str] = ("commit", "jax", "cpu")
) -> dict[str, str]:
    """Per key of ``keys``: what the runs of ``rows`` recorded under it in ``provenance.json``
    (``run_dir`` relative to ``out_dir``, each file read once), each value with its count, as
    ``"value (n runs); ..."``. ``cpu``: the warm-up's float rounding, and so the base policy,
    differs between CPU models; ``commit``: the code the runs trained with, which a report
    written later (``--report_only``) need not share."""
    counts: dict[str, dict[str, int]] = {k: {} for k in keys}
    for r in rows:
        path = os.path.join(out_dir, r["run_dir"], runner.PROVENANCE_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                recorded = json.load(f)
        except (OSError, ValueError):
            recorded = None
        if not isinstance(recorded, dict):
            recorded = {}
        for k in keys:
            value = str(recorded.get(k, "not recorded"))
            counts[k][value] = counts[k].get(value, 0) + 1
    return {
        k: "; ".join(f"{value} ({n} runs)" for value, n in sorted(c.items()))
        for k, c in counts.items()
    }


def provenance_line(rows, out_dir: str) -> str:
    """One line of the runs' own provenance (commit, JAX, CPU) for a page that reads a study's
    runs without writing its report."""
    runs = run_provenance_counts(rows, out_dir)
    if all(v == f"not recorded ({len(rows)} runs)" for v in runs.values()):
        return f"its runs hold no provenance.json (their report: `{out_dir}/results.md`)"
    return f"the runs' commits: {runs['commit']}; JAX: {runs['jax']}; CPUs: {runs['cpu']}"


def label(method: str) -> str:
    return LABELS.get(method, method)


def _clock(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "–"
    return f"{seconds:.0f} s ({seconds / 3600:.2f} h)" if seconds >= 60 else f"{seconds:.1f} s"


def write(
    out_dir: str,
    grid: Grid,
    runs: Sequence[tuple[Any, Any]],
    *,
    command: str,
    lag_mode: str,
    overrides: Sequence[str],
    invocation: dict[str, Any] | None = None,
    rule: stats.CollapseRule = stats.DEFAULT_RULE,
    eps: float = 0.2,
    plots: bool = True,
) -> dict[str, Any]:
    """Writes ``results.csv``, ``results.md`` and (with ``plots``) the plots; returns their paths
    and the rows."""
    rows, traces = collect(runs, out_dir=out_dir, rule=rule)
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, "results.csv")
    tables.write_csv(csv_path, rows, CSV_COLUMNS)
    # A run still going has no final evaluation yet: it is listed in results.csv and counted in
    # the provenance, but no table, test or plot reads it.
    done = [i for i, r in enumerate(rows) if r["status"] == "finished"]
    finished, traces = [rows[i] for i in done], [traces[i] for i in done]
    plot_paths = _plots(out_dir, grid, traces) if plots else []
    env = None
    sat = _sat_partner(grid)
    if grid.name == "envelope" or (grid.lrs and len(grid.lrs) > 1 and sat):
        env = stats.envelope_map(finished, baseline=grid.baseline, sat=sat, eps=eps)
        path = (
            study_plots.plot_envelope(
                env,
                os.path.join(out_dir, "plots", "envelope.png"),
                titles=_envelope_titles(grid.baseline, sat),
            )
            if plots
            else None
        )
        if path:
            plot_paths.append(str(path))
    md = _markdown(
        grid,
        rows,
        finished,
        env,
        plot_paths,
        out_dir=out_dir,
        command=command,
        lag_mode=lag_mode,
        overrides=overrides,
        invocation=invocation or {},
        rule=rule,
        total=len(runs),
        eps=eps,
        sat=sat,
    )
    md_path = os.path.join(out_dir, "results.md")
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(md)
    return {"csv": csv_path, "md": md_path, "plots": plot_paths, "rows": rows, "envelope": env}


def _pairing_line(rows) -> str:
    """Whether every seed's runs started from one warm-up (the pairing the tests rely on)."""
    bad = stats.unpaired_seeds(rows)
    if bad:
        return (
            f"- **pairing broken**: the runs of seed(s) {', '.join(map(str, bad))} did not start "
            "from the same warm-up (different warm-up digests or final losses); their paired "
            "differences compare different base policies. The warm-up's float rounding differs "
            "across CPUs: rerun all of such a seed's runs on one machine"
        )
    unknown = stats.unverified_seeds(rows)
    if unknown:
        return (
            f"- pairing unverified for seed(s) {', '.join(map(str, unknown))}: some of their "
            "runs logged no warm-up digest (`sft/digest`), so a shared base policy cannot be "
            "checked"
        )
    return "- pairing: every seed's runs started from the same warm-up (equal warm-up digests)"


def _sat_partner(grid: Grid) -> str | None:
    """The SAT method the envelope compares with the baseline: ``sat_<baseline>`` if in the grid,
    else the first SAT method."""
    if f"sat_{grid.baseline}" in grid.methods:
        return f"sat_{grid.baseline}"
    sats = [m for m in grid.methods if m.startswith("sat_")]
    return sats[0] if sats else None


def _envelope_titles(baseline: str, sat: str | None) -> dict[str, str]:
    b, s = label(baseline), label(sat or "sat")
    return {
        "base_drop": f"{b}: final pass@1 change from lag 1",
        "sat_diff": f"{s} − {b}: final pass@1",
        "mismatch": f"{b}: d̄_π (trailing 25%)",
        "q": f"{s}: q (trailing 25%)",
        "binding": f"{s}: binding rate (trailing 25%)",
    }


def _plots(out_dir: str, grid: Grid, traces) -> list[str]:
    paths = []
    lrs = sorted({spec.lr for spec, _ in traces})
    for lr in lrs:
        sub = [(s, r) for s, r in traces if s.lr == lr]
        suffix = f"-lr{lr:g}" if len(lrs) > 1 else ""
        for key, stem, title, smoothed in (
            (stats.PASS, "accuracy", "held-out pass@1", False),
            ("loss/mismatch", "mismatch", "d̄_π (moving average)", True),
            (stats.TRAILING["q"], "q", "SAT's q (moving average)", True),
            (stats.TRAILING["binding"], "binding", "SAT's binding rate (moving average)", True),
        ):
            path = study_plots.plot_trajectories(
                sub,
                key,
                os.path.join(out_dir, "plots", f"{stem}{suffix}.png"),
                title=f"{grid.name}: {title}, lr {lr:g}",
                labels=LABELS,
                smoothed=smoothed,
            )
            if path:
                paths.append(str(path))
    return paths


def _markdown(
    grid,
    rows,
    finished_rows,
    env,
    plot_paths,
    *,
    out_dir,
    command,
    lag_mode,
    overrides,
    invocation,
    rule,
    total,
    eps,
    sat,
) -> str:
    """``rows``: every run that logged anything (provenance and counts); ``finished_rows``: the
    finished ones, which alone enter the tables and tests."""
    prov = provenance()
    runs = run_provenance_counts(rows, out_dir, ("commit", "cpu"))
    finished = len(finished_rows)
    run_sum = sum(r["wall_s"] or 0.0 for r in finished_rows)
    lines = [
        f"# Study `{grid.name}`",
        "",
        f"{grid.description}.",
        "",
        "## Provenance",
        "",
        f"- command: `{command}`",
        f"- commit of this report: {prov['commit']}; the runs' commits: {runs['commit']}",
        f"- JAX {prov['jax']}, Python {prov['python']}; {prov['devices']}; {prov['host']}",
        f"- the runs' CPUs: {runs['cpu']}",
        f"- written: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
        f"- runs: {finished} finished of {total}"
        + (
            f" ({len(rows) - finished} partial: listed in `results.csv`, left out of every "
            "table, test and plot below)"
            if len(rows) > finished
            else ""
        ),
        *(
            [
                f"- **failed in this invocation**: {', '.join(invocation['failed'])} "
                "(tracebacks in `runs/<name>/error.txt`)"
            ]
            if invocation.get("failed")
            else []
        ),
        (
            "- this invocation only wrote the report (`--report_only`)"
            if invocation.get("report_only")
            else f"- wall time of this invocation: {_clock(invocation.get('seconds'))} "
            f"({len(invocation.get('trained', []))} runs trained, "
            f"{len(invocation.get('skipped', []))} already finished)"
        )
        + f"; sum of the finished runs' own times (across invocations): {_clock(run_sum)}",
        "",
        "## Grid",
        "",
        f"- methods: {', '.join(label(m) + f' (`{m}`)' for m in grid.methods)}",
        f"- lags ({lag_mode}): {', '.join(map(str, grid.all_lags))}"
        + "".join(
            f"; {label(m)} at {', '.join(map(str, grid.lags_of(m)))} only"
            for m in grid.methods
            if grid.lags_of(m) != grid.all_lags
        )
        + "; learning rates: "
        + (
            ", ".join(f"{v:g}" for v in grid.lrs)
            if grid.lrs
            else "the config's (" + ", ".join(sorted({f"{r['lr']:g}" for r in rows})) + ")"
        ),
        f"- seeds: {grid.first_seed} … {grid.first_seed + grid.max_seeds - 1} "
        f"({grid.max_seeds})"
        + "".join(
            f"; {label(m)} on {grid.seeds_of(m)[0]} … {grid.seeds_of(m)[-1]}"
            for m in grid.methods
            if len(grid.seeds_of(m)) != grid.max_seeds
        )
        + f"; baseline of the paired differences: {label(grid.baseline)}",
        f"- config overrides (every run): {', '.join(f'`{o}`' for o in overrides) or 'none'}",
        _pairing_line(finished_rows),
        "",
        "## Definitions",
        "",
        "- **pass@1**: held-out accuracy of one sample per prompt at the rollout "
        "temperature (`eval/pass@1`). **base**: at step 0 (the warm-up's policy); **best**: "
        "the highest evaluation after step 0; **final**: the last evaluation.",
        "- **d̄_π**, **q**, **binding**, **clipped**, **realized lag**: means over the last 25% of "
        "training steps of `loss/mismatch`, `loss/sat/q` (SAT objectives only), "
        "`loss/sat/binding_rate`, `loss/clip_frac` (clipped) and `lag/mean`; where a grid runs "
        "them, **M2PO masked** (`loss/m2po/masked_frac`, same window) and **BAPO moved** (the "
        "share of all training steps with `loss/bapo/steps` > 0: its bounds left their start).",
        f"- Collapse rule: {rule.describe()}",
        "- Mean ± sd over seeds (sd with ddof 1). **Paired difference**: per seed, method "
        "minus baseline at the same lag and learning rate (same warm-up and prompt order); "
        "mean, 95% Student-t interval mean ± t_{0.975,n−1}·sd/√n, and how many seeds went "
        "up. An interval that contains 0 does not show a difference.",
        "",
    ]
    summary = stats.cell_summary(finished_rows)
    # The stabilizers' own activity, where a grid runs them: M2PO's masked share (trailing 25%)
    # and the share of steps on which BAPO's bounds moved.
    extra = [
        (key, head, digits)
        for key, head, digits in (
            ("m2po_masked_t25", "M2PO masked", 4),
            ("bapo_moved", "BAPO moved", 3),
        )
        if any(math.isfinite(c[key]) for c in summary)
    ]
    lines += [
        "## Per cell",
        "",
        tables.markdown_table(
            [
                "method",
                "lag",
                "lr",
                "n",
                "base",
                "best",
                "final",
                "collapsed",
                "d̄_π",
                "q",
                "binding",
                "clipped",
                "realized lag",
                *(head for _, head, _ in extra),
            ],
            [
                [
                    label(c["method"]),
                    c["lag"],
                    f"{c['lr']:g}",
                    c["n"],
                    tables.fmt(c["base"]),
                    tables.fmt_pm(c["best"], c["best_sd"]),
                    tables.fmt_pm(c["final"], c["final_sd"]),
                    f"{c['collapsed']}/{c['n']}",
                    tables.fmt(c["mismatch_t25"], 4),
                    tables.fmt(c["q_t25"], 4),
                    tables.fmt(c["binding_t25"], 4),
                    tables.fmt(c["clip_t25"], 4),
                    tables.fmt(c["lag_t25"], 2),
                    *(tables.fmt(c[key], digits) for key, _, digits in extra),
                ]
                for c in summary
            ],
        ),
        "",
    ]
    if grid.primary and grid.primary_lag is not None:
        lines += _difference_section(finished_rows, *grid.primary, grid.primary_lag)
    elif grid.primary:
        lines += _primary_section(finished_rows, *grid.primary)
    pairs = stats.paired_rows(finished_rows, grid.baseline)
    if pairs:
        lines += [
            f"## Paired differences against {label(grid.baseline)}",
            "",
            _paired_table(pairs),
            "",
        ]
    lagged = stats.lag_rows(finished_rows)
    paired_lagged, unpaired = [], {}  # unpaired: methods never run at the lowest lag
    for e in lagged:
        if e["final"]["n"] or e["best"]["n"]:
            paired_lagged.append(e)
        else:
            unpaired[label(e["method"])] = None
    if paired_lagged:
        lines += [
            f"## Each method against itself at lag {lagged[0]['from_lag']}",
            "",
            "Paired on the same seed and learning rate: what staleness costs each method."
            + (
                f" Without a lag-{lagged[0]['from_lag']} run to pair with, left out: "
                f"{', '.join(unpaired)}."
                if unpaired
                else ""
            ),
            "",
            _paired_table(paired_lagged),
            "",
        ]
    if env is not None:
        b, s = label(grid.baseline), label(sat or "")
        lines += [
            "## Operating envelope (learning rate × lag)",
            "",
            f"Per cell: {b}'s paired change of final pass@1 from lag 1 (same seed and "
            f"learning rate), its d̄_π; {s}'s q and binding rate (trailing 25%); whether "
            f"q < log(1 + ε) = {math.log1p(eps):.3f} (ε = {eps:g}: below it SAT's trust "
            f"region can bind); and {s} − {b} in final pass@1, paired.",
            "",
            tables.markdown_table(
                [
                    "lr",
                    "lag",
                    f"{b} final",
                    f"{b} Δ from lag 1",
                    "d̄_π",
                    "q",
                    "q < log(1+ε)",
                    "binding",
                    f"{s} − {b}",
                ],
                [
                    [
                        f"{e['lr']:g}",
                        e["lag"],
                        tables.fmt(e["base_final"]),
                        tables.fmt_paired(e["base_drop"]) if e["base_drop"] else "(lag 1)",
                        tables.fmt(e["mismatch"], 4),
                        tables.fmt(e["q"], 4),
                        _can_act(e),
                        tables.fmt(e["binding"], 4),
                        tables.fmt_paired(e["sat_diff"]),
                    ]
                    for e in env
                ],
            ),
            "",
        ]
    if plot_paths:
        lines += ["## Plots", ""]
        lines += [f"![{os.path.basename(p)}]({os.path.relpath(p, out_dir)})" for p in plot_paths]
        lines.append("")
    lines += ["Per-run numbers: `results.csv` (one row per run; `status` partial = not finished)."]
    return "\n".join(lines) + "\n"


def _paired_table(entries) -> str:
    """Best and final pass@1 differences of :func:`stats.paired_rows` / ``lag_rows`` entries."""
    return tables.markdown_table(
        ["method", "lag", "lr", "Δ best pass@1 [95% CI]", "Δ final pass@1 [95% CI]"],
        [
            [
                label(p["method"]),
                p["lag"],
                f"{p['lr']:g}",
                tables.fmt_paired(p["best"]),
                tables.fmt_paired(p["final"]),
            ]
            for p in entries
        ],
    )


def _p(test: Mapping[str, Any]) -> str:
    return f"{test['p']:.3g}"


def _primary_section(rows, treatment: str, control: str) -> list[str]:
    """The pre-registered tests (docs/results/stale/PROTOCOL.md): per-arm endpoint and collapse
    table, the lag interaction of each arm against the control, McNemar on collapses."""
    t, c = label(treatment), label(control)
    return [
        *_tests_header(rows),
        f"**Primary test**: the interaction ({t} − {c} at the high lag) − ({t} − {c} at the low "
        "lag), per seed, on tail20: mean, paired 95% t interval, seeds > 0, and the exact "
        "Wilcoxon signed-rank p. The other arms get the same test against the control "
        "(secondary, as are the exact McNemar tests of collapse against the control).",
        "",
        interaction_table(rows, treatment, control),
        "",
    ]


def interaction_table(rows, treatment: str, control: str) -> str:
    """Each arm of ``rows`` against ``control`` (:func:`stats.primary_tests`), ``treatment``
    first and marked primary: its differences at the low and the high lag, their interaction
    with the Wilcoxon p, and McNemar's collapse counts at each lag."""
    c = label(control)
    table = []
    for e in stats.primary_tests(rows, treatment, control):
        lo, hi = e["lags"]
        table.append(
            [
                ("**" + label(e["method"]) + "** (primary)")
                if e["primary"]
                else label(e["method"]),
                f"{e['lr']:g}",
                f"{lo} → {hi}",
                tables.fmt_paired(e["diff_lo"]),
                tables.fmt_paired(e["diff_hi"]),
                tables.fmt_paired(e["interaction"]),
                _p(e["interaction"]["wilcoxon"]),
                f"{e['mcnemar_lo']['b']}/{e['mcnemar_lo']['c']}, p {_p(e['mcnemar_lo'])}",
                f"{e['mcnemar_hi']['b']}/{e['mcnemar_hi']['c']}, p {_p(e['mcnemar_hi'])}",
            ]
        )
    return tables.markdown_table(
        [
            "arm",
            "lr",
            "lags",
            f"− {c}, low lag",
            f"− {c}, high lag",
            "interaction [95% CI]",
            "Wilcoxon p",
            "collapse only arm / only control, low lag",
            "collapse only arm / only control, high lag",
        ],
        table,
    )


def _tests_header(rows) -> list[str]:
    """The pre-registered tests' heading, endpoint and collapse rule, and the arm table."""
    return [
        "## Pre-registered tests",
        "",
        "Endpoint **tail20**: held-out pass@1 averaged over the last 20% of evaluations. "
        f"Collapse: {stats.SUSTAINED_RULE.describe()}.",
        "",
        arm_table(rows),
        "",
    ]


def arm_table(rows) -> str:
    """Per arm: seeds, tail20 mean ± sd, sustained collapses and their steps."""
    return tables.markdown_table(
        ["arm", "lag", "lr", "n", "tail20 (mean ± sd)", "collapses", "collapse steps"],
        [
            [
                label(a["method"]),
                a["lag"],
                f"{a['lr']:g}",
                a["n"],
                tables.fmt_pm(a["tail20"], a["tail20_sd"]),
                f"{a['collapses']}/{a['n']}",
                ", ".join(map(str, a["collapse_steps"])) or "–",
            ]
            for a in stats.arm_summary(rows)
        ],
    )


def _difference_section(rows, treatment: str, control: str, lag: int) -> list[str]:
    """The pre-registered tests of a protocol whose primary comparison is a paired difference at
    one lag (docs/results/stale2/PROTOCOL.md): the arm table, treatment − control and treatment
    − each other arm at that lag, McNemar on collapses."""
    t, c = label(treatment), label(control)
    lines = [
        *_tests_header(rows),
        f"**Primary test**: {t} − {c} at lag {lag}, per seed, on tail20: mean, paired 95% t "
        "interval, seeds above 0, and the exact Wilcoxon signed-rank p. "
        f"{t} − each other arm at the same lag is secondary, as are the exact McNemar tests of "
        "collapse.",
        "",
    ]
    try:
        return [*lines, difference_table(rows, treatment, control, lag), ""]
    except ValueError as e:
        return [*lines, f"Not computed yet: {e}.", ""]


def difference_table(rows, treatment: str, control: str, lag: int) -> str:
    """``treatment`` against ``control`` (first, marked primary) and against each other arm of
    ``rows`` at ``lag`` (:func:`stats.difference_tests`): the paired difference in tail20 with the
    Wilcoxon p, and McNemar's collapse counts.

    Raises:
      ValueError: ``treatment`` or ``control`` has no run at ``lag``.
    """
    t = label(treatment)
    return tables.markdown_table(
        [
            "against",
            "lr",
            f"{t} − arm, tail20 [95% CI]",
            "Wilcoxon p",
            f"collapse only {t} / only arm",
        ],
        [
            [
                ("**" + label(e["method"]) + "** (primary)")
                if e["primary"]
                else label(e["method"]),
                f"{e['lr']:g}",
                tables.fmt_paired(e["diff"]),
                _p(e["diff"]["wilcoxon"]),
                f"{e['mcnemar']['b']}/{e['mcnemar']['c']}, p {_p(e['mcnemar'])}",
            ]
            for e in stats.difference_tests(rows, treatment, control, lag)
        ],
    )


def _can_act(cell) -> str:
    """``yes``/``no`` for q < log(1 + ε); ``–`` where no SAT run of the cell has finished."""
    if not math.isfinite(cell["q"]):
        return "–"
    return "yes" if cell["sat_can_act"] else "no"
