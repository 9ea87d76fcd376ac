"""Grading with a deadline per answer, in a worker process.

Symbolic verifiers and some generators' scorers can run for as long as they like on a crafted
answer (math-verify comparing ``10^{10^{10}}`` with 5, reasoning-gym's Countdown scorer evaluating
``9**9**9**9``). math-verify's own timeouts use ``SIGALRM``, which works only on the main thread,
and rewards are also computed on the stream mode's rollout thread. So `Grader` runs each such
call in a worker process (``_grading_worker.py``, which imports neither sat_jax nor JAX) and waits
at most ``deadline`` seconds: an answer that takes longer scores 0 and the worker is killed and
restarted. Inputs are cut off before they are sent: an answer longer than ``max_chars`` scores 0
without being graded.

One `Grader` serves a process (`default_grader`); calls from several threads take turns.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_grading_worker.py")


class Grader:
    """Calls into the grading worker with a deadline.

    Args:
      deadline: seconds one call may take before its answer scores 0 (the worker is restarted).
      max_chars: longest answer graded; a longer one scores 0 unseen.
      startup_timeout: seconds the worker may take to start (imports), not counted in a deadline.

    Attributes:
      timeouts: calls that ran past ``deadline``.
      errors: calls whose scorer raised (each such answer scores 0).
    """

    def __init__(self, deadline: float = 2.0, max_chars: int = 1000, startup_timeout: float = 120):
        if not deadline > 0:
            raise ValueError(f"deadline must be > 0 seconds, got {deadline!r}")
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars!r}")
        self.deadline = float(deadline)
        self.max_chars = int(max_chars)
        self.startup_timeout = float(startup_timeout)
        self.timeouts = 0
        self.errors = 0
        self._proc: subprocess.Popen | None = None
        self._ready = False
        self._lock = threading.Lock()

    def _start(self) -> None:
        # Started at once after a kill, so the worker's imports overlap the caller's other work.
        self._proc = subprocess.Popen(
            # -P: the script's folder is not put on sys.path, so this package's math_verify.py
            # cannot shadow the math-verify package.
            [sys.executable, "-P", _WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self._ready = False

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def _receive(self, until: float) -> tuple[str, Any] | None:
        """One message from the worker, or None if it does not arrive by ``until``."""
        fd = self._proc.stdout.fileno()
        data, need = b"", 8
        header = True
        while True:
            while len(data) < need:
                left = until - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    return None
                chunk = os.read(fd, need - len(data))
                if not chunk:  # the worker died
                    return ("error", "the grading worker exited")
                data += chunk
            if not header:
                return pickle.loads(data)
            need, data, header = int.from_bytes(data, "big"), b"", False

    def call(self, kind: str, *args: Any) -> tuple[bool, Any]:
        """``(True, value)`` of ``kind(*args)`` in the worker, or ``(False, reason)`` when it
        raised, timed out or the worker could not start."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            if not self._ready:
                message = self._receive(time.monotonic() + self.startup_timeout)
                if message is None or message[0] != "ready":
                    self._kill()
                    raise RuntimeError(
                        f"the grading worker ({_WORKER}) did not start within "
                        f"{self.startup_timeout}s: {message!r}"
                    )
                self._ready = True
            data = pickle.dumps((kind, args), protocol=pickle.HIGHEST_PROTOCOL)
            try:
                self._proc.stdin.write(len(data).to_bytes(8, "big") + data)
                self._proc.stdin.flush()
            except BrokenPipeError:
                self._kill()
                self.errors += 1
                return False, "the grading worker exited"
            message = self._receive(time.monotonic() + self.deadline)
            if message is None:
                if not self.timeouts:
                    log.warning("grading %s ran past %ss: the answer scores 0", kind, self.deadline)
                self.timeouts += 1
                self._kill()
                self._start()
                return False, f"timed out after {self.deadline}s"
            status, value = message
            if status != "ok":
                if not self.errors:  # a scorer that fails on every answer must not look like 0s
                    log.warning("grading %s failed (the answer scores 0): %s", kind, value)
                self.errors += 1
                if self._proc.poll() is not None:
                    self._kill()
                return False, value
            return True, value

    def fits(self, *texts: str) -> bool:
        """Whether every text is short enough to be graded."""
        return all(len(t) <= self.max_chars for t in texts)

    def close(self) -> None:
        with self._lock:
            self._kill()

    def __del__(self):
        proc = getattr(self, "_proc", None)
        try:
            proc.kill()
        except Exception:  # at interpreter exit the modules it needs may be gone
            pass


_DEFAULT: Grader | None = None
_DEFAULT_LOCK = threading.Lock()


def default_grader() -> Grader:
    """This process's shared `Grader` (started on first use)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Grader()
        return _DEFAULT


def available(module: str) -> bool:
    """Whether ``module`` (``"math_verify"``, ``"reasoning_gym"``) can be imported here."""
    import importlib.util

    return importlib.util.find_spec(module) is not None
