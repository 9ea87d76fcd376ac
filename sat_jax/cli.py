"""``sat-jax``: train | eval | plot | compare.

    sat-jax train                                   # built-in default: SAT-GSPO w/ R3, lag 8
    sat-jax train --config configs/grpo.py --config.lag=8 --config.seed=1 --workdir runs/x
    sat-jax eval --workdir runs/x                   # held-out pass@1 of the latest checkpoint
    sat-jax plot runs/x                             # PNG plots into runs/x/plots
    sat-jax compare runs/a runs/b --key=eval/pass@1 --out=compare.png

Every ``--config.KEY=VALUE`` override is checked against the config before anything runs: an
unknown key or an impossible setting is one error message, not a stack trace after compiling.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

import sat_jax.default_config as default_config_module

COMMANDS = ("train", "eval", "plot", "compare")

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    default=default_config_module.__file__,
    help_string="ml_collections config file (default: the built-in SAT-GSPO w/ R3 run).",
    lock_config=True,
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (overrides config.workdir).")
_MAX_STEPS = flags.DEFINE_integer("max_steps", None, "Stop after this many steps this session.")
_MULTIHOST = flags.DEFINE_enum("multihost", "auto", ["auto", "on", "off"],
                               "Initialise jax.distributed for a multi-host slice.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0 (multi-slice / non-TPU clusters).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Explicit process count.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Explicit process id.")
_KEY = flags.DEFINE_string("key", "eval/pass@1", "Metric to overlay (compare).")
_OUT = flags.DEFINE_string("out", "compare.png", "Output PNG (compare).")


def _fail(msg: str) -> int:
    print(f"sat-jax: error: {msg}", file=sys.stderr)
    return 2


def _config():
    config = _CONFIG.value
    if _WORKDIR.value:
        with config.unlocked():
            config.workdir = _WORKDIR.value
    return config


def main(argv):
    # orbax and absl log every checkpoint operation at INFO; a user wants the progress line.
    logging.set_verbosity(logging.WARNING)
    args = argv[1:]
    command = args[0] if args else "train"
    if command not in COMMANDS:
        return _fail(f"unknown command {command!r}; expected one of {COMMANDS}")
    rest = args[1:]

    if command in ("plot", "compare"):
        from sat_jax.logging import plot_compare, plot_run

        if not rest:
            return _fail(f"{command} needs run directories")
        missing = [d for d in rest if not os.path.isdir(d)]
        if missing:
            return _fail(f"not a run directory: {', '.join(missing)}")
        if command == "plot":
            for run in rest:
                for path in plot_run(run):
                    print(path)
        else:
            print(plot_compare(rest, _KEY.value, _OUT.value))
        return 0

    if rest:
        return _fail(f"unexpected arguments {rest}")
    from sat_jax import parallel

    parallel.maybe_initialize_distributed(_MULTIHOST.value, _COORDINATOR.value,
                                          _NUM_PROCESSES.value, _PROCESS_ID.value)
    import jax

    config = _config()
    try:
        default_config_module.validate(config, num_devices=jax.device_count(),
                                    num_processes=jax.process_count())
    except ValueError as e:
        return _fail(str(e))

    from sat_jax.rl import learner

    if command == "eval":
        result = learner.evaluate_run(config)
        if parallel.is_primary():
            print(json.dumps(result, indent=1))
        return 0

    summary = learner.train(config, max_steps=_MAX_STEPS.value)
    if parallel.is_primary():
        hist = summary["history"]
        first = hist[0]["train/reward_mean"] if hist else float("nan")
        last = sum(h["train/reward_mean"] for h in hist[-10:]) / max(len(hist[-10:]), 1)
        print(json.dumps({
            "workdir": summary["workdir"],
            "steps": [summary["start_step"], summary["end_step"]],
            "interrupted": summary["interrupted"],
            "wall_seconds": round(summary["wall_seconds"], 1),
            "train_reward_first_step": first,
            "train_reward_last10_mean": last,
            "final_eval": summary["final_eval"],
        }, indent=1))
    return 130 if summary["interrupted"] else 0


def run():
    """Console-script entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
