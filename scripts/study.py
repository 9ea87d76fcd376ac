"""A small seeded study: methods × seeds at one lag. A thin wrapper over ``sat-jax compare
--grid`` (sat_jax/study), kept for old command lines:

    python scripts/study.py --configs sat_gspo_r3,gspo_r3,grpo --seeds 3 --lag 8 --out runs/study

runs the same as

    sat-jax compare --grid core --methods sat_gspo_r3,gspo_r3,grpo --baseline grpo --seeds 3 \\
        --lags 8 --out runs/study

(resumable; writes runs/study/results.md, results.csv and plots). ``--seeds`` takes a count or
the list 0,1,…,N−1; ``--steps N`` is ``--set num_steps=N``.
"""

from __future__ import annotations

import argparse
import sys

from sat_jax import cli
from sat_jax.study.grid import apply_override


def _override(config, item: str) -> None:
    """Sets a dotted config field from ``KEY=VALUE`` (``sat_jax.study.grid.apply_override``)."""
    try:
        apply_override(config, item)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def _seed_count(text: str) -> int:
    items = [int(s) for s in text.split(",")]
    if len(items) == 1:
        return items[0]
    if items != list(range(len(items))):
        raise SystemExit(f"--seeds must be a count or 0,1,...,N-1, got {text!r}")
    return len(items)


def argv(args) -> list[str]:
    """The ``sat-jax compare --grid`` command line of these arguments."""
    methods = args.configs.split(",")
    out = ["compare", "--grid=core", f"--methods={args.configs}",
           f"--baseline={'grpo' if 'grpo' in methods else methods[0]}",
           f"--seeds={_seed_count(args.seeds)}", f"--lags={args.lag}",
           f"--lag_mode={args.lag_mode}", f"--out={args.out}"]
    if args.steps:
        out.append(f"--set=num_steps={args.steps}")
    return out + [f"--set={item}" for item in args.set]


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="sat_gspo_r3,gspo_r3,grpo")
    p.add_argument("--seeds", default="3")
    p.add_argument("--lag", type=int, default=8)
    p.add_argument("--lag_mode", default="broadcast")
    p.add_argument("--steps", type=int, default=0, help="0: the config's num_steps")
    p.add_argument("--out", default="runs/study")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. --set optim.learning_rate=3e-4 (repeatable)")
    sys.argv = ["sat-jax", *argv(p.parse_args())]
    cli.run()


if __name__ == "__main__":
    main()
