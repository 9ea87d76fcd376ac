"""Running a grid: each run a normal training run in ``DIR/runs/<name>/``, finished runs skipped,
interrupted ones resumed from their checkpoint, with a progress line and a time estimate.

A run is *finished* when ``DIR/runs/<name>/done.json`` exists and records the same config (the
runner writes it after the learner returns from a run that reached ``num_steps``); anything else
is handed to the learner, which resumes from the latest checkpoint (``config.resume = True``) or
refuses a workdir holding another config (``learner.ResumeError``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

DONE_FILE = "done.json"


def _plain(config) -> dict:
    from sat_jax.rl.config import plain

    return json.loads(json.dumps(plain(config), default=str))


def is_finished(config) -> bool:
    """Whether ``config``'s run directory holds a finished run of this very config."""
    path = os.path.join(config.workdir, DONE_FILE)
    if not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            done = json.load(f)
    except (OSError, ValueError):
        return False
    from sat_jax.rl.config import changed_fields

    stored = done.get("config") or {}
    # changed_fields ignores the fields a resume may change (workdir, logging, ...) but num_steps
    # is among them: a run asked to go further is not finished.
    return not changed_fields(stored, config) and stored.get("num_steps") == config.num_steps


def mark_finished(config, summary: dict[str, Any]) -> None:
    os.makedirs(config.workdir, exist_ok=True)
    record = {"config": _plain(config), "wall_seconds": summary.get("wall_seconds"),
              "end_step": summary.get("end_step"), "final_eval": summary.get("final_eval")}
    tmp = os.path.join(config.workdir, DONE_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, os.path.join(config.workdir, DONE_FILE))


def run_wall_seconds(workdir: str) -> float | None:
    """The wall seconds recorded for a finished run (its last session), None if not finished."""
    try:
        with open(os.path.join(workdir, DONE_FILE), encoding="utf-8") as f:
            return json.load(f).get("wall_seconds")
    except (OSError, ValueError):
        return None


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def progress_line(done: int, total: int, elapsed: float, run_times: Sequence[float],
                  remaining: int) -> str:
    """``[3/12] elapsed 1m40s, ETA 4m50s (mean 33.4s per run over 3 runs)``: the estimate is the
    mean time of the runs trained in this invocation (skipped runs take none) times the runs
    left."""
    head = f"[{done}/{total}] elapsed {_clock(elapsed)}"
    if not run_times:
        return head + (", ETA unknown (no run timed yet)" if remaining else "")
    mean = sum(run_times) / len(run_times)
    return head + (f", ETA {_clock(mean * remaining)}" if remaining else ", done") + (
        f" (mean {mean:.1f}s per run over {len(run_times)} runs)")


class Interrupted(Exception):
    """A run stopped on Ctrl-C (its checkpoint saved); the grid stops there."""


def run_all(runs: Sequence[tuple[Any, Any]], *, train: Callable[[Any], dict] | None = None,
            log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)
            ) -> dict[str, Any]:
    """Runs every (spec, config) in order, skipping finished runs.

    ``train(config) -> summary`` defaults to ``learner.train(config, quiet=True)``; tests pass a
    fake. A summary with ``interrupted`` raises :class:`Interrupted` after logging.

    Returns ``{"trained": [names], "skipped": [names], "seconds": wall seconds of this call,
    "run_seconds": {name: seconds}}``.
    """
    if train is None:
        from sat_jax.rl import learner

        def train(config):
            return learner.train(config, quiet=True)

    t0 = time.perf_counter()
    pending = [(s, c) for s, c in runs if not is_finished(c)]
    skipped = [s.name for s, c in runs if is_finished(c)]
    total = len(runs)
    done = len(skipped)
    if skipped:
        log(f"[{done}/{total}] {len(skipped)} runs already finished, skipped")
    times: list[float] = []
    trained, run_seconds = [], {}
    for i, (spec, config) in enumerate(pending):
        t = time.perf_counter()
        resuming = os.path.isdir(os.path.join(config.workdir, "checkpoints"))
        log(f"[{done}/{total}] {'resuming' if resuming else 'running'} {spec.name}")
        summary = train(config)
        seconds = time.perf_counter() - t
        if summary.get("interrupted"):
            log(f"interrupted in {spec.name}; its checkpoint is saved: run the same command "
                "again to resume")
            raise Interrupted(spec.name)
        mark_finished(config, {**summary, "wall_seconds": seconds})
        times.append(seconds)
        trained.append(spec.name)
        run_seconds[spec.name] = seconds
        done += 1
        log(f"{progress_line(done, total, time.perf_counter() - t0, times, len(pending) - i - 1)}"
            f" | {spec.name} took {seconds:.1f}s")
    return {"trained": trained, "skipped": skipped, "seconds": time.perf_counter() - t0,
            "run_seconds": run_seconds}
