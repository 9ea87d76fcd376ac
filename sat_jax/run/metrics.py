"""Run outputs: JSONL metrics, TensorBoard scalars and the resolved config.

Layout of a run directory written by :class:`RunLogger` (primary process only)::

    run_dir/
      config.json        resolved config, written at construction (config.yaml too if PyYAML is
                         importable)
      metrics.jsonl      one JSON object per ``log`` call: {"step": int, "time": float, key: value}
                         (kept as metrics.jsonl.gz once a study counts the run:
                         :func:`compress_metrics`; read and appended to the same)
      tensorboard/       tensorboardX event files (skipped, with one warning, if not installed)
      plots/             written by ``sat_jax.run.plots.plot_run``

Non-finite values: JSON has no NaN or infinity, so ``metrics.jsonl`` stores them as the strings
``"NaN"``, ``"Infinity"`` and ``"-Infinity"``; :func:`read_metrics` turns them back into floats.
TensorBoard receives the float itself. Console progress is ``sat_jax.run.progress``, plots
``sat_jax.run.plots``.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

__all__ = [
    "COMPRESSED_METRICS_FILE",
    "CONFIG_FILE",
    "METRICS_FILE",
    "RunLogger",
    "compress_metrics",
    "read_metrics",
]

_log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
COMPRESSED_METRICS_FILE = METRICS_FILE + ".gz"
CONFIG_FILE = "config.json"
TENSORBOARD_DIR = "tensorboard"

_NONFINITE_TO_JSON = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
_JSON_TO_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_RESERVED = ("step", "time")

_warned_no_tensorboardx = False


def default_is_primary() -> bool:
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
        self.is_primary = default_is_primary() if is_primary is None else bool(is_primary)
        self.metrics_path = self.run_dir / METRICS_FILE
        self._file = None
        self._tb = None
        if not self.is_primary:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if config is not None:
            _write_config(self.run_dir, config)
        _decompress_metrics(self.run_dir)  # a counted study run asked to go further
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
        values = to_python_scalars(metrics)
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
    """Reads ``run_dir/metrics.jsonl`` (or its compressed ``metrics.jsonl.gz``) back, one dict
    per ``log`` call, in file order.

    ``"NaN"``/``"Infinity"``/``"-Infinity"`` become floats again. Unreadable lines (a write cut
    by a crash) are skipped with a warning.

    Raises:
      FileNotFoundError: The run has neither ``metrics.jsonl`` nor ``metrics.jsonl.gz``.
    """
    path = Path(run_dir) / METRICS_FILE
    if path.is_file():
        opener = open
    elif (Path(run_dir) / COMPRESSED_METRICS_FILE).is_file():
        path, opener = Path(run_dir) / COMPRESSED_METRICS_FILE, gzip.open
    else:
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir}")
    records = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            record = _parse_line(line, path, lineno)
            if record is not None:
                records.append(record)
    return records


def compress_metrics(run_dir: str | os.PathLike[str]) -> Path | None:
    """Replaces ``run_dir/metrics.jsonl`` by ``metrics.jsonl.gz`` (the same bytes, gzip with no
    name or time in its header, so equal logs compress to equal files); returns the new path, or
    None when there is no plain log. A study keeps every counted run's log this way: what its
    report is rebuilt from, at a fraction of the size."""
    src = Path(run_dir) / METRICS_FILE
    if not src.is_file():
        return None
    dest = Path(run_dir) / COMPRESSED_METRICS_FILE
    tmp = dest.with_name(dest.name + ".tmp")
    with open(src, "rb") as f, open(tmp, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as out:
            out.write(f.read())
    os.replace(tmp, dest)
    src.unlink()
    return dest


def _decompress_metrics(run_dir: Path) -> None:
    """Puts a compressed log back as ``metrics.jsonl``, to be appended to."""
    packed = run_dir / COMPRESSED_METRICS_FILE
    if not packed.is_file():
        return
    if not (run_dir / METRICS_FILE).exists():
        tmp = run_dir / (METRICS_FILE + ".tmp")
        with gzip.open(packed, "rb") as f:
            tmp.write_bytes(f.read())
        os.replace(tmp, run_dir / METRICS_FILE)
    packed.unlink()


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


def to_python_scalars(metrics: Mapping[str, Any]) -> dict[str, int | float | bool]:
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
