"""Studies: grids of training runs (methods × lags × learning rates × seeds), built in or read
from study files (``configs/studies/*.py``), run resumably, and the statistics, tables and plots
of their results (``sat-jax compare --grid NAME``)."""

from sat_jax.study.grid import (
    GRIDS,
    LABELS,
    METHODS,
    Grid,
    RunSpec,
    apply_override,
    expand,
    grids,
    load_study,
    method_config,
    resolve,
)
from sat_jax.study.runner import Interrupted, is_finished, mark_finished, run_all
from sat_jax.study.stats import (
    CollapseRule,
    envelope_map,
    mean_sd,
    paired,
    paired_rows,
    summarize_run,
    t_quantile,
)

__all__ = [
    "GRIDS",
    "LABELS",
    "METHODS",
    "CollapseRule",
    "Grid",
    "Interrupted",
    "RunSpec",
    "apply_override",
    "envelope_map",
    "expand",
    "grids",
    "is_finished",
    "load_study",
    "mark_finished",
    "mean_sd",
    "method_config",
    "paired",
    "paired_rows",
    "resolve",
    "run_all",
    "summarize_run",
    "t_quantile",
]
