"""The staleness testbed's RL loop with each rollout engine: steps/s, where a step's time goes
(rollout against train), and the static engine's decode work on rows already finished.

Runs the ``stale_sort`` preset (digit sorting with 16, 24 or 32 digits, responses of 17, 25 or 33
tokens; the 4-block 64-expert MoE; GRPO at broadcast lag 1, the phase-1 base arm) for ``--steps``
RL steps from its cached warm-up, once with the static engine and once with the continuous one
(``--slots`` decode slots for the step's 64 sequences, a harvest every ``--harvest-every`` decode
steps), alternating ``--rounds`` times, and prints one JSON object. Both runs of a round start from
the same warm-up, prompts and sampling keys, so they decode the same tokens (the engines'
outputs agree to float rounding) and the comparison is of the engines alone. Steady-state
figures skip the first ``WARMUP_STEPS`` steps (compilation). No evaluation runs: a phase-1 run's
held-out evaluations (every 50 steps, 512 prompts × 8) are timed by its own ``time/eval_s``.

``finished_row_share`` is ``rollout/finished_row_share``: the share of a batch's rows × longest
response decode grid after a row's EOS, the static engine's decode work on finished rows (for
the continuous engine's batches it is what a static batch would have spent; its slots are
refilled instead).

Run from the repository root: ``PYTHONPATH=$PWD python benchmarks/testbed_loop.py
[--steps 40 --rounds 2 --slots 32]``; the warm-up (600 supervised steps, a few minutes) is
trained on the first run and cached in ``~/.cache/sat_jax``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import _results
import jax
import numpy as np

from sat_jax.study.grid import method_config
from sat_jax.train import learner

WARMUP_STEPS = 5


def _config(workdir: str, steps: int, engine: str, slots: int, harvest_every: int):
    c = method_config("grpo", "stale_sort")
    c.workdir = workdir
    c.num_steps = steps
    c.lag_mode, c.lag = "broadcast", 1
    c.rollout.engine = engine
    if engine == "continuous":
        c.rollout.num_slots, c.rollout.harvest_every = slots, harvest_every
    c.eval.every = 0
    c.checkpoint.every = 0
    c.log.plots = c.log.tensorboard = c.log.progress = False
    c.resume = False
    return c


def run(engine: str, args, workdir: str) -> dict:
    c = _config(workdir, args.steps, engine, args.slots, args.harvest_every)
    t0 = time.perf_counter()
    summary = learner.train(c, quiet=True)
    wall = time.perf_counter() - t0
    hist = summary["history"][WARMUP_STEPS:]

    def median(key):
        return float(np.median([h[key] for h in hist]))

    step_s = np.array([h["time/step_s"] for h in hist])
    tokens = np.array([h["train/tokens"] for h in hist])
    return {
        "steps_measured": len(hist),
        "trainer_steps_per_s": float(1.0 / np.median(step_s)),
        "median_step_ms": median("time/step_s") * 1e3,
        "median_rollout_ms": median("time/rollout_s") * 1e3,
        "median_train_ms": median("time/train_s") * 1e3,
        "rollout_share_of_step": float(np.sum([h["time/rollout_s"] for h in hist]) / step_s.sum()),
        "rollout_tokens_per_s": float(tokens.sum() / np.sum([h["time/rollout_s"] for h in hist])),
        "mean_response_len": float(np.mean([h["train/response_len"] for h in hist])),
        "finished_row_share": float(np.mean([h["rollout/finished_row_share"] for h in hist])),
        "wall_s_including_compile": round(wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two engines")
    ap.add_argument("--slots", type=int, default=32, help="continuous engine decode slots")
    ap.add_argument("--harvest-every", type=int, default=4, help="continuous engine window")
    args = ap.parse_args()
    if args.steps <= WARMUP_STEPS:
        ap.error(f"--steps must exceed the {WARMUP_STEPS} steps skipped as compilation")
    rounds: dict[str, list[dict]] = {"static": [], "continuous": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for engine in rounds:
                rounds[engine].append(run(engine, args, os.path.join(tmp, f"{engine}{i}")))
    best = {e: max(rs, key=lambda r: r["trainer_steps_per_s"]) for e, rs in rounds.items()}
    rollout_ratio = [
        s["median_rollout_ms"] / c["median_rollout_ms"]
        for s, c in zip(rounds["static"], rounds["continuous"], strict=True)
    ]
    out = {
        "config": "stale_sort preset, GRPO, broadcast lag 1, 8 prompts x 8 samples, "
        f"{args.steps} steps, continuous: {args.slots} slots, harvest every "
        f"{args.harvest_every}",
        "jax": jax.__version__,
        "rounds": args.rounds,
        "static": best["static"],
        "continuous": best["continuous"],
        "rollout_time_static_over_continuous_per_round": [round(r, 3) for r in rollout_ratio],
        "per_round": rounds,
    }
    _results.write("testbed_loop", out)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
