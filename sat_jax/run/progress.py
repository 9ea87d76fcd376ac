"""A one-line console progress display of the training loop (rich, tqdm or plain lines)."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

from sat_jax.run.metrics import default_is_primary, to_python_scalars

__all__ = ["Progress"]


class Progress:
    """A one-line progress display of the training loop.

    Uses ``rich`` (else ``tqdm``) when stdout is a terminal and the library is installed;
    otherwise (CI, log files) prints a plain line every ``print_every`` steps and at the end.

    Args:
      total_steps: Number of steps of the run.
      is_primary: Whether this process displays anything (default ``jax.process_index() == 0``).
      print_every: Interval of the plain fallback (default: about 20 lines per run).
      backend: ``"auto"``, ``"rich"``, ``"tqdm"`` or ``"plain"``; a forced library that is not
        installed falls back to plain.
      stream: Where to write (default ``sys.stdout``).
    """

    def __init__(
        self,
        total_steps: int,
        *,
        is_primary: bool | None = None,
        print_every: int | None = None,
        backend: str = "auto",
        stream: Any = None,
    ):
        if backend not in ("auto", "rich", "tqdm", "plain"):
            raise ValueError(f"backend must be auto, rich, tqdm or plain, got {backend!r}")
        self.total_steps = int(total_steps)
        self.is_primary = default_is_primary() if is_primary is None else bool(is_primary)
        self.print_every = max(1, print_every or self.total_steps // 20 or 1)
        self._stream = stream if stream is not None else sys.stdout
        self._start = time.monotonic()
        self._closed = False
        self.backend = "none"
        self._impl = None
        if not self.is_primary:
            return
        self.backend = self._choose_backend(backend)
        if self.backend == "rich":
            self._impl = self._make_rich()
        elif self.backend == "tqdm":
            from tqdm.auto import tqdm

            self._impl = tqdm(total=self.total_steps, file=self._stream, dynamic_ncols=True)

    def _choose_backend(self, requested: str) -> str:
        isatty = getattr(self._stream, "isatty", None)
        tty = bool(isatty and isatty())
        order = {"auto": ("rich", "tqdm") if tty else (), "rich": ("rich",), "tqdm": ("tqdm",)}
        for name in order.get(requested, ()):
            try:
                __import__(name)
            except ImportError:
                continue
            return name
        return "plain"

    def _make_rich(self):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        bar = RichProgress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}"),
            console=Console(file=self._stream),
        )
        bar.start()
        self._task = bar.add_task("train", total=self.total_steps, metrics="")
        return bar

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Shows ``step`` (steps done) and a few scalars (Python or device scalars)."""
        if not self.is_primary or self._closed:
            return
        step = int(step)
        text = _format_metrics(metrics or {})
        if self.backend == "rich":
            self._impl.update(self._task, completed=step, metrics=text)
        elif self.backend == "tqdm":
            self._impl.update(step - self._impl.n)
            self._impl.set_postfix_str(text, refresh=True)
        elif step % self.print_every == 0 or step >= self.total_steps:
            elapsed = time.monotonic() - self._start
            pct = 100.0 * step / self.total_steps if self.total_steps else 100.0
            line = f"step {step}/{self.total_steps} ({pct:.0f}%) {elapsed:.0f}s"
            print(f"{line} {text}".rstrip(), file=self._stream, flush=True)

    def close(self) -> None:
        """Ends the display (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.backend == "rich":
            self._impl.stop()
        elif self.backend == "tqdm":
            self._impl.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _format_metrics(metrics: Mapping[str, Any]) -> str:
    values = to_python_scalars(metrics)
    return " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()
    )
