"""Run outputs: JSONL metrics, TensorBoard scalars, the resolved config, console progress, plots.

Layout of a run directory written by :class:`RunLogger` (primary process only)::

    run_dir/
      config.json        resolved config, written at construction (config.yaml too if PyYAML is
                         importable)
      metrics.jsonl      one JSON object per ``log`` call: {"step": int, "time": float, key: value}
      tensorboard/       tensorboardX event files (skipped, with one warning, if not installed)
      plots/             written by ``plot_run``

Non-finite values: JSON has no NaN or infinity, so ``metrics.jsonl`` stores them as the strings
``"NaN"``, ``"Infinity"`` and ``"-Infinity"``; :func:`read_metrics` turns them back into floats.
TensorBoard receives the float itself.

This module is ``sat_jax.logging``; it imports the standard library's ``logging`` absolutely, and
so must every other module (``import logging`` never means this file).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

__all__ = [
    "PANELS",
    "Progress",
    "RunLogger",
    "plot_compare",
    "plot_run",
    "read_metrics",
]

_log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
TENSORBOARD_DIR = "tensorboard"

_NONFINITE_TO_JSON = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
_JSON_TO_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_RESERVED = ("step", "time")

_warned_no_tensorboardx = False


def _default_is_primary() -> bool:
    return jax.process_index() == 0


# --------------------------------------------------------------------------------------------
# Metrics writer


class RunLogger:
    """Writes a run's metrics to ``metrics.jsonl`` and TensorBoard, and its config to JSON.

    Args:
      run_dir: Directory of the run (created on the primary process).
      config: Resolved configuration: a mapping, an ``ml_collections.ConfigDict`` (anything with
        ``to_dict()``) or a dataclass. Values JSON cannot hold are written with ``str``.
      enable_tensorboard: Also write TensorBoard event files under ``run_dir/tensorboard``.
      is_primary: Whether this process writes. Defaults to ``jax.process_index() == 0``; on other
        processes every method is a no-op and nothing is created on disk.
      resume_step: When resuming from a checkpoint at this step, drop the entries of
        ``metrics.jsonl`` with ``step > resume_step`` (they will be logged again) and hide
        TensorBoard events after it. Without it, an existing ``metrics.jsonl`` is appended to.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        config: Any = None,
        enable_tensorboard: bool = True,
        is_primary: bool | None = None,
        resume_step: int | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.is_primary = _default_is_primary() if is_primary is None else bool(is_primary)
        self.metrics_path = self.run_dir / METRICS_FILE
        self._file = None
        self._tb = None
        if not self.is_primary:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if config is not None:
            _write_config(self.run_dir, config)
        if resume_step is not None:
            _truncate_metrics(self.metrics_path, int(resume_step))
        self._file = open(self.metrics_path, "a", encoding="utf-8")  # Closed in close().
        if enable_tensorboard:
            self._tb = _make_summary_writer(
                self.run_dir / TENSORBOARD_DIR,
                purge_step=None if resume_step is None else int(resume_step) + 1,
            )

    def log(self, step: int, metrics: Mapping[str, Any], *, prefix: str = "") -> None:
        """Records scalar ``metrics`` at ``step``.

        Args:
          step: Training step (an int or integer scalar).
          metrics: Map from name to a Python number, bool, NumPy scalar or 0-d ``jax.Array``
            (fetched from device in one transfer; replicated global arrays are fine).
          prefix: Prepended to every key with a ``/`` (``prefix="eval"`` → ``"eval/pass@1"``).

        Raises:
          ValueError: A value is not a scalar, or a key is ``"step"``/``"time"``.
          TypeError: A value is not numeric.
        """
        if not self.is_primary:
            return
        if self._file is None:
            raise RuntimeError(f"RunLogger for {self.run_dir} is closed")
        step = int(step)
        values = _to_python_scalars(metrics)
        if prefix:
            sep = "" if prefix.endswith("/") else "/"
            values = {f"{prefix}{sep}{k}": v for k, v in values.items()}
        now = time.time()
        record = {"step": step, "time": now}
        record.update({k: _json_number(v) for k, v in values.items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        # One flush per call: a crash loses at most the line being written.
        self._file.flush()
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, float(value), global_step=step, walltime=now)

    def flush(self) -> None:
        """Pushes buffered metrics and TensorBoard events to disk."""
        if self._file is not None:
            self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flushes and closes the files; further ``log`` calls raise on the primary process."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Reads ``run_dir/metrics.jsonl`` back, one dict per ``log`` call, in file order.

    ``"NaN"``/``"Infinity"``/``"-Infinity"`` become floats again. Unreadable lines (a write cut
    by a crash) are skipped with a warning.

    Raises:
      FileNotFoundError: The run has no ``metrics.jsonl``.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir}")
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            record = _parse_line(line, path, lineno)
            if record is not None:
                records.append(record)
    return records


