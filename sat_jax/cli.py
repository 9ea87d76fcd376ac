"""``sat-jax``: train | eval | config | plot | compare.

    sat-jax train                                   # built-in default: SAT-GSPO w/ R3, lag 8
    sat-jax train --config configs/grpo.py --config.lag=8 --config.seed=1 --workdir runs/x
    sat-jax eval --workdir runs/x                   # held-out pass@1 of the latest checkpoint
    sat-jax config --config configs/grpo.py         # every config key with its value, checked
    sat-jax plot runs/x                             # PNG plots into runs/x/plots
    sat-jax compare runs/a runs/b --key=eval/pass@1 --out=compare.png

Every ``--config.KEY=VALUE`` override is checked against the config before anything runs: an
unknown key or an impossible value is one ``sat-jax: error: ...`` line and exit status 2, not a
stack trace after compiling. ``sat-jax``, ``sat-jax --help`` and ``sat-jax COMMAND --help`` print
the help (exit 0; ``sat-jax`` alone exits 2, as a command line missing its command).
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

import sat_jax.default_config as default_config_module

#: Command -> one line of help.
COMMANDS = {
    "train": "train (or resume) a run in --workdir",
    "eval": "held-out pass@1 / avg@G / pass@G of the latest checkpoint in --workdir",
    "config": "print the resolved config (every key, overrides applied) and check it",
    "plot": "write PNG plots of run directories: sat-jax plot RUN_DIR...",
    "compare": "overlay --key across runs (seeds as mean ± std): sat-jax compare RUN_DIR...",
}
_HELP_WORDS = ("-h", "--help", "-help", "--helpfull", "help")


def _define_config():
    """The --config flag. ml_collections applies the overrides in sys.argv to the default
    config while defining it, so an unknown key fails here, at import: it is kept and reported
    by ``run`` as one error line, and the flag is defined without the bad overrides."""
    kwargs = dict(default=default_config_module.__file__, lock_config=True,
                  help_string="ml_collections config file (default: the built-in SAT-GSPO w/ "
                  "R3 run).")
    try:
        return config_flags.DEFINE_config_file("config", **kwargs), None
    except (AttributeError, KeyError) as e:
        return config_flags.DEFINE_config_file("config", sys_argv=sys.argv[:1], **kwargs), e


_CONFIG, _DEFINE_ERROR = _define_config()
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

# Flags shown by --help, per command (every command takes --config and --config.KEY=VALUE).
_COMMAND_FLAGS = {
    "train": ("workdir", "max_steps", "multihost", "coordinator_address", "num_processes",
              "process_id"),
    "eval": ("workdir", "multihost", "coordinator_address", "num_processes", "process_id"),
    "config": ("workdir",),
    "plot": (),
    "compare": ("key", "out"),
}


def usage(command: str | None = None) -> str:
    """The help text of ``sat-jax`` or of one command."""
    lines = [f"usage: sat-jax {command or 'COMMAND'} [--config FILE] [--config.KEY=VALUE ...] "
             "[flags]" + (" RUN_DIR..." if command in ("plot", "compare") else ""), ""]
    if command is None:
        lines.append("commands:")
        lines += [f"  {name:<9}{text}" for name, text in COMMANDS.items()]
        lines.append("")
        names = sorted({f for fs in _COMMAND_FLAGS.values() for f in fs})
    else:
        lines += [COMMANDS[command], ""]
        names = _COMMAND_FLAGS[command]
    lines.append("flags:")
    lines.append(f"  {'--config FILE':<34}{flags.FLAGS['config'].help}")
    lines.append(f"  {'--config.KEY=VALUE':<34}override one config field, e.g. --config.lag=1")
    for name in names:
        flag = flags.FLAGS[name]
        default = "" if flag.default is None else f" (default: {flag.default})"
        lines.append(f"  {'--' + name:<34}{flag.help}{default}")
    lines += [
        "",
        "config keys: `sat-jax config` prints every key with its default (add --config FILE for",
        "a method config from configs/); sat_jax/default_config.py documents them. Impossible",
        "values stop with `sat-jax: error: invalid config: ...` (exit 2) before any compute.",
    ]
    return "\n".join(lines)


def _help_request(args: list[str]) -> tuple[str | None, int] | None:
    """(command or None, exit status) when ``args`` ask for help or name no command."""
    words = [a for a in args if not a.startswith("-")]
    command = words[0] if words and words[0] in COMMANDS else None
    if any(a in _HELP_WORDS for a in args):
        return command, 0
    if not words:
        return None, 2
    return None


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
    """Runs one command; ``argv`` as left by absl's flag parsing (program name first)."""
    # orbax and absl log every checkpoint operation at INFO; a user wants the progress line.
    logging.set_verbosity(logging.WARNING)
    args = argv[1:]
    status = print_help(args)
    if status is not None:
        return status
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        return _fail(f"unknown command {command!r}; expected one of {tuple(COMMANDS)} "
                     "(sat-jax --help)")

    if command in ("plot", "compare"):
        from sat_jax.plots import plot_compare, plot_run

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

    from sat_jax.rl.config import ConfigError, validate

    config = _config()
    if command == "config":
        print(config)
    try:
        validate(config, num_devices=jax.device_count(), num_processes=jax.process_count())
    except ConfigError as e:
        return _fail(str(e))
    if command == "config":
        return 0

    from sat_jax.rl import learner

    if command == "eval":
        result = learner.evaluate_run(config)
        if parallel.is_primary():
            print(json.dumps(result, indent=1))
        return 0

    try:
        summary = learner.train(config, max_steps=_MAX_STEPS.value)
    except learner.ResumeError as e:
        return _fail(str(e))
    if parallel.is_primary():
        hist = summary["history"]
        first = hist[0]["train/reward_mean"] if hist else float("nan")
        last = sum(h["train/reward_mean"] for h in hist[-10:]) / max(len(hist[-10:]), 1)
        print(json.dumps({
            "workdir": summary["workdir"],
            "steps": [summary["start_step"], summary["end_step"]],
            "finished_before": summary["finished"],
            "interrupted": summary["interrupted"],
            "wall_seconds": round(summary["wall_seconds"], 1),
            "train_reward_first_step": first,
            "train_reward_last10_mean": last,
            "final_eval": summary["final_eval"],
        }, indent=1))
    return 130 if summary["interrupted"] else 0


def print_help(args: list[str]) -> int | None:
    """Prints the help and returns the exit status when ``args`` ask for it (or name no
    command); ``None`` otherwise."""
    asked = _help_request(args)
    if asked is None:
        return None
    print(usage(asked[0]))
    return asked[1]


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a bad flag or config key as one error line and exit 2."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        sys.exit(_fail(f"{e} (sat-jax --help)"))
    except (AttributeError, KeyError) as e:  # ml_collections: a key the config does not have
        sys.exit(_fail(_unknown_key(e)))


def _unknown_key(error) -> str:
    key = str(error).strip("\"'")
    return f"unknown config key {key!r} (sat-jax config lists the keys)"


def run():
    """Console-script entry point: help before absl's flag parsing, then the command."""
    status = print_help(sys.argv[1:])
    if status is not None:
        sys.exit(status)
    if _DEFINE_ERROR is not None:
        sys.exit(_fail(_unknown_key(_DEFINE_ERROR)))
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
