"""Run controls around the training loop: stop signals, the non-finite-update guard and
wall-time accounting."""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import jax
import numpy as np

#: Signals that ask a run to checkpoint and stop: Ctrl-C, and what preemptible (Spot) VMs and
#: schedulers send before they kill a process.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopFlag:
    """SIGINT or SIGTERM asks the loop to checkpoint and stop after the current step; a second
    signal interrupts at once (``KeyboardInterrupt``, no checkpoint).

    Installed in the main thread of every process. On a multi-host run a signal may reach only
    some hosts, so :meth:`agreed` gathers the flag from every process (one small collective a
    step): every host then saves and stops after the same step, or none does.
    """

    def __init__(self):
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, _frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum
        name = signal.Signals(signum).name
        print(
            f"\n{name}: stopping after this step with a checkpoint ({name} again to abort "
            "without saving)",
            flush=True,
        )

    def agreed(self) -> bool:
        """Whether any process was asked to stop; every process must call it each step."""
        if jax.process_count() == 1:
            return self.requested
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray(self.requested, np.int32))
        if not self.requested and np.any(flags):
            self.signum = signal.SIGTERM  # stopping because another host was asked to
        return bool(np.any(flags))

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}


class NonFiniteError(RuntimeError):
    """Too many training steps in a row had a non-finite loss or gradient."""


class NonFiniteGuard:
    """Counts training steps whose updates the trainer step refused (a non-finite loss, gradient
    or update: ``metrics["optim/nonfinite"]``), and stops the run after ``max_in_a_row`` such
    steps in a row. A step with every update applied resets the count."""

    def __init__(self, max_in_a_row: int):
        if max_in_a_row < 1:
            raise ValueError(f"max_in_a_row must be >= 1, got {max_in_a_row}")
        self.max_in_a_row = int(max_in_a_row)
        self.in_a_row = 0
        self.total = 0

    def check(self, step: int, skipped: int, updates: int) -> str | None:
        """Records step ``step`` (``skipped`` of its ``updates`` not applied); returns a warning
        line when some were skipped.

        Raises:
          NonFiniteError: the ``max_in_a_row``-th such step in a row.
        """
        if not skipped:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteError(
                f"stopping at step {step}: {self.in_a_row} steps in a row had a non-finite loss "
                f"or gradient (optim.max_nonfinite_steps={self.max_in_a_row}); their updates "
                "were not applied and no checkpoint holds them. Look for NaN rewards "
                "(train/nonfinite_rewards) or lower optim.learning_rate"
            )
        return (
            f"step {step}: {skipped} of {updates} updates not applied (non-finite loss or "
            f"gradient; {self.in_a_row} steps in a row, the run stops at "
            f"{self.max_in_a_row})"
        )


class Timer:
    """Wall time of the run and of the sections spent blocked on compiled computations."""

    def __init__(self):
        self.compiled = 0.0
        self.start = time.perf_counter()

    @contextlib.contextmanager
    def compiled_section(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.compiled += time.perf_counter() - t0

    def add_compiled(self, seconds: float | None) -> None:
        self.compiled += seconds or 0.0

    @property
    def wall(self) -> float:
        return time.perf_counter() - self.start