def _parse_line(line: str, path: Path, lineno: int) -> dict[str, Any] | None:
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        _log.warning("skipping unreadable line %d of %s", lineno, path)
        return None
    if not isinstance(record, dict) or "step" not in record:
        _log.warning("skipping line %d of %s: not a metrics record", lineno, path)
        return None
    return {k: _JSON_TO_NONFINITE.get(v, v) if isinstance(v, str) else v for k, v in record.items()}


def _truncate_metrics(path: Path, resume_step: int) -> None:
    """Keeps only records with ``step <= resume_step``; rewrites atomically."""
    if not path.is_file():
        return
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            record = _parse_line(line, path, lineno)
            if record is None:
                continue
            if record["step"] <= resume_step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    if dropped:
        _log.info(
            "resuming at step %d: dropped %d metric records from %s", resume_step, dropped, path
        )


def _to_python_scalars(metrics: Mapping[str, Any]) -> dict[str, int | float | bool]:
    if not isinstance(metrics, Mapping):
        raise TypeError(
            f"metrics must be a mapping of name -> scalar, got {type(metrics).__name__}"
        )
    arrays = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"metric names must be strings, got {key!r}")
        if key in _RESERVED:
            raise ValueError(f"metric name {key!r} is reserved; rename it")
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            # A scalar global array is replicated: any local shard holds the value.
            value = value.addressable_data(0)
        arrays[key] = value
    host = jax.device_get(arrays)  # one transfer for all device scalars
    out = {}
    for key in arrays:  # the caller's order, not the sorted pytree order
        value = host[key]
        if isinstance(value, bool | int | float):
            out[key] = value
            continue
        arr = np.asarray(value)
        if arr.ndim != 0:
            raise ValueError(f"metric {key!r} must be a scalar, got shape {arr.shape}")
        if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
            raise TypeError(f"metric {key!r} must be numeric, got dtype {arr.dtype}")
        out[key] = arr.item()
    return out


def _json_number(value: int | float | bool) -> int | float | bool | str:
    if isinstance(value, float) and not math.isfinite(value):
        return _NONFINITE_TO_JSON[repr(value)]
    return value


def _config_to_dict(config: Any) -> Any:
    if hasattr(config, "to_dict") and callable(config.to_dict):
        return config.to_dict()
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    if isinstance(config, Mapping):
        return dict(config)
    raise TypeError(
        f"config must be a mapping, a dataclass or have to_dict(), got {type(config).__name__}"
    )


def _write_config(run_dir: Path, config: Any) -> None:
    # Round trip through JSON so the YAML copy holds exactly what config.json holds.
    plain = json.loads(json.dumps(_config_to_dict(config), default=str, sort_keys=True))
    (run_dir / CONFIG_FILE).write_text(json.dumps(plain, indent=2) + "\n", encoding="utf-8")
    try:
        import yaml
    except ImportError:
        return
    (run_dir / "config.yaml").write_text(yaml.safe_dump(plain, sort_keys=True), encoding="utf-8")


def _make_summary_writer(logdir: Path, purge_step: int | None):
    global _warned_no_tensorboardx
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        if not _warned_no_tensorboardx:
            _log.warning("tensorboardX is not installed: TensorBoard logging is off")
            _warned_no_tensorboardx = True
        return None
    return SummaryWriter(logdir=str(logdir), purge_step=purge_step, flush_secs=30)


# --------------------------------------------------------------------------------------------
# Console progress


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
        self.is_primary = _default_is_primary() if is_primary is None else bool(is_primary)
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
    values = _to_python_scalars(metrics)
    return " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()
    )


# --------------------------------------------------------------------------------------------
# Plots

#: Standard panels: file stem -> (title, metric keys drawn on it). Keys absent from a run are
#: skipped, and so is a panel with none of its keys.
PANELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "reward": ("Training reward", ("train/reward_mean",)),
    "eval_accuracy": ("Evaluation accuracy", ("eval/pass@1",)),
    "mismatch": ("Policy mismatch d̄_π", ("loss/mismatch",)),
    "clip_gate": (
        "Clip fraction and SAT gate / binding rates",
        ("loss/clip_frac", "loss/sat/gate_rate", "loss/sat/binding_rate"),
    ),
    "sat_q": ("SAT quantile q", ("loss/sat/q",)),
    "lag": ("Realized lag", ("lag/mean", "lag/max")),
}


