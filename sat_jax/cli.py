"""``sat-jax``: train | eval | config | plot | compare.

    sat-jax train                                   # built-in default: SAT-GSPO w/ R3, lag 8
    sat-jax train --config configs/grpo.py --config.lag=8 --config.seed=1 --workdir runs/x
    sat-jax eval --workdir runs/x                   # held-out pass@1 of the latest checkpoint
    sat-jax config --config configs/grpo.py         # every config key with its value, checked
    sat-jax plot runs/x                             # PNG plots into runs/x/plots
    sat-jax compare runs/a runs/b --key=eval/pass@1 --out=compare.png
    sat-jax compare --grid core --seeds 5 --lags 1,8 --set num_steps=200 --out studies/core

Every ``--config.KEY=VALUE`` override is checked against the config before anything runs: an
unknown key or an impossible value is one ``sat-jax: error: ...`` line and exit status 2, not a
stack trace after compiling. ``sat-jax``, ``sat-jax --help`` and ``sat-jax COMMAND --help`` print
the help (exit 0; ``sat-jax`` alone exits 2, as a command line missing its command).
"""

from __future__ import annotations

import errno
import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

import sat_jax.config.defaults as defaults_module

#: Command -> one line of help.
COMMANDS = {
    "train": "train (or resume) a run in --workdir",
    "eval": "held-out pass@1 / avg@G / pass@G of the latest checkpoint in --workdir",
    "config": "print the resolved config (every key, overrides applied) and check it",
    "plot": "write PNG plots of run directories: sat-jax plot RUN_DIR...",
    "compare": "overlay --key across runs (seeds as mean ± std): sat-jax compare RUN_DIR...; "
    "or run a study grid (methods × lags × learning rates × seeds, resumable) and "
    "write DIR/results.md, results.csv and plots: sat-jax compare --grid NAME --out "
    "DIR (each method's config is configs/<method>.py's; --set KEY=VALUE changes "
    "every run, --config is not read)",
}
_HELP_WORDS = ("-h", "--help", "-help", "--helpfull", "help")


def _define_config():
    """The --config flag. ml_collections applies the overrides in sys.argv to the default
    config while defining it, so an unknown key fails here, at import: it is kept and reported
    by ``run`` as one error line, and the flag is defined without the bad overrides."""
    kwargs = dict(
        default=defaults_module.__file__,
        lock_config=True,
        help_string="ml_collections config file (default: the built-in SAT-GSPO w/ R3 run).",
    )
    try:
        return config_flags.DEFINE_config_file("config", **kwargs), None
    except (AttributeError, KeyError) as e:
        return config_flags.DEFINE_config_file("config", sys_argv=sys.argv[:1], **kwargs), e


