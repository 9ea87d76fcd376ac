"""Host-loop benchmark: trainer steps/s, rollout tokens/s, host overhead, stream vs broadcast.

Runs the built-in default (tiny MoE, 2-digit addition, SAT-GSPO w/ R3) for a few dozen steps in
``broadcast`` and in ``stream`` mode at the same settings and prints one JSON object. Steady-state
figures skip the first steps (compilation). Run: ``python benchmarks/loop.py [--steps 40]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import jax
import numpy as np

from sat_jax import default_config
from sat_jax.rl import learner

WARMUP_STEPS = 5


def run(mode: str, steps: int, lag: int, workdir: str) -> dict:
    c = default_config.get_config()
    c.workdir = workdir
    c.num_steps = steps
    c.lag_mode, c.lag = mode, lag
    c.eval.every = 0
    c.checkpoint.every = 0
    c.log.plots = c.log.tensorboard = c.log.progress = False
    c.resume = False
    t0 = time.perf_counter()
    summary = learner.train(c, quiet=True)
    wall = time.perf_counter() - t0
    hist = summary["history"][WARMUP_STEPS:]
    step_s = np.array([h["time/step_s"] for h in hist])
    tokens = np.array([h["train/tokens"] for h in hist])
    out = {
        "steps_measured": len(hist),
        "trainer_steps_per_s": float(1.0 / np.median(step_s)),
        "rollout_tokens_per_s": float(tokens.sum() / step_s.sum()),
        "median_step_ms": float(np.median(step_s) * 1e3),
        "median_train_ms": float(np.median([h["time/train_s"] for h in hist]) * 1e3),
        "wall_s_including_compile": round(wall, 1),
        "mean_lag": float(np.mean([h["lag/mean"] for h in hist])),
        "final_reward_mean": float(np.mean([h["train/reward_mean"] for h in hist[-10:]])),
    }
    if mode != "stream":
        share = np.array([h["time/outside_compiled_share"] for h in hist])
        out["outside_compiled_share"] = float(np.sum(share * step_s) / step_s.sum())
    else:
        out["mean_queue_wait_ms"] = float(np.mean([h["time/queue_wait_s"] for h in hist]) * 1e3)
        out["weight_swaps_mid_decode"] = hist[-1].get("stream/swaps", 0.0)
        out["mean_pqs"] = float(np.mean([h["lag/pqs_mean"] for h in hist]))
        out["mean_iqs"] = float(np.mean([h["lag/iqs_mean"] for h in hist]))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lag", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        broadcast = run("broadcast", args.steps, args.lag, os.path.join(tmp, "broadcast"))
        stream = run("stream", args.steps, args.lag, os.path.join(tmp, "stream"))
    print(json.dumps({
        "benchmark": "loop",
        "device": f"{jax.default_backend()} ({platform.machine()}, {os.cpu_count()} cores)",
        "jax": jax.__version__,
        "config": "default (tiny MoE, addition, SAT-GSPO w/ R3), 16 prompts x 8 samples",
        "lag": args.lag,
        "broadcast": broadcast,
        "stream": stream,
        "stream_over_broadcast_steps_per_s": round(
            stream["trainer_steps_per_s"] / broadcast["trainer_steps_per_s"], 3),
    }, indent=1))


if __name__ == "__main__":
    main()