def _series(records: Iterable[Mapping[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of ``key`` over the records that have it; later duplicates win."""
    by_step: dict[int, float] = {}
    for record in records:
        value = record.get(key)
        if isinstance(value, bool | int | float):
            by_step[int(record["step"])] = float(value)
    steps = np.array(sorted(by_step), dtype=np.int64)
    return steps, np.array([by_step[s] for s in steps.tolist()], dtype=np.float64)


def _new_figure(figsize: tuple[float, float]):
    # The object-oriented API with an Agg canvas: no pyplot global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _draw_panel(ax, records, title: str, keys: Sequence[str]) -> None:
    for key in keys:
        steps, values = _series(records, key)
        if steps.size:
            ax.plot(steps, values, label=key, marker="." if steps.size < 50 else None)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_run(
    run_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    *,
    panels: Mapping[str, tuple[str, Sequence[str]]] | None = None,
) -> list[Path]:
    """Draws one PNG per panel with data, plus ``summary.png`` with all of them.

    Args:
      run_dir: A run directory holding ``metrics.jsonl``.
      out_dir: Where to write (default ``run_dir/plots``).
      panels: Panels to draw (default :data:`PANELS`).

    Returns:
      Paths of the PNGs written, the panels first and ``summary.png`` last; empty when no panel
      key occurs in the run.
    """
    records = read_metrics(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    present_keys = {k for r in records for k in r}
    chosen = {
        name: (title, [k for k in keys if k in present_keys])
        for name, (title, keys) in (PANELS if panels is None else panels).items()
    }
    chosen = {name: spec for name, spec in chosen.items() if spec[1]}
    if not chosen:
        return []
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, (title, keys) in chosen.items():
        fig = _new_figure((5.0, 3.5))
        _draw_panel(fig.add_subplot(), records, title, keys)
        paths.append(out / f"{name}.png")
        fig.savefig(paths[-1], dpi=100)
    ncols = min(3, len(chosen))
    nrows = math.ceil(len(chosen) / ncols)
    fig = _new_figure((4.5 * ncols, 3.2 * nrows))
    fig.suptitle(Path(run_dir).resolve().name)
    for i, (title, keys) in enumerate(chosen.values()):
        _draw_panel(fig.add_subplot(nrows, ncols, i + 1), records, title, keys)
    paths.append(out / "summary.png")
    fig.savefig(paths[-1], dpi=100)
    return paths


_SEED_SUFFIX = re.compile(r"[-_.]?seed[-_=]?\d+$")


def _default_label(run_dir: Path) -> str:
    name = run_dir.resolve().name
    return _SEED_SUFFIX.sub("", name) or name


def plot_compare(
    run_dirs: Sequence[str | os.PathLike[str]],
    key: str,
    out_path: str | os.PathLike[str],
    *,
    labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Overlays ``key`` across runs; runs sharing a label are drawn as mean ± std.

    Args:
      run_dirs: Run directories holding ``metrics.jsonl``.
      key: Metric to compare, e.g. ``"eval/pass@1"``.
      out_path: PNG file to write.
      labels: One label per run (methods); runs with equal labels are seeds of one method.
        Default: the directory name without a trailing seed suffix (``sat-seed1`` → ``sat``).
      title: Figure title (default ``key``).

    Returns:
      ``out_path`` as a ``Path``.

    Raises:
      ValueError: ``labels`` has the wrong length, or no run has ``key``.
    """
    dirs = [Path(d) for d in run_dirs]
    if labels is None:
        labels = [_default_label(d) for d in dirs]
    if len(labels) != len(dirs):
        raise ValueError(f"got {len(labels)} labels for {len(dirs)} runs")
    groups: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
    for d, label in zip(dirs, labels, strict=True):
        steps, values = _series(read_metrics(d), key)
        if steps.size:
            groups.setdefault(label, []).append((steps, values))
        else:
            _log.warning("run %s has no %r; left out of the comparison", d, key)
    if not groups:
        raise ValueError(f"none of the {len(dirs)} runs logged {key!r}")
    fig = _new_figure((6.0, 4.0))
    ax = fig.add_subplot()
    for label, runs in groups.items():
        # Average over the steps every run of the group logged.
        common = runs[0][0]
        for steps, _ in runs[1:]:
            common = np.intersect1d(common, steps)
        stacked = np.stack([v[np.searchsorted(s, common)] for s, v in runs])
        mean = stacked.mean(axis=0)
        (line,) = ax.plot(common, mean, label=f"{label} (n={len(runs)})")
        if len(runs) > 1:
            std = stacked.std(axis=0)
            ax.fill_between(common, mean - std, mean + std, color=line.get_color(), alpha=0.2)
    ax.set_title(title or key)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
