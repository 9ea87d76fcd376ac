"""A study grid's runs with and without JAX's persistent compilation cache (``--compile_cache``).

Each case is one fresh ``sat-jax compare --grid stale`` process of two runs of one arm (GSPO at
the fixed lag, seeds 4 and 5; ``--steps`` steps, an evaluation every ``--eval-every`` steps of
``--eval-prompts`` prompts × 8), as a grid runs them (the trainer step shared between runs of
one arm, ``--share_compilation``):

* ``off``: ``--compile_cache=''``, the old path: each run compiles what the process has not;
* ``cold``: a fresh, empty cache: the first run compiles and writes every program, the second
  loads them;
* ``warm``: the same cache again, from a new process: both runs load every program (a grid
  resumed, or study 2's next invocation on the same code).

Per case it prints each run's wall time (``wall_s`` of ``results.csv``: build, warm-up from its
cache, compile, training, evaluations) and the ratios ``second_run_cold_over_off`` (a grid's
later runs) and ``first_run_warm_over_off`` (a new process on a warm cache) and
``total_warm_over_off``; below 1 the cache is faster. ``eval_max_abs_diff`` is the largest
difference of a held-out metric between the ``off`` and ``warm`` runs of a seed (a loaded
program is the compiled one, so 0 is expected). The warm-ups of seeds 4 and 5 are trained on
first use and cached in ``~/.cache/sat_jax``: a one-step grid (``prime``, not timed) does that
before the cases.

From the repository root: ``PYTHONPATH=$PWD python benchmarks/grid_cache.py [--steps 50]``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

import _results

from sat_jax.run.metrics import read_metrics

CASES = ("off", "cold", "warm")


def gspo_arm(out: str, args, seeds: int, steps: int | None = None) -> list[str]:
    """``sat-jax compare``'s arguments for the ``stale`` grid's GSPO arm at ``args.lag`` on
    ``seeds`` seeds, reduced to ``steps`` (default ``args.steps``) steps and ``args``'s
    evaluation schedule."""
    return [
        "compare",
        "--grid=stale",
        f"--out={out}",
        "--methods=gspo",
        "--baseline=gspo",
        f"--lags={args.lag}",
        f"--seeds={seeds}",
        f"--set=num_steps={steps or args.steps}",
        f"--set=eval.every={args.eval_every}",
        f"--set=eval.num_prompts={args.eval_prompts}",
    ]


def compare_process(cmd: list[str], cwd: str | None = None, **env: str) -> float:
    """Runs one ``sat-jax compare`` process (JAX's cache variables dropped from the environment,
    ``env`` added); its wall time in seconds. Exits with the command's stderr if it failed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")} | env
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} (in {cwd or os.getcwd()}) failed:\n{res.stderr[-4000:]}")
    return wall


def held_out(run_dir: str) -> dict[tuple[int, str], float]:
    """A run's held-out metrics by (step, name); ``eval/num_prompts`` is left out (a setting, and
    older code does not log it)."""
    return {
        (rec["step"], k): v
        for rec in read_metrics(run_dir)
        for k, v in rec.items()
        if k.startswith("eval/") and k != "eval/num_prompts"
    }


def max_abs_diff(a: dict, b: dict) -> float:
    """The largest difference between two runs' ``held_out`` metrics (``b`` holds every key of
    ``a``)."""
    return max(abs(a[key] - b[key]) for key in a)


def _grid(out: str, cache: str, args, steps: int | None = None) -> list[dict]:
    """One ``compare --grid`` process; its runs' rows of results.csv, seed order."""
    arm = gspo_arm(out, args, 2, steps)
    compare_process([sys.executable, "-m", "sat_jax.cli", *arm, f"--compile_cache={cache}"])
    with open(os.path.join(out, "results.csv"), newline="") as f:
        rows = sorted(csv.DictReader(f), key=lambda r: int(r["seed"]))
    for r in rows:
        r["evals"] = held_out(os.path.join(out, r["run_dir"]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-prompts", type=int, default=512)
    ap.add_argument("--lag", type=int, default=4)
    args = ap.parse_args()
    out = {
        "config": f"grid stale, arm gspo, fixed lag {args.lag}, seeds 4 and 5, {args.steps} "
        f"steps, eval every {args.eval_every} steps on {args.eval_prompts} prompts x 8; one "
        "compare --grid process per case",
    }
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "xla")
        _grid(os.path.join(tmp, "prime"), "", args, steps=1)  # the seeds' warm-ups, cached
        rows = {
            case: _grid(os.path.join(tmp, case), "" if case == "off" else cache, args)
            for case in CASES
        }
        out["cache_files"] = len(os.listdir(cache))
    for case in CASES:
        out[case] = {
            "wall_s": [round(float(r["wall_s"]), 2) for r in rows[case]],
            "seeds": [int(r["seed"]) for r in rows[case]],
        }

    def wall(case, i):
        return float(rows[case][i]["wall_s"])

    out["second_run_cold_over_off"] = round(wall("cold", 1) / wall("off", 1), 3)
    out["first_run_warm_over_off"] = round(wall("warm", 0) / wall("off", 0), 3)
    out["total_warm_over_off"] = round(
        (wall("warm", 0) + wall("warm", 1)) / (wall("off", 0) + wall("off", 1)), 3
    )
    pairs = zip(rows["off"], rows["warm"], strict=True)
    out["eval_max_abs_diff"] = max(max_abs_diff(off["evals"], warm["evals"]) for off, warm in pairs)
    _results.write("grid_cache", out)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
