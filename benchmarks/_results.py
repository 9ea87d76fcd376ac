"""Where a benchmark's JSON goes: ``benchmarks/results/<name>.json``, with command and provenance.

Imported as a sibling module (the scripts run from this folder). ``benchmarks/report.py`` renders
these files into ``docs/benchmarks.md``. The load average is read when this module is imported
(the benchmark's start) and again when the result is written, because the development machine is
shared and a figure means little without it. ``SAT_JAX_BENCH_RESULTS`` overrides the folder; set it
empty to write nothing.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
_LOAD_AT_START = os.getloadavg()
_STARTED = datetime.datetime.now(datetime.UTC)


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance() -> dict:
    """Commit (``+dirty`` when the library or the running script differ from it), date, machine,
    load average, versions."""
    import jax

    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    code = ["../sat_jax", os.path.abspath(sys.argv[0]), "_timing.py", "_results.py"]
    if _git("status", "--porcelain", "--untracked-files=no", "--", *code):
        commit += "+dirty"
    return {
        "commit": commit,
        "date": _STARTED.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{_cpu_model()}, {os.cpu_count()} cores, {platform.system()}",
        "load_average": [round(x, 1) for x in (_LOAD_AT_START[0], os.getloadavg()[0])],
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "python": platform.python_version(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
    }


def write(name: str, result: dict) -> str | None:
    """Writes ``result`` with its command and provenance to ``<folder>/<name>.json``."""
    folder = os.environ.get("SAT_JAX_BENCH_RESULTS", os.path.join(HERE, "results"))
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)
    script = os.path.relpath(os.path.abspath(sys.argv[0]), os.path.dirname(HERE))
    command = shlex.join(["python", script, *sys.argv[1:]])
    record = {"benchmark": name, "command": command, "provenance": provenance(), "result": result}
    path = os.path.join(folder, f"{name}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    return path