_CONFIG, _DEFINE_ERROR = _define_config()
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (overrides config.workdir).")
# A path the run must write to that it cannot: the user's to fix, not a bug to trace.
_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST)
_MAX_STEPS = flags.DEFINE_integer("max_steps", None, "Stop after this many steps this session.")
_MULTIHOST = flags.DEFINE_enum(
    "multihost", "auto", ["auto", "on", "off"], "Initialise jax.distributed for a multi-host slice."
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 (multi-slice / non-TPU clusters)."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Explicit process count.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Explicit process id.")
_KEY = flags.DEFINE_string("key", "eval/pass@1", "Metric to overlay (compare).")
_OUT = flags.DEFINE_string(
    "out",
    "compare.png",
    "Output PNG (compare RUN_DIR...); the study directory (compare --grid, required).",
)
_GRID = flags.DEFINE_string(
    "grid",
    None,
    "Study grid to run: paper (Table 1's 13 methods), "
    "core (GRPO, GSPO, DPPO, SAT-GRPO, SAT-GSPO; R3 as the paper's best "
    "runs), envelope (GRPO and SAT-GRPO over learning rate × lag), "
    "or a study file's grid (configs/studies/*.py): stale-phase0 (the staleness study's "
    "calibration), stale (its counted runs: docs/results/stale), stale-rerun (the same on "
    "seeds 12-19), stale2-calib (study 2's calibration: docs/results/stale2), stale2 (its "
    "counted runs) or stale2-rerun (the same on seeds 32-43).",
)
_SEEDS = flags.DEFINE_integer("seeds", None, "Seeds 0..N-1 per cell (compare --grid; default 3).")
_LAGS = flags.DEFINE_string(
    "lags", None, "Comma-separated lags (compare --grid; default 1,8, envelope 1,2,4,8)."
)
_LRS = flags.DEFINE_string(
    "lrs",
    None,
    "Comma-separated learning rates (compare --grid; "
    "default: the config's, envelope 1e-4,3e-4,1e-3).",
)
_METHODS = flags.DEFINE_string(
    "methods",
    None,
    "Comma-separated methods replacing the grid's (compare --grid), e.g. grpo,sat_grpo.",
)
_BASELINE = flags.DEFINE_string(
    "baseline",
    None,
    "Method the paired differences are against (compare --grid; default grpo, core: grpo_r3).",
)
_PRESET = flags.DEFINE_string(
    "preset",
    None,
    "Base run every method is swapped into (compare --grid; a name of "
    "sat_jax.config.presets.PRESETS, e.g. stale or stale_sort; default: the grid's).",
)
_LAG_MODE = flags.DEFINE_enum(
    "lag_mode",
    "broadcast",
    ["fixed", "broadcast", "sampled", "stream"],
    "Lag mode of every run (compare --grid; unset: the grid's own if it fixes one).",
)
_SET = flags.DEFINE_multi_string(
    "set",
    [],
    "KEY=VALUE config override for every run of the "
    "grid, repeatable (compare --grid), e.g. --set num_steps=200.",
)
_REPORT_ONLY = flags.DEFINE_boolean(
    "report_only",
    False,
    "Write results.md, results.csv and the plots from the runs already in --out, training none "
    "(compare --grid): read a grid run elsewhere, or one run in parts (--methods, --lags).",
)
_COMPILE_CACHE = flags.DEFINE_string(
    "compile_cache",
    os.path.join("~", ".cache", "sat_jax", "xla"),
    "Directory of JAX's persistent compilation cache (train, eval, compare --grid): later runs "
    "load the programs an earlier one compiled. Empty: off. JAX_COMPILATION_CACHE_DIR, when "
    "set, wins.",
)
_SHARE = flags.DEFINE_boolean(
    "share_compilation",
    True,
    "Reuse the jitted trainer step across runs with the same program (compare --grid).",
)
_KEEP_CHECKPOINTS = flags.DEFINE_boolean(
    "keep_checkpoints",
    True,
    "Keep each finished run's checkpoints (compare --grid). --nokeep_checkpoints deletes a run's "
    "checkpoint directory once its done.json is written: the report reads only the runs' logs, "
    "and a run's checkpoints (parameters, optimizer state and its lag's parameter snapshots) "
    "can take hundreds of MB each. Unfinished runs keep theirs, to resume from.",
)

# Flags shown by --help, per command (every command takes --config and --config.KEY=VALUE).
_COMMAND_FLAGS = {
    "train": (
        "workdir",
        "max_steps",
        "multihost",
        "coordinator_address",
        "num_processes",
        "process_id",
        "compile_cache",
    ),
    "eval": (
        "workdir",
        "multihost",
        "coordinator_address",
        "num_processes",
        "process_id",
        "compile_cache",
    ),
    "config": ("workdir",),
    "plot": (),
    "compare": (
        "key",
        "out",
        "grid",
        "seeds",
        "lags",
        "lrs",
        "methods",
        "baseline",
        "preset",
        "lag_mode",
        "set",
        "report_only",
        "share_compilation",
        "keep_checkpoints",
        "compile_cache",
    ),
}


def usage(command: str | None = None) -> str:
    """The help text of ``sat-jax`` or of one command."""
    lines = [
        f"usage: sat-jax {command or 'COMMAND'} [--config FILE] [--config.KEY=VALUE ...] "
        "[flags]"
        + {"plot": " RUN_DIR...", "compare": " RUN_DIR... | --grid NAME --out DIR"}.get(
            command, ""
        ),
        "",
    ]
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
        "a method config from configs/); sat_jax/config/defaults.py documents them. Impossible",
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


