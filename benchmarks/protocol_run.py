"""A whole protocol run of study 1, the code before the speed-up work against the code here.

``benchmarks/study_run.py`` compares decode layouts inside today's code, so every change that
serves both layouts (the persistent compilation cache, the ring cache, the loss and sampler work)
is in its ``old`` too. This script measures what a user of the studies waits for: one run of the
staleness protocol as ``sat-jax compare --grid stale`` runs it (GSPO at the fixed lag of 4, seed 4,
300 steps, an evaluation every 25 steps on all 512 held-out prompts × 8), one fresh process per
case, from two checkouts of the repository:

* ``old``: ``--old REV`` checked out into a temporary git worktree (the code as it was when the
  speed-up was asked for; the JSON records the commit), run from there;
* ``new``: this checkout, with an empty persistent compilation cache (a first run: it compiles
  every program and writes it to the cache);
* ``new_warm``: this checkout again on the cache ``new`` filled (a grid's later runs and a resumed
  grid load their programs instead of compiling them).

Each case's wall time is the process's, start to exit (imports, build, the warm-up policy read
from its cache, compilation, training, evaluations, the report). The ratios ``new_over_old`` and
``new_warm_over_old`` (< 1: faster; the best round of each case) answer "how much faster is a
protocol run". The cases run in alternating order per round. Both checkouts must do the same work:
the script checks that each run logged the same training steps and evaluated at the same steps,
and reports the largest difference of a held-out metric between ``old`` and ``new`` (the new
evaluation draws its samples with per-row keys, so a small difference is expected) and between
``new`` and ``new_warm`` (a loaded program is the compiled one: 0).

The warm-up policies are trained on first use and cached in ``~/.cache/sat_jax``, per checkout
(their cache keys differ): a one-step run of each checkout (``prime``, not timed) does that first.

From the repository root: ``PYTHONPATH=$PWD python benchmarks/protocol_run.py --old REV``
(about 16 minutes a round on a quiet 2-core machine once the warm-ups are cached, and 2
minutes of priming).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import _results
from grid_cache import compare_process, gspo_arm, held_out, max_abs_diff

from sat_jax.run.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("old", "new", "new_warm")


def _git(*args: str, cwd: str = ROOT) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def _protocol_run(tree: str, out: str, args, cache: str | None, steps: int | None = None) -> dict:
    """One ``compare --grid stale`` process of one run from the checkout ``tree``: its wall time
    and the run's logged steps and held-out metrics. ``cache`` None: the flag is not passed (the
    old code has no persistent cache)."""
    cmd = [sys.executable, "-c", "from sat_jax.cli import run; run()"]
    cmd += gspo_arm(out, args, 1, steps)
    if cache is not None:
        cmd.append(f"--compile_cache={cache}")
    wall = compare_process(cmd, cwd=tree, PYTHONPATH=tree)
    (run_dir,) = (os.path.join(out, "runs", d) for d in os.listdir(os.path.join(out, "runs")))
    return {
        "wall_s": wall,
        "train_steps": sorted(
            {r["step"] for r in read_metrics(run_dir) if "train/reward_mean" in r}
        ),
        "evals": held_out(run_dir),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the commit to compare against (git rev)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-prompts", type=int, default=512)
    ap.add_argument("--lag", type=int, default=4)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    old_commit = _git("rev-parse", "--verify", f"{args.old}^{{commit}}")
    out = {
        "config": f"grid stale, arm gspo, fixed lag {args.lag}, seed 4, {args.steps} steps, "
        f"eval every {args.eval_every} steps on {args.eval_prompts} prompts x 8; one "
        "compare --grid process per case",
        "old_commit": old_commit[:12],
        "rounds": args.rounds,
    }
    runs: dict[str, list[dict]] = {case: [] for case in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = os.path.join(tmp, "old-tree")
        _git("worktree", "add", "--detach", old_tree, old_commit)
        try:
            trees = {"old": old_tree, "new": ROOT}
            for name, tree in trees.items():  # the warm-ups, cached; not timed
                cache = None if name == "old" else ""
                _protocol_run(tree, os.path.join(tmp, f"prime-{name}"), args, cache, steps=1)
            for i in range(args.rounds):
                cache = os.path.join(tmp, f"xla-{i}")
                order = ("old", "new") if i % 2 == 0 else ("new", "old")
                for case in order:
                    tree = trees[case]
                    where = os.path.join(tmp, f"{case}-{i}")
                    runs[case].append(
                        _protocol_run(tree, where, args, None if case == "old" else cache)
                    )
                runs["new_warm"].append(
                    _protocol_run(ROOT, os.path.join(tmp, f"new_warm-{i}"), args, cache)
                )
        finally:
            _git("worktree", "remove", "--force", old_tree)
    for case in CASES:
        for run in runs[case]:
            if run["train_steps"] != runs["old"][0]["train_steps"] or set(run["evals"]) != set(
                runs["old"][0]["evals"]
            ):
                raise SystemExit(
                    f"{case} did not do the old run's work: steps {run['train_steps'][-1:]} and "
                    f"{len(run['evals'])} held-out figures against "
                    f"{runs['old'][0]['train_steps'][-1:]} and {len(runs['old'][0]['evals'])}"
                )
    best = {case: min(r["wall_s"] for r in runs[case]) for case in CASES}
    for case in CASES:
        out[case] = {
            "wall_s_per_round": [round(r["wall_s"], 1) for r in runs[case]],
            "best_wall_s": round(best[case], 1),
            "final_pass@1": runs[case][0]["evals"].get((args.steps, "eval/pass@1")),
        }
    out["new_over_old"] = round(best["new"] / best["old"], 3)
    out["new_warm_over_old"] = round(best["new_warm"] / best["old"], 3)
    out["speedup_new"] = round(best["old"] / best["new"], 3)
    out["speedup_new_warm"] = round(best["old"] / best["new_warm"], 3)
    out["evaluations"] = len({step for step, _ in runs["old"][0]["evals"]})
    out["eval_max_abs_diff_old_new"] = max_abs_diff(
        runs["old"][0]["evals"], runs["new"][0]["evals"]
    )
    out["eval_max_abs_diff_new_warm"] = max_abs_diff(
        runs["new"][0]["evals"], runs["new_warm"][0]["evals"]
    )
    _results.write("protocol_run", out)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
