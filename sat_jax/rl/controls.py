"""Run controls around the training loop: Ctrl-C handling and wall-time accounting."""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import jax


class StopFlag:
    """First Ctrl-C asks the loop to checkpoint and stop after the current step; a second one
    interrupts at once. Installed only in the main thread of a single-process run."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, *_):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nstopping after this step (Ctrl-C again to abort without saving)", flush=True)

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


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
