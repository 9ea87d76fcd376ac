"""Running a grid: each run a normal training run in ``DIR/runs/<name>/``, finished runs skipped,
interrupted ones resumed from their checkpoint, with a progress line and a time estimate.

A run is *finished* when ``DIR/runs/<name>/done.json`` exists and records the same config (the
runner writes it after the learner returns from a run that reached ``num_steps``, and then
compresses the run's log to ``metrics.jsonl.gz``, which the report reads as it is); anything else
is handed to the learner, which resumes from the latest checkpoint (``config.resume = True``) or
refuses a workdir holding another config (``learner.ResumeError``).

Every run records the code it ran (:func:`run_provenance`: a digest of the package source, the
commit, JAX, Python, the other numeric libraries and the CPU, :func:`cpu_identity`) in
``provenance.json`` when it starts and in ``done.json`` when it finishes; a study's report lists
the runs' CPUs. A study never mixes code versions: a grid whose finished or started runs record
another code digest than the one running refuses to go on (:class:`MixedCodeError`), so a
study's runs all come from one program.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from etils import epath

from sat_jax.run import workdir as workdir_lib
from sat_jax.run.metrics import compress_metrics

DONE_FILE = "done.json"
ERROR_FILE = "error.txt"
PROVENANCE_FILE = "provenance.json"


class MixedCodeError(RuntimeError):
    """A study's runs would come from different code versions."""


def code_digest(package_dir: str | None = None) -> str:
    """SHA-256 (first 16 hex digits) over every ``.py`` file of the package, path and bytes, in
    path order: equal for two checkouts that run the same code, whatever their commits."""
    root = package_dir or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).replace(os.sep, "/").encode())
                h.update(b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
                h.update(b"\0")
    return h.hexdigest()[:16]


#: CPU features that decide which instructions XLA:CPU emits, and so its float rounding: x86's
#: vector and matrix extensions (``flags`` in /proc/cpuinfo) and Arm's (``Features``).
ISA_FEATURES = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "asimd",
    "asimddp",
    "sve",
    "sve2",
    "bf16",
    "i8mm",
)


