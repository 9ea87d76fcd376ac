"""Writes ``docs/benchmarks.md`` from the benchmarks' JSON in ``benchmarks/results/``.

One section per benchmark: what it measures, its command, one provenance line (commit, date,
machine, load average at start → end, JAX version) and its figures as tables. Only the latest run
of each benchmark is kept (its JSON file is overwritten by the next run; history is in git).

    python benchmarks/report.py [--results benchmarks/results] [--out docs/benchmarks.md]
    python benchmarks/report.py --check      # exit 1 if docs/benchmarks.md is out of date
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: Benchmark name -> (title, what it measures). Order is the page's order; unknown names follow.
ABOUT = {
    "losses": (
        "Losses",
        "forward + backward of the jitted objectives at 2^20 tokens (PPO, SAT with each quantile "
        "method, SAT with q given, GSPO, SAT-GSPO, and the field's stabilizers, M2PO with each "
        "selection method), the exact quantile against `jnp.quantile` and `lax.top_k`, the cost "
        "of the primitives an exact selection is built from (`floor_ms`), and the collectives of "
        "the sharded SAT loss.",
    ),
    "sampler": (
        "Model and sampler",
        "KV-cache decode against recomputing the prefix, the training log-prob pass forward and "
        "forward + backward, and their FLOP/s against a float32 matmul of the same run.",
    ),
    "engines": (
        "Rollout engines on spread-out lengths",
        "the continuous engine against the static batch and transformers' `generate` "
        "(`benchmarks/peers/generate_torch.py`, same weights, prompts and per-sequence length "
        "limits, in static batches as `generate` runs them), timed round-robin in one run on a "
        "heavy-tailed and a long-response workload: useful tokens/s, the decode work on finished "
        "rows, and `continuous_over_*` (> 1: continuous is faster).",
    ),
    "moe": (
        "MoE layer",
        "forward and forward + backward of every `expert_ffn` path (dense, ragged, blocked) and "
        "transformers' `Qwen3MoeExperts` on the same weights and routing, with XLA's FLOP counts.",
    ),
    "batched_matmul": (
        "Batched matmuls",
        "the blocked MoE's three batched matmuls alone, XLA:CPU against torch, in GFLOP/s.",
    ),
    "logprobs": (
        "Chunked log-probs",
        "chunked against full log-probs over the vocabulary: time and compiled memory.",
    ),
    "loop": (
        "Host loop",
        "the default run's loop: trainer steps/s, the train step broken down, shared prompts "
        "against the plain layout, stream against broadcast, and tunix's GRPO loop beside it "
        "(`benchmarks/peers/tunix_grpo.py`, d 64, 2 layers, a dense SwiGLU of 128 for our "
        "16-expert top-4 MoE of width 32). tunix runs after ours in the same invocation, not "
        "interleaved with it, so `ours_over_tunix` carries whatever the load did in between; "
        "`shared_over_plain` likewise.",
    ),
    "runs": (
        "Many runs at once",
        "R runs as one `jax.vmap`'d program against R runs one after another in one process.",
    ),
    "testbed_loop": (
        "Staleness testbed loop, per engine",
        "the `stale_sort` preset's RL loop (GRPO, broadcast lag 1) with the static and the "
        "continuous rollout engine in alternating runs from the same warm-up: steps/s, rollout "
        "against train time, and the static engine's decode work on finished rows.",
    ),
    "study_run": (
        "A staleness protocol run, per decode layout",
        "a reduced run of the staleness protocol (grid `stale` of `configs/studies/stale.py`, "
        "one arm and seed; study 1's "
        "fixed lag and study 2's sampled lag) with the per-call decode layout (evaluation in "
        "training-shaped calls), the merged one (large evaluation calls of one shape; the "
        "default), for the sampled lag the vmapped one (every version of a batch in one "
        "vmap'd decode; one decode per behaviour version otherwise) and the prefetch one "
        "(merged, with `rollout.prefetch`: batch s + 1 decoded on a second CPU device while the "
        "trainer runs step s on the first) and the spread one (merged, with "
        "`rollout.decode_devices=2`: a sampled-lag batch's versions decoded in turn on two CPU "
        "devices, all dispatched before any is read), in alternating runs: wall time, its phases "
        "(compile overlaps the others; with prefetch the rollout and train phases overlap each "
        "other), `new_over_old` (merged over per-call wall time without the build; < 1: faster), "
        "`vmapped_over_old`, `prefetch_over_old`, `prefetch_over_new` and `spread_over_new`, for "
        "the layouts the command names. The runs move by about "
        "15% from one to the next on this machine (merged and per-call decode training batches "
        "the same way, yet their rollout phases differ by that much), so ratios within that are "
        "noise.",
    ),
    "protocol_run": (
        "A whole protocol run against the code before the speed-up",
        "one run of study 1's protocol as `sat-jax compare --grid stale` runs it (GSPO at the "
        "fixed lag of 4, seed 4, 300 steps, 13 evaluations of 512 held-out prompts x 8), one "
        "fresh process per case: `old` from a temporary worktree of the code as it was when the "
        "speed-up was asked for (`old_commit`), `new` from this checkout with an empty persistent "
        "compilation cache, `new_warm` on the cache `new` filled (a grid's later runs). Wall "
        "time of each process, start to exit; `new_over_old` and `new_warm_over_old` (< 1: "
        "faster) and `speedup_*` (old over new). The script refuses a case that did not log the "
        "same training steps and evaluations as `old`; `eval_max_abs_diff_old_new` is nonzero "
        "because the new evaluation draws with per-row keys. The same case's rounds can differ "
        "by a fifth on this machine: read the per-round walls beside the best-of ratios.",
    ),
    "grid_cache": (
        "A study grid with the persistent compilation cache",
        "two runs of one arm of the staleness protocol (grid `stale`, GSPO at the fixed lag, seeds "
        "4 and 5, reduced to `--steps` steps), one `sat-jax compare --grid` process per case: "
        "`off` (no persistent cache: each run compiles what its process has not), `cold` (an "
        "empty cache: the first run compiles and writes, the second loads) and `warm` (the same "
        "cache from a new process: both runs load). Wall time per run; "
        "`second_run_cold_over_off` (a grid's later runs), `first_run_warm_over_off` and "
        "`total_warm_over_off` (< 1: faster); `eval_max_abs_diff` between `off` and `warm`.",
    ),
    "device_checks": (
        "Accelerator: device against CPU",
        "the losses sharded over the real devices, the model's log-probs and the sampler's "
        "behaviour log-probs on the device, each against the CPU (`benchmarks/accelerator.sh`).",
    ),
    "device_trainer": (
        "Accelerator: trainer step",
        "the trainer step on a Qwen3-MoE-shaped model with random weights: tokens/s and model "
        "FLOP utilisation against the device's bfloat16 peak (`benchmarks/accelerator.sh`).",
    ),
    "transformers_model_pass": (
        "Against transformers (PyTorch)",
        "the training log-prob pass (forward + backward) and KV-cache decoding of "
        "`ModelConfig.tiny()`, ours against transformers' Qwen3-MoE on the same weights, in "
        "alternating rounds; `*_torch_over_ours` > 1 means ours is faster. Ours runs in two "
        "layouts: `scan` (the default `scan_unroll=1`, one compiled block body) and `unrolled` "
        "(`scan_unroll` = the 4 blocks, straight-line code; `*_unrolled_over_scan` < 1: faster). "
        "With more runnable "
        "processes than cores, torch runs one thread (`--torch-threads 1`): two spin-wait on "
        "each other there.",
    ),
    "scale": (
        "Qwen3-30B-A3B on a fake mesh",
        "the paper's model built abstractly on fake CPU devices: state bytes per device, lowering "
        "and compile time, XLA:CPU scratch of the train and decode steps, the TPU export.",
    ),
}

HEADER = """# Benchmarks

