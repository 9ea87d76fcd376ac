"""Plots of run directories: one PNG per standard panel and a summary (``plot_run``), and one
metric overlaid across runs with seeds as mean ± std (``plot_compare``). Matplotlib's
object-oriented API on an Agg canvas: no display, no pyplot state."""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sat_jax.run.metrics import read_metrics

__all__ = ["PANELS", "SMOOTHED", "plot_compare", "plot_run", "smooth"]

_log = logging.getLogger(__name__)

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

#: Keys drawn raw (faint) with a trailing moving average beside them: per-step noise hides the
#: trend of a batch statistic.
SMOOTHED = frozenset({"train/reward_mean"})


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average: entry i is the mean of ``values[max(0, i − window + 1) : i + 1]``
    (the first entries average what exists so far)."""
    values = np.asarray(values, np.float64)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    csum = np.concatenate([[0.0], np.cumsum(values)])
    idx = np.arange(1, values.size + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def _window(n: int) -> int:
    """About a twentieth of the run, at least 5 steps."""
    return max(5, n // 20)


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
        if not steps.size:
            continue
        marker = "." if steps.size < 50 else None
        if key in SMOOTHED and steps.size > 1:
            (raw,) = ax.plot(
                steps, values, label=f"{key} (raw)", alpha=0.35, linewidth=0.8, marker=marker
            )
            w = _window(steps.size)
            ax.plot(
                steps,
                smooth(values, w),
                label=f"{key} (mean of {w} steps)",
                color=raw.get_color(),
                linewidth=1.8,
            )
        else:
            ax.plot(steps, values, label=key, marker=marker)
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