def cpu_identity(cpuinfo: str, machine: str = "") -> str:
    """The CPU of ``cpuinfo`` (the text of /proc/cpuinfo) as one line: its model name, then the
    numbers that tell one generation from another under the same name (x86: family, model and
    stepping; Arm: implementer, part and variant) and which of :data:`ISA_FEATURES` it has.
    Hosts sold under one name ("AMD EPYC") differ in generation and vector width, and XLA:CPU's
    rounding, and so a warm-up's base policy, differs with them. ``machine`` (``platform.
    machine()``) names a CPU whose text holds no model name."""
    first: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip()
        if sep and key and key not in first:
            first[key] = value.strip()
    name = first.get("model name") or first.get("Processor") or machine or "unknown CPU"
    if "cpu family" in first:
        ids = [f"family {first['cpu family']}", f"model {first.get('model', '?')}"]
        if "stepping" in first:
            ids.append(f"stepping {first['stepping']}")
    else:
        ids = [
            f"{label} {first[key]}"
            for key, label in (
                ("CPU implementer", "implementer"),
                ("CPU part", "part"),
                ("CPU variant", "variant"),
            )
            if key in first
        ]
    present = set((first.get("flags") or first.get("Features") or "").split())
    isa = [f for f in ISA_FEATURES if f in present]
    details = ", ".join(part for part in (" ".join(ids), " ".join(isa)) if part)
    return f"{name} ({details})" if details else name


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return cpu_identity(f.read(), platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def _commit(src: str) -> str:
    try:
        commit = subprocess.run(
            ["git", "-C", src, "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", src, "status", "--porcelain", "--untracked-files=no", "--", "sat_jax"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return commit + (" (with uncommitted changes to sat_jax/)" if dirty else "")


#: Libraries whose numerics a run's numbers depend on besides JAX (``run_provenance``).
NUMERIC_PACKAGES = ("flax", "optax", "numpy", "ml_dtypes", "chex", "orbax-checkpoint")


def _package_versions() -> dict[str, str]:
    from importlib import metadata

    versions = {}
    for name in NUMERIC_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


@functools.cache
def run_provenance() -> dict[str, Any]:
    """What a run's numbers depend on besides its config: the package's code digest
    (:func:`code_digest`), the commit, JAX/jaxlib and Python versions, the versions of the other
    numeric libraries (:data:`NUMERIC_PACKAGES`), the backend's devices and the CPU
    (:func:`cpu_identity`: its name, generation and vector extensions).
    XLA:CPU's float rounding depends on the CPU, and a long warm-up turns any rounding
    difference into another policy, so runs of one seed are paired only on one machine."""
    import jax
    import jaxlib

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    devices = jax.devices()
    return {
        "code": code_digest(package),
        "commit": _commit(os.path.dirname(package)),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": platform.python_version(),
        "devices": f"{len(devices)} × {devices[0].device_kind} ({jax.default_backend()})",
        "cpu": f"{_cpu_model()}, {os.cpu_count()} cores",
        "packages": _package_versions(),
    }


def _recorded_code(workdir: str) -> tuple[str, str] | None:
    """(file, code digest) a run directory records, the finished record first; None if none."""
    for name in (DONE_FILE, PROVENANCE_FILE):
        try:
            with open(os.path.join(workdir, name), encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        record = record.get("provenance", {}) if name == DONE_FILE else record
        if record.get("code"):
            return name, record["code"]
    return None


def check_code(configs: Sequence[Any], code: str) -> int:
    """Raises :class:`MixedCodeError` naming the runs among ``configs``' workdirs that record a
    code digest other than ``code``; returns how many record none (runs of a runner that did not
    record provenance)."""
    other, unrecorded = [], 0
    for config in configs:
        if not os.path.isdir(config.workdir):
            continue
        found = _recorded_code(config.workdir)
        if found is None:
            unrecorded += os.path.isfile(os.path.join(config.workdir, DONE_FILE))
        elif found[1] != code:
            other.append(f"{os.path.basename(os.path.normpath(config.workdir))} ({found[1]})")
    if other:
        raise MixedCodeError(
            f"this study's runs come from other code than the code running now ({code}): "
            f"{', '.join(other[:5])}{' ...' if len(other) > 5 else ''}; run the grid from a "
            "checkout of the code its runs used (git worktree add DIR COMMIT), or another --out"
        )
    return unrecorded


def _plain(config) -> dict:
    from sat_jax.config.validation import plain

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
    from sat_jax.config.validation import changed_fields

    stored = done.get("config") or {}
    # changed_fields ignores the fields a resume may change (workdir, logging, ...) but num_steps
    # is among them: a run asked to go further is not finished.
    return not changed_fields(stored, config) and stored.get("num_steps") == config.num_steps


def mark_finished(config, summary: dict[str, Any]) -> None:
    os.makedirs(config.workdir, exist_ok=True)
    record = {
        "config": _plain(config),
        "provenance": run_provenance(),
        "wall_seconds": summary.get("wall_seconds"),
        "end_step": summary.get("end_step"),
        "final_eval": summary.get("final_eval"),
    }
    tmp = os.path.join(config.workdir, DONE_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, os.path.join(config.workdir, DONE_FILE))


def drop_checkpoints(config) -> bool:
    """Deletes the checkpoint directory of a finished run (``done.json`` written); returns
    whether there was one. A run that is not finished keeps its checkpoints: they are what it
    resumes from.

    Raises:
      ValueError: the run is not finished.
    """
    if not is_finished(config):
        raise ValueError(
            f"{config.workdir} is not a finished run (no {DONE_FILE} for this config): its "
            "checkpoints are what it resumes from"
        )
    ckpt_dir = epath.Path(workdir_lib.run_paths(config)[1])
    if not ckpt_dir.exists():
        return False
    ckpt_dir.rmtree()
    return True


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


def program_group(config) -> str:
    """Runs with equal groups share one compiled trainer step (``components.train_step_key``
    varies with neither seed nor lag): the config without the fields a grid varies per cell."""
    c = _plain(config)
    for key in ("seed", "lag", "lag_mode", "workdir", "resume"):
        c.pop(key, None)
    return json.dumps(c, sort_keys=True)


def estimate(
    cold: Sequence[float], warm: Sequence[float], cold_left: int, warm_left: int
) -> float | None:
    """Seconds left: the runs that will compile a new trainer step (``cold``, the first of their
    :func:`program_group`) at the mean time of the cold runs so far, the others at the mean of the
    warm ones (each mean standing in for the other until it exists); None before any run."""
    if not cold and not warm:
        return None
    mean_cold = sum(cold) / len(cold) if cold else sum(warm) / len(warm)
    mean_warm = sum(warm) / len(warm) if warm else mean_cold
    return cold_left * mean_cold + warm_left * mean_warm


def progress_line(done: int, total: int, elapsed: float, eta: float | None) -> str:
    """``[3/12] elapsed 1m40s, ETA 4m50s``."""
    head = f"[{done}/{total}] elapsed {_clock(elapsed)}"
    if done == total:
        return head + ", done"
    return head + (", ETA unknown (no run timed yet)" if eta is None else f", ETA {_clock(eta)}")


class Interrupted(Exception):
    """A run stopped on Ctrl-C (its checkpoint saved); the grid stops there."""


def run_all(
    runs: Sequence[tuple[Any, Any]],
    *,
    train: Callable[[Any], dict] | None = None,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True),
    fatal: type | tuple[type, ...] | None = None,
    after_run: Callable[[dict[str, Any]], None] | None = None,
    keep_checkpoints: bool = True,
) -> dict[str, Any]:
    """Runs every (spec, config) in order, skipping finished runs.

    ``train(config) -> summary`` defaults to ``learner.train(config, quiet=True)``; tests pass a
    fake. A summary with ``interrupted`` raises :class:`Interrupted` after logging. A run that
    raises is recorded (its traceback in ``<workdir>/error.txt``, removed when a later attempt
    finishes) and the grid goes on, unless the exception is one of ``fatal`` (re-raised).
    ``after_run(progress)`` is called after each run with the dict this function returns, so far
    (the CLI rewrites results.md there). ``keep_checkpoints=False`` deletes each run's checkpoint
    directory once its ``done.json`` is written (:func:`drop_checkpoints`): a finished run is
    never resumed, and the report reads only its log.

    Returns ``{"trained": [names], "skipped": [names], "failed": [names], "seconds": wall
    seconds of this call, "run_seconds": {name: seconds}}``.
    """
    if train is None:
        from sat_jax.train import learner

        def train(config):
            return learner.train(config, quiet=True)

    t0 = time.perf_counter()
    unrecorded = check_code([c for _, c in runs], run_provenance()["code"])
    if unrecorded:
        log(f"{unrecorded} finished runs record no code version (older runner); not compared")
    finished = [is_finished(c) for _, c in runs]  # reads each done.json once
    pending = [(s, c) for (s, c), f in zip(runs, finished, strict=True) if not f]
    skipped = [s.name for (s, _), f in zip(runs, finished, strict=True) if f]
    total = len(runs)
    done = len(skipped)
    if skipped:
        log(f"[{done}/{total}] {len(skipped)} runs already finished, skipped")
    seen = set()
    cold_flags = []  # per pending run: will it compile a new trainer step?
    for _, config in pending:
        group = program_group(config)
        cold_flags.append(group not in seen)
        seen.add(group)
    cold, warm = [], []
    trained, failed, run_seconds = [], [], {}

    def so_far():
        return {
            "trained": trained,
            "skipped": skipped,
            "failed": failed,
            "seconds": time.perf_counter() - t0,
            "run_seconds": run_seconds,
        }

    def finish(i: int, message: str) -> None:
        """Counts run ``i`` done, logs the progress line with ``message``, calls ``after_run``."""
        nonlocal done
        done += 1
        left = cold_flags[i + 1 :]
        eta = estimate(cold, warm, sum(left), len(left) - sum(left))
        log(f"{progress_line(done, total, time.perf_counter() - t0, eta)} | {message}")
        if after_run is not None:
            after_run(so_far())

    for i, (spec, config) in enumerate(pending):
        t = time.perf_counter()
        resuming = os.path.isdir(os.path.join(config.workdir, "checkpoints"))
        log(f"[{done}/{total}] {'resuming' if resuming else 'running'} {spec.name}")
        os.makedirs(config.workdir, exist_ok=True)
        if not os.path.isfile(os.path.join(config.workdir, PROVENANCE_FILE)):
            with open(os.path.join(config.workdir, PROVENANCE_FILE), "w", encoding="utf-8") as f:
                json.dump(run_provenance(), f, indent=1)
        try:
            summary = train(config)
        except Exception as e:  # noqa: BLE001 - one broken run must not end a day-long grid
            if fatal is not None and isinstance(e, fatal):
                raise
            seconds = time.perf_counter() - t
            os.makedirs(config.workdir, exist_ok=True)
            with open(os.path.join(config.workdir, ERROR_FILE), "w", encoding="utf-8") as f:
                f.write(traceback.format_exc())
            failed.append(spec.name)
            finish(
                i,
                f"{spec.name} FAILED after {seconds:.1f}s: {type(e).__name__}: {e} "
                f"(traceback in {os.path.join(config.workdir, ERROR_FILE)}); continuing",
            )
            continue
        seconds = time.perf_counter() - t
        if summary.get("interrupted"):
            log(
                f"interrupted in {spec.name}; its checkpoint is saved: run the same command "
                "again to resume"
            )
            raise Interrupted(spec.name)
        mark_finished(config, {**summary, "wall_seconds": seconds})
        compress_metrics(config.workdir)
        if not keep_checkpoints:
            drop_checkpoints(config)
        # An earlier attempt's traceback no longer describes this run.
        stale = os.path.join(config.workdir, ERROR_FILE)
        if os.path.exists(stale):
            os.remove(stale)
        (cold if cold_flags[i] else warm).append(seconds)
        trained.append(spec.name)
        run_seconds[spec.name] = seconds
        finish(i, f"{spec.name} took {seconds:.1f}s")
    return so_far()
