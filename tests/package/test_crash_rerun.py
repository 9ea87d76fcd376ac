"""`make test`'s re-run flags: a test whose xdist worker dies runs once more on a fresh worker, and
an ordinary failure runs once and fails. Runs pytest on a generated file with the Makefile's own
``PYTEST_RERUN``, so the flags cannot drift from what this checks."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

SUITE = """
import os
import pathlib

HERE = pathlib.Path(__file__).parent


def _count(name):
    path = HERE / name
    path.write_text(path.read_text() + "x" if path.exists() else "x")
    return len(path.read_text())


def test_worker_dies_on_the_first_run():
    if _count("crash.count") == 1:
        os.abort()


def test_fails_plainly():
    _count("fail.count")
    assert False, "a plain failure"


def test_errors_plainly():
    _count("error.count")
    raise RuntimeError("a plain error")
"""


def _makefile_flags():
    text = (ROOT / "Makefile").read_text()
    match = re.search(r"^PYTEST_RERUN \?= (.+)$", text, re.M)
    assert match, "Makefile has no PYTEST_RERUN line"
    assert "$(PYTEST_RERUN)" in text.split("\ntest: install\n", 1)[1].split("\n\n", 1)[0]
    return shlex.split(match.group(1))


def test_a_crashed_worker_is_rerun_once_and_a_failure_never(tmp_path):
    (tmp_path / "test_generated.py").write_text(SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "1", "-p", "no:cacheprovider", "-q"]
        + _makefile_flags()
        + ["test_generated.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert re.search(r"\b2 failed, 1 passed, 1 rerun\b", out), out
    assert (tmp_path / "crash.count").read_text() == "xx"
    assert (tmp_path / "fail.count").read_text() == "x"
    assert (tmp_path / "error.count").read_text() == "x"
