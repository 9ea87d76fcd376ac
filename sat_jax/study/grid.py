"""Study grids: the paper's Table 1 methods (``paper``), its core comparison (``core``) and SAT's
operating envelope over learning rate × lag (``envelope``), expanded into one training config per
(method, lag, learning rate, seed) cell.

Every method is the built-in default run with the method's objective, R3 and correction swapped
in (``sat_jax.config.method_config``, as ``configs/<method>.py`` does), so the runs of a
grid differ only in the fields the grid varies, and runs on the same seed share the warm-up, the
initial parameters and the prompt order: a paired comparison across methods or lags on one seed
compares the methods, not the luck of the draw.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Sequence

from sat_jax import config as config_lib
from sat_jax.config.presets import PRESETS

#: Method name -> (objective, R3, correction): the paper's grid (Table 1), as in configs/.
METHODS: dict[str, tuple[str, bool, str]] = {
    "grpo": ("ppo", False, "none"),
    "grpo_r3": ("ppo", True, "none"),
    "grpo_tis": ("ppo", False, "tis"),
    "grpo_tis_r3": ("ppo", True, "tis"),
    "gspo": ("gspo", False, "none"),
    "gspo_r3": ("gspo", True, "none"),
    "gspo_tis": ("gspo", False, "tis"),
    "gspo_tis_r3": ("gspo", True, "tis"),
    "dppo": ("dppo", False, "none"),
    "sat_grpo": ("sat", False, "none"),
    "sat_grpo_r3": ("sat", True, "none"),
    "sat_gspo": ("sat_gspo", False, "none"),
    "sat_gspo_r3": ("sat_gspo", True, "none"),
}

#: The paper's names of the methods (Table 1).
LABELS = {
    "grpo": "GRPO",
    "grpo_r3": "GRPO w/ R3",
    "grpo_tis": "GRPO w/ TIS",
    "grpo_tis_r3": "GRPO w/ TIS w/ R3",
    "gspo": "GSPO",
    "gspo_r3": "GSPO w/ R3",
    "gspo_tis": "GSPO w/ TIS",
    "gspo_tis_r3": "GSPO w/ TIS w/ R3",
    "dppo": "DPPO",
    "sat_grpo": "SAT-GRPO",
    "sat_grpo_r3": "SAT-GRPO w/ R3",
    "sat_gspo": "SAT-GSPO",
    "sat_gspo_r3": "SAT-GSPO w/ R3",
}

# Fields the grid sets itself; a --set of one of them would be silently overwritten.
GRID_FIELDS = ("name", "seed", "lag", "lag_mode", "workdir", "resume")


@dataclasses.dataclass(frozen=True)
class Grid:
    """A named grid: methods × lags × learning rates (None: the config's own) × seeds."""

    name: str
    methods: tuple[str, ...]
    baseline: str
    lags: tuple[int, ...] = (1, 8)
    lrs: tuple[float, ...] | None = None
    seeds: int = 3
    description: str = ""
    #: (treatment, control): the pre-registered comparison whose lag interaction results.md tests
    #: (``sat_jax.study.stats.primary_tests``); None for exploratory grids.
    primary: tuple[str, str] | None = None
    #: The base run every method is swapped into (``sat_jax.config.presets.PRESETS``).
    preset: str = "default"


GRIDS: dict[str, Grid] = {
    "paper": Grid(
        "paper",
        (
            "grpo",
            "grpo_r3",
            "grpo_tis",
            "grpo_tis_r3",
            "gspo",
            "gspo_r3",
            "gspo_tis",
            "gspo_tis_r3",
            "dppo",
            "sat_grpo",
            "sat_grpo_r3",
            "sat_gspo",
            "sat_gspo_r3",
        ),
        baseline="grpo",
        description="the paper's Table 1: GRPO and GSPO, each plain, w/ R3, w/ TIS and w/ both; "
        "DPPO; SAT-GRPO and SAT-GSPO, each plain and w/ R3",
    ),
    "core": Grid(
        "core",
        ("grpo_r3", "gspo_r3", "dppo", "sat_grpo_r3", "sat_gspo_r3"),
        baseline="grpo_r3",
        description="GRPO, GSPO, DPPO, SAT-GRPO, SAT-GSPO; R3 wherever the paper's best run of "
        "the family uses it (Table 1: every family but DPPO, which the paper runs "
        "without)",
    ),
    "envelope": Grid(
        "envelope",
        ("grpo", "sat_grpo"),
        baseline="grpo",
        lags=(1, 2, 4, 8),
        lrs=(1e-4, 3e-4, 1e-3),
        description="SAT's operating envelope: GRPO and SAT-GRPO over learning rate × lag",
    ),
    "stale-phase0": Grid(
        "stale-phase0",
        ("grpo", "sat_grpo"),
        baseline="grpo",
        lags=(1, 8),
        lrs=(1e-4, 3e-4, 1e-3),
        seeds=1,
        preset="stale",
        description="phase 0 of the staleness study (calibration, one seed): GRPO and SAT-GRPO "
        "on the long-response testbed over learning rate × lag; the setting is chosen by "
        "sat_jax.study.calibration's manipulation checks, not by SAT's accuracy",
    ),
}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One cell of a grid on one seed."""

    method: str
    lag_mode: str
    lag: int
    lr: float
    seed: int

    @property
    def name(self) -> str:
        """``<method>-<lagmode><lag>-lr<lr>-seed<s>``: the run's directory under ``DIR/runs``."""
        return f"{self.method}-{self.lag_mode}{self.lag}-lr{self.lr:g}-seed{self.seed}"


def parse_ints(text: str, what: str, *, minimum: int = 0) -> tuple[int, ...]:
    """``"1,8"`` -> ``(1, 8)``; a bad item, a repeat, a value below ``minimum`` or an empty list
    is a ``ValueError`` naming ``what``."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"{what} needs a comma-separated list of integers, got {text!r}")
    try:
        values = tuple(int(t) for t in items)
    except ValueError:
        raise ValueError(f"{what} needs a comma-separated list of integers, got {text!r}") from None
    bad = [v for v in values if v < minimum]
    if bad:
        raise ValueError(f"{what} values must be >= {minimum}, got {bad}")
    if len(set(values)) != len(values):
        raise ValueError(f"{what} has repeated values: {text!r}")
    return values


def parse_floats(text: str, what: str) -> tuple[float, ...]:
    """``"1e-4,3e-4"`` -> ``(1e-4, 3e-4)``; each must be a finite positive number."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    try:
        values = tuple(float(t) for t in items)
    except ValueError:
        raise ValueError(f"{what} needs a comma-separated list of numbers, got {text!r}") from None
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        raise ValueError(f"{what} needs positive finite numbers, got {text!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"{what} has repeated values: {text!r}")
    return values


def parse_methods(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in str(text).split(",") if t.strip())
    unknown = [n for n in names if n not in METHODS]
    if not names or unknown:
        raise ValueError(
            f"--methods: unknown method(s) {unknown or text!r}; expected names from "
            f"{sorted(METHODS)}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"--methods has repeated names: {text!r}")
    return names


def apply_override(config, item: str) -> None:
    """Sets a dotted config field from ``KEY=VALUE``, parsed with the field's current type
    (``true``/``1``/``yes`` for booleans; ``false``/``0``/``no`` too, anything else refused).

    Raises:
      ValueError: not ``KEY=VALUE``, an unknown field, or a value the field's type refuses.
    """
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ValueError(f"--set needs KEY=VALUE, got {item!r}")
    *path, leaf = key.split(".")
    node = config
    for part in path:
        if part not in node or not hasattr(node[part], "keys"):
            raise ValueError(f"--set: unknown config field {key!r}")
        node = node[part]
    if leaf not in node or hasattr(node[leaf], "keys"):
        raise ValueError(f"--set: unknown config field {key!r}")
    current = node[leaf]
    if isinstance(current, bool):
        if raw.lower() not in ("1", "true", "yes", "0", "false", "no"):
            raise ValueError(f"--set {key}: expected true or false, got {raw!r}")
        value = raw.lower() in ("1", "true", "yes")
    elif current is None:
        value = raw
    else:
        try:
            value = type(current)(raw)
        except ValueError:
            raise ValueError(
                f"--set {key}: expected a {type(current).__name__}, got {raw!r}"
            ) from None
    node[leaf] = value


def resolve(
    grid: str | Grid,
    *,
    seeds: int | None = None,
    lags: Sequence[int] | None = None,
    lrs: Sequence[float] | None = None,
    methods: Sequence[str] | None = None,
    baseline: str | None = None,
) -> Grid:
    """The named grid with the command line's choices applied, checked.

    Raises:
      ValueError: unknown grid or method, seeds < 1, no lags, a baseline not in the methods.
    """
    if isinstance(grid, str):
        if grid not in GRIDS:
            raise ValueError(f"--grid: unknown grid {grid!r}; expected one of {tuple(GRIDS)}")
        grid = GRIDS[grid]
    changes = {}
    if seeds is not None:
        if int(seeds) < 1:
            raise ValueError(f"--seeds must be >= 1, got {seeds}")
        changes["seeds"] = int(seeds)
    if lags is not None:
        if not lags or any(int(v) < 0 for v in lags):
            raise ValueError(f"--lags must be non-negative integers, got {list(lags)}")
        changes["lags"] = tuple(int(v) for v in lags)
    if lrs is not None:
        changes["lrs"] = tuple(float(v) for v in lrs)
    if methods is not None:
        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            raise ValueError(f"--methods: unknown method(s) {unknown}")
        changes["methods"] = tuple(methods)
    if baseline is not None:
        changes["baseline"] = baseline
    grid = dataclasses.replace(grid, **changes)
    if grid.baseline not in grid.methods:
        raise ValueError(
            f"--baseline {grid.baseline!r} is not one of the grid's methods {grid.methods}"
        )
    return grid


def method_config(method: str, preset: str = "default"):
    """The ``preset`` base run with ``method`` swapped in (for ``default``, the config of
    ``configs/<method>.py``)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {sorted(METHODS)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {sorted(PRESETS)}")
    objective, r3, correction = METHODS[method]
    return config_lib.method_config(
        method, objective, r3=r3, correction=correction, base=PRESETS[preset]
    )


def expand(
    grid: Grid, out_dir: str, *, lag_mode: str = "broadcast", overrides: Sequence[str] = ()
) -> list[tuple[RunSpec, object]]:
    """(spec, config) of every run of ``grid``: methods × lags × learning rates × seeds in that
    order (seed innermost, so one method's runs, which share a compiled step, are adjacent).

    ``overrides`` (``KEY=VALUE``, :func:`apply_override`) apply to every run before the grid's own
    fields; a learning rate from ``grid.lrs`` replaces ``optim.learning_rate``.

    Raises:
      ValueError: an override names a field the grid sets, or is malformed.
    """
    for item in overrides:
        key = item.partition("=")[0]
        if key in GRID_FIELDS:
            raise ValueError(
                f"--set {key}: the grid sets this field (use --lags, --seeds, --lag_mode or --out)"
            )
        if key == "optim.learning_rate" and grid.lrs is not None:
            raise ValueError(
                "--set optim.learning_rate: this grid varies the learning rate; use --lrs"
            )
    out = []
    for method, lag in itertools.product(grid.methods, grid.lags):
        for lr_choice in grid.lrs or (None,):
            for seed in range(grid.seeds):
                c = method_config(method, grid.preset)
                for item in overrides:
                    apply_override(c, item)
                lr = float(c.optim.learning_rate if lr_choice is None else lr_choice)
                spec = RunSpec(method, lag_mode, int(lag), lr, seed)
                c.optim.learning_rate = lr
                c.seed, c.lag, c.lag_mode = seed, int(lag), lag_mode
                c.workdir = os.path.join(os.path.abspath(out_dir), "runs", spec.name)
                c.resume = True
                c.log.progress = False
                out.append((spec, c))
    return out