Written by `benchmarks/report.py` from `benchmarks/results/*.json` (`make bench`); do not edit by
hand. Each section is the latest run of one benchmark: its command, its provenance (commit, date,
machine, the 1-minute load average when it started and when it ended, JAX version) and its figures.
The development machine is shared with other work, so absolute times move between runs; compare
the ratios measured in the same run (paired rounds, named `*_over_*`, `speedup` or `ratio`).
`benchmarks/README.md` says what each script measures and how long it takes.
"""


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v == 0 or 1e-3 <= abs(v) < 1e6:
            return f"{v:,.4g}" if abs(v) >= 1000 else f"{v:.4g}"
        return f"{v:.3g}"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, list) and all(not isinstance(x, (dict, list)) for x in v):
        return ", ".join(_fmt(x) for x in v)
    if v is None:
        return "—"
    return str(v).replace("|", "\\|").replace("\n", " ")


def _scalar(v) -> bool:
    return not isinstance(v, (dict, list)) or (
        isinstance(v, list) and all(not isinstance(x, (dict, list)) for x in v)
    )


def _row_table(rows: list[dict]) -> list[str]:
    cols = []
    for r in rows:
        cols += [k for k in r if k not in cols and _scalar(r[k])]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return lines


def _tables(obj: dict, title: str = "") -> list[str]:
    """A key | value table of the scalars of ``obj``, then one table per nested part: a list of
    records or a mapping of records becomes a table with a row each, other mappings recurse."""
    out, scalars, nested = [], {}, {}
    for k, v in obj.items():
        (scalars if _scalar(v) else nested)[k] = v
    if scalars:
        if title:
            out += [f"**{title}**", ""]
        out += ["| figure | value |", "|---|---|"]
        out += [f"| {k} | {_fmt(v)} |" for k, v in scalars.items()]
        out.append("")
    for k, v in nested.items():
        name = f"{title} / {k}" if title else k
        if isinstance(v, list) and all(isinstance(x, dict) for x in v):
            out += [f"**{name}**", "", *_row_table(v), ""]
        elif (
            isinstance(v, dict)
            and v
            and all(isinstance(x, dict) and all(_scalar(y) for y in x.values()) for x in v.values())
        ):
            rows = [{"case": key, **rec} for key, rec in v.items()]
            out += [f"**{name}**", "", *_row_table(rows), ""]
        elif isinstance(v, dict):
            out += _tables(v, name)
        else:
            out += [f"**{name}**", "", "```", json.dumps(v), "```", ""]
    return out


def provenance_line(p: dict) -> str:
    load = p.get("load_average", [])
    load_text = " → ".join(f"{x:g}" for x in load) if load else "unknown"
    parts = [
        f"commit `{p.get('commit', '?')}`",
        p.get("date", "?"),
        p.get("machine", "?"),
        f"load average {load_text}",
        f"JAX {p.get('jax', '?')} ({p.get('backend', '?')})",
        f"Python {p.get('python', '?')}",
    ]
    if p.get("glibc_tunables"):
        parts.append(f"`GLIBC_TUNABLES={p['glibc_tunables']}`")
    return "*" + "; ".join(parts) + ".*"


def render(records: list[dict]) -> str:
    order = {name: i for i, name in enumerate(ABOUT)}
    records = sorted(records, key=lambda r: (order.get(r["benchmark"], len(order)), r["benchmark"]))
    lines = [HEADER]
    if records:
        for r in records:
            title = ABOUT.get(r["benchmark"], (r["benchmark"], ""))[0]
            anchor = title.lower().replace(" ", "-")
            anchor = "".join(c for c in anchor if c.isalnum() or c in "-_")
            lines.append(f"* [{title}](#{anchor}) (`{r['benchmark']}`)")
        lines.append("")
    for r in records:
        title, what = ABOUT.get(r["benchmark"], (r["benchmark"], ""))
        lines += [f"## {title}", ""]
        if what:
            lines += [what[0].upper() + what[1:], ""]
        lines += ["```bash", r["command"], "```", "", provenance_line(r["provenance"]), ""]
        if r.get("note"):
            lines += [r["note"], ""]
        lines += _tables(r["result"])
    return "\n".join(lines).rstrip() + "\n"


def load(folder: str) -> list[dict]:
    records = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            record = json.load(f)
        for key in ("benchmark", "command", "provenance", "result"):
            if key not in record:
                raise ValueError(f"{path}: not a benchmark result (no {key!r})")
        records.append(record)
    return records


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    ap.add_argument("--check", action="store_true", help="fail if --out is not up to date")
    args = ap.parse_args()
    text = render(load(args.results))
    if args.check:
        with open(args.out) as f:
            if f.read() != text:
                print(f"{args.out} is out of date: run benchmarks/report.py", file=sys.stderr)
                return 1
        return 0
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(args.out)} from {len(load(args.results))} results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
