"""Where a run lives: its workdir, and the directories for its logs and checkpoints."""

from __future__ import annotations

import os


def run_dir(config) -> str:
    return config.workdir or os.path.join(
        "runs", f"{config.name}-{config.lag_mode}{config.lag}-seed{config.seed}"
    )


def run_paths(config) -> tuple[str, str]:
    """(local directory for logs and plots, checkpoint directory).

    A URL workdir (``gs://bucket/runs/x``) keeps the checkpoints there, where every host of a
    slice writes its part and a preempted VM loses nothing, and the metrics, TensorBoard files and
    plots in ``runs/x`` on the primary host (``launch/fetch.sh`` copies them back).
    """
    workdir = run_dir(config)
    if "://" in workdir:
        return os.path.abspath(os.path.join("runs", workdir.rstrip("/").rsplit("/", 1)[-1])), (
            workdir.rstrip("/") + "/checkpoints"
        )
    workdir = os.path.abspath(workdir)
    return workdir, os.path.join(workdir, "checkpoints")