def _enable_compile_cache() -> int | None:
    """JAX's persistent compilation cache at ``--compile_cache`` (before anything compiles);
    the exit status of a bad value (one error line), else None."""
    from sat_jax.run import compile_cache

    try:
        compile_cache.enable(_COMPILE_CACHE.value)
    except (OSError, ValueError) as e:
        return _fail(f"--compile_cache: {e}")
    return None


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
        return _fail(
            f"unknown command {command!r}; expected one of {tuple(COMMANDS)} (sat-jax --help)"
        )

    if command == "compare" and _GRID.present:
        return compare_grid(rest)
    grid_only = [
        n
        for n in ("seeds", "lags", "lrs", "methods", "baseline", "set", "report_only")
        if flags.FLAGS[n].present
    ]
    if grid_only:
        return _fail(f"--{grid_only[0]} is a flag of compare --grid NAME")
    if command in ("plot", "compare"):
        from sat_jax.run.plots import plot_compare, plot_run

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
    if command in ("train", "eval") and (status := _enable_compile_cache()) is not None:
        return status
    from sat_jax import parallel

    parallel.maybe_initialize_distributed(
        _MULTIHOST.value, _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value
    )
    import jax

    from sat_jax.config.validation import ConfigError, validate

    config = _config()
    if command == "config":
        print(config)
    try:
        checked = validate(
            config, num_devices=jax.device_count(), num_processes=jax.process_count()
        )
    except ConfigError as e:
        return _fail(str(e))
    if command == "config":
        return 0

    from sat_jax.train import learner

    if command == "eval":
        try:
            result = learner.evaluate_run(config, checked=checked)
        except (
            FileNotFoundError,
            learner.ResumeError,
            learner.WorkdirNotShared,
            learner.WorkdirURLError,
        ) as e:
            return _fail(str(e))
        if parallel.is_primary():
            print(json.dumps(result, indent=1))
        return 0

    try:
        summary = learner.train(config, max_steps=_MAX_STEPS.value, checked=checked)
    except (
        learner.ResumeError,
        learner.WorkdirLocked,
        learner.WorkdirNotShared,
        learner.WorkdirURLError,
        ConfigError,  # data checked when built
    ) as e:
        return _fail(str(e))
    except (learner.NonFiniteError, learner.LockLost) as e:
        print(f"sat-jax: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno not in _UNWRITABLE:
            raise
        return _fail(
            f"cannot write {e.filename}: {e.strerror} (the workdir and sft.cache_dir must be "
            "writable directories)"
        )
    if parallel.is_primary():
        hist = summary["history"]
        first = hist[0]["train/reward_mean"] if hist else float("nan")
        last = sum(h["train/reward_mean"] for h in hist[-10:]) / max(len(hist[-10:]), 1)
        print(
            json.dumps(
                {
                    "workdir": summary["workdir"],
                    "steps": [summary["start_step"], summary["end_step"]],
                    "finished_before": summary["finished"],
                    "interrupted": summary["interrupted"],
                    "wall_seconds": round(summary["wall_seconds"], 1),
                    "train_reward_first_step": first,
                    "train_reward_last10_mean": last,
                    "final_eval": summary["final_eval"],
                },
                indent=1,
            )
        )
    if summary["interrupted"]:  # the shell's status for a process stopped by that signal
        return 128 + (summary["signal"] or 2)
    return 0


def compare_grid(rest: list[str]) -> int:
    """``sat-jax compare --grid NAME --out DIR``: runs (or resumes) the grid, writes the results.
    Every argument is checked, and every run's config validated, before anything trains."""
    import shlex
    import time

    import jax

    from sat_jax.config.validation import ConfigError, validate
    from sat_jax.study import grid as study_grid
    from sat_jax.study import report, runner
    from sat_jax.train import components, learner

    if rest:
        return _fail(f"compare --grid takes no run directories, got {rest}")
    if not _OUT.present:
        return _fail("compare --grid needs --out DIR (the study directory)")
    if any(flags.FLAGS[n].present for n in flags.FLAGS if n == "config" or n.startswith("config.")):
        return _fail(
            "compare --grid builds each method's config itself (configs/<method>.py); "
            "change fields with --set KEY=VALUE, not --config"
        )
    out = _OUT.value
    if os.path.isfile(out):
        return _fail(f"--out {out!r} is a file; compare --grid needs a directory")
    if not _REPORT_ONLY.value and (status := _enable_compile_cache()) is not None:
        return status
    try:
        lags = study_grid.parse_ints(_LAGS.value, "--lags") if _LAGS.value is not None else None
        lrs = study_grid.parse_floats(_LRS.value, "--lrs") if _LRS.value is not None else None
        methods = study_grid.parse_methods(_METHODS.value) if _METHODS.value is not None else None
        grid = study_grid.resolve(
            _GRID.value,
            seeds=_SEEDS.value,
            lags=lags,
            lrs=lrs,
            methods=methods,
            baseline=_BASELINE.value,
            preset=_PRESET.value,
        )
        # An explicit --lag_mode wins; else the grid's own (a protocol's), else the flag's default.
        lag_mode = _LAG_MODE.value if _LAG_MODE.present else grid.lag_mode or _LAG_MODE.value
        runs = study_grid.expand(grid, out, lag_mode=lag_mode, overrides=_SET.value)
        checked = {}  # workdir -> what validating the run's config built, handed to its run
        for spec, config in runs:
            try:
                checked[config.workdir] = validate(
                    config, num_devices=jax.device_count(), num_processes=jax.process_count()
                )
            except ConfigError as e:
                raise ValueError(f"run {spec.name}: {e}") from None
    except ValueError as e:
        return _fail(str(e))
    command = "sat-jax " + shlex.join(sys.argv[1:])
    shape = (
        f"{len(grid.methods)} methods × {len(grid.lags)} lags × "
        f"{len(grid.lrs or (None,))} learning rates × {grid.seeds} seeds"
        if not (grid.arm_lags or grid.arm_seeds)
        else f"{len(grid.methods)} methods, each at its own lags and seeds"
    )
    print(
        f"study {grid.name}: {len(runs)} runs ({shape}) in {out}",
        file=sys.stderr,
        flush=True,
    )
    sat_eps = [c.loss.eps_high for s, c in runs if s.method.startswith("sat_")]
    status, invocation = 0, None
    t0 = time.perf_counter()

    last = {"seconds": 0.0, "trained": [], "skipped": [], "failed": []}

    def write(progress, plots=True):
        last.update(progress)
        return report.write(
            out,
            grid,
            runs,
            command=command,
            lag_mode=lag_mode,
            overrides=_SET.value,
            invocation=progress,
            eps=sat_eps[0] if sat_eps else 0.2,
            plots=plots,
        )

    if _REPORT_ONLY.value:
        _print_paths(write({**last, "report_only": True}))
        return 0
    shared, components.SHARE_TRAIN_STEPS = components.SHARE_TRAIN_STEPS, _SHARE.value
    try:
        # results.md and results.csv after every run (plots at the end): a long grid can be read
        # while it runs.
        invocation = runner.run_all(
            runs,
            train=lambda config: learner.train(
                config, quiet=True, checked=checked.pop(config.workdir)
            ),
            fatal=learner.ResumeError,
            after_run=lambda progress: write(progress, plots=False),
            keep_checkpoints=_KEEP_CHECKPOINTS.value,
        )
        if invocation["failed"]:
            status = 1
    except runner.Interrupted:
        status = 130
    except runner.MixedCodeError as e:
        return _fail(str(e))
    except KeyboardInterrupt:  # outside the learner's loop (building, warm-up, compiling)
        print("interrupted: run the same command again to resume", file=sys.stderr)
        status = 130
    except learner.ResumeError as e:
        return _fail(
            f"{e} (the study directory holds runs of another config: use another --out "
            "or the same --set flags)"
        )
    finally:
        components.SHARE_TRAIN_STEPS = shared
    if invocation is None:  # interrupted: what the runs before it did
        invocation = {**last, "seconds": time.perf_counter() - t0}
    _print_paths(write(invocation))
    if invocation["failed"]:
        print(
            f"sat-jax: {len(invocation['failed'])} runs failed: "
            f"{', '.join(invocation['failed'])} (tracebacks in their error.txt)",
            file=sys.stderr,
        )
    return status


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


def _print_paths(written: dict) -> None:
    """The files a study report wrote, one per line."""
    for path in (written["md"], written["csv"], *written["plots"]):
        print(path)


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
    try:
        app.run(main, flags_parser=_parse_flags)
    except BrokenPipeError:  # `sat-jax config | head`: the reader left; not an error of ours
        # Python flushes stdout again at exit; point it at /dev/null so that flush cannot fail.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)


if __name__ == "__main__":
    run()
