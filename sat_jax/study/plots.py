"""A study's figures: per-step trajectories in the manner of the paper's Figures 2–4 (one panel per
method, one colour per lag, seeds as thin lines and their mean bold) and the envelope's heatmaps
(learning rate × lag). Matplotlib's object-oriented API on an Agg canvas (``sat_jax.run.plots``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sat_jax.run.plots import _new_figure, _series, _window, smooth


def plot_trajectories(
    runs: Sequence[tuple[Any, Sequence[Mapping[str, Any]]]],
    key: str,
    out_path,
    *,
    title: str,
    labels: Mapping[str, str] | None = None,
    smoothed: bool = False,
) -> Path | None:
    """One panel per method of ``runs`` ((spec, records) pairs), one colour per lag; each seed a
    thin line, the mean over seeds (on the steps every seed logged) bold. ``smoothed`` draws a
    trailing moving average over a twentieth of the run (at least 5 steps) instead of raw values.
    Methods none of whose runs logged ``key`` (q and binding for a non-SAT objective) get no
    panel. Returns the PNG path, or None when no run logged ``key``."""
    lags = sorted({spec.lag for spec, _ in runs})
    series: dict[tuple[str, int], list[tuple[np.ndarray, np.ndarray]]] = {}
    for spec, records in runs:
        steps, values = _series(records, key)
        if steps.size:
            if smoothed and steps.size > 1:
                values = smooth(values, _window(steps.size))
            series.setdefault((spec.method, spec.lag), []).append((steps, values))
    if not series:
        return None
    methods = list(dict.fromkeys(method for method, _ in series))  # in the runs' order
    ncols = min(3, len(methods))
    nrows = math.ceil(len(methods) / ncols)
    fig = _new_figure((4.2 * ncols, 3.0 * nrows))
    fig.suptitle(title)
    colors = [f"C{i}" for i in range(10)]
    axes = []
    for i, method in enumerate(methods):
        ax = fig.add_subplot(nrows, ncols, i + 1, sharey=axes[0] if axes else None)
        axes.append(ax)
        for j, lag in enumerate(lags):
            group = series.get((method, lag), [])
            color = colors[j % len(colors)]
            for steps, values in group:
                ax.plot(steps, values, color=color, alpha=0.35, linewidth=0.7)
            if group:
                common = group[0][0]
                for steps, _ in group[1:]:
                    common = np.intersect1d(common, steps)
                if common.size:
                    mean = np.stack([v[np.searchsorted(s, common)] for s, v in group]).mean(0)
                    ax.plot(
                        common,
                        mean,
                        color=color,
                        linewidth=2.0,
                        label=f"lag {lag} (n={len(group)})",
                    )
        ax.set_title((labels or {}).get(method, method), fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


#: Envelope heatmaps: (field of an envelope_map row, title, colour map, diverging).
ENVELOPE_PANELS = (
    ("base_drop", "GRPO: final pass@1 change from lag 1", "RdBu", True),
    ("sat_diff", "SAT-GRPO − GRPO: final pass@1", "RdBu", True),
    ("mismatch", "GRPO: d̄_π (trailing 25%)", "viridis", False),
    ("q", "SAT-GRPO: q (trailing 25%)", "viridis", False),
    ("binding", "SAT-GRPO: binding rate (trailing 25%)", "viridis", False),
)


def _value(entry: Mapping[str, Any], field: str) -> float:
    v = entry.get(field)
    if isinstance(v, Mapping):
        v = v.get("mean", math.nan) if v.get("n") else math.nan
    return math.nan if v is None else float(v)


def plot_envelope(
    map_rows: Sequence[Mapping[str, Any]], out_path, *, titles: Mapping[str, str] | None = None
) -> Path | None:
    """Heatmaps of :func:`sat_jax.study.stats.envelope_map` rows, learning rate (rows) × lag
    (columns), each cell annotated with its value; blank where undefined."""
    if not map_rows:
        return None
    lrs = sorted({r["lr"] for r in map_rows})
    lags = sorted({r["lag"] for r in map_rows})
    fig = _new_figure((3.6 * len(ENVELOPE_PANELS), 0.6 * len(lrs) + 2.2))
    for k, (field, title, cmap, diverging) in enumerate(ENVELOPE_PANELS):
        grid = np.full((len(lrs), len(lags)), np.nan)
        for r in map_rows:
            grid[lrs.index(r["lr"]), lags.index(r["lag"])] = _value(r, field)
        ax = fig.add_subplot(1, len(ENVELOPE_PANELS), k + 1)
        finite = grid[np.isfinite(grid)]
        kwargs = {}
        if finite.size and diverging:
            span = max(float(np.abs(finite).max()), 1e-9)
            kwargs = dict(vmin=-span, vmax=span)
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, aspect="auto", **kwargs)
        fig.colorbar(image, ax=ax, shrink=0.8)
        for i in range(len(lrs)):
            for j in range(len(lags)):
                if math.isfinite(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.3g}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lags)), [str(v) for v in lags])
        ax.set_yticks(range(len(lrs)), [f"{v:g}" for v in lrs])
        ax.set_xlabel("lag")
        ax.set_ylabel("learning rate")
        ax.set_title((titles or {}).get(field, title), fontsize=9)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
