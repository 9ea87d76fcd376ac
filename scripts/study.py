"""A small seeded study on the built-in task: methods × seeds at one lag; prints JSON.

    python scripts/study.py --configs sat_gspo_r3,gspo_r3,grpo --seeds 0,1,2 --lag 8

Each run is the config's full default schedule (built-in task, cached warm-up per seed). Reported
per method: final held-out pass@1 (mean ± std over seeds, and each seed), the mean training reward
of the last 50 steps, and the run-averaged mismatch d̄_π, SAT's q and binding rate.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import numpy as np

from sat_jax.rl import learner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _override(config, item: str) -> None:
    """Sets a dotted config field from ``KEY=VALUE``, parsed with the field's current type."""
    key, sep, raw = item.partition("=")
    if not sep:
        raise SystemExit(f"--set needs KEY=VALUE, got {item!r}")
    *path, leaf = key.split(".")
    node = config
    for part in path:
        node = node[part]
    if leaf not in node:
        raise SystemExit(f"--set: unknown config field {key!r}")
    current = node[leaf]
    if isinstance(current, bool):
        value = raw.lower() in ("1", "true", "yes")
    elif current is None:
        value = raw
    else:
        value = type(current)(raw)
    node[leaf] = value


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--configs", default="sat_gspo_r3,gspo_r3,grpo")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lag", type=int, default=8)
    p.add_argument("--lag_mode", default="broadcast")
    p.add_argument("--steps", type=int, default=0, help="0: the config's num_steps")
    p.add_argument("--out", default="runs/study")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. --set optim.learning_rate=3e-4 (repeatable)")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    result = {"lag_mode": args.lag_mode, "lag": args.lag, "seeds": seeds, "overrides": args.set,
              "methods": {}}
    for name in args.configs.split(","):
        finals, rewards, mismatch, q, binding = [], [], [], [], []
        for seed in seeds:
            c = load(name)
            c.seed, c.lag, c.lag_mode = seed, args.lag, args.lag_mode
            if args.steps:
                c.num_steps = args.steps
            for item in args.set:
                _override(c, item)
            tag = "".join(f"-{s.replace('=', '')}" for s in args.set)
            c.workdir = os.path.join(args.out,
                                     f"{name}-{args.lag_mode}{args.lag}{tag}-seed{seed}")
            c.resume = False
            c.log.progress = False
            summary = learner.train(c, quiet=True)
            hist = summary["history"]
            finals.append(summary["final_eval"]["pass@1"])
            rewards.append(float(np.mean([h["train/reward_mean"] for h in hist[-50:]])))
            mismatch.append(float(np.mean([h["loss/mismatch"] for h in hist])))
            if "loss/sat/q" in hist[0]:
                q.append(float(np.mean([h["loss/sat/q"] for h in hist])))
                binding.append(float(np.mean([h["loss/sat/binding_rate"] for h in hist])))
        entry = {
            "final_eval_pass@1_mean": float(np.mean(finals)),
            "final_eval_pass@1_std": float(np.std(finals, ddof=1)) if len(finals) > 1 else 0.0,
            "final_eval_pass@1_per_seed": finals,
            "train_reward_last50_mean": float(np.mean(rewards)),
            "mismatch_mean": float(np.mean(mismatch)),
        }
        if q:
            entry["sat_q_mean"] = float(np.mean(q))
            entry["sat_binding_rate_mean"] = float(np.mean(binding))
        result["methods"][name] = entry
        print(json.dumps({name: entry}), flush=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
