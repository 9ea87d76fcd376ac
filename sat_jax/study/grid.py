"""Study grids: the paper's Table 1 methods (``paper``), its core comparison (``core``) and SAT's
operating envelope over learning rate × lag (``envelope``), plus the grids of the study files
under ``configs/studies/`` (each a Python file whose ``GRIDS`` maps names to grids,
with the constants and calibration notes its protocol fixes: ``stale.py`` is the staleness
study's, built with :func:`stale_grid`), expanded into one training config per (method, lag,
learning rate, seed) cell.

Every method is the built-in default run with the method's objective, R3 and correction swapped
in (``sat_jax.config.method_config``, as ``configs/<method>.py`` does), so the runs of a
grid differ only in the fields the grid varies, and runs on the same seed share the warm-up, the
initial parameters and the prompt order: a paired comparison across methods or lags on one seed
compares the methods, not the luck of the draw.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from sat_jax import config as config_lib
from sat_jax.config.presets import PRESETS
from sat_jax.rl.lag import MODES as LAG_MODES

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
    # The staleness study's extra arms: a collapse-prone one (no trust region) and the
    # matched-step controls (the base objective with a uniformly tighter clip, METHOD_LOSS).
    "tis_pg": ("tis_pg", False, "none"),
    "tis_pg_r3": ("tis_pg", True, "none"),
    "grpo_tight": ("ppo", False, "none"),
    "grpo_tight_r3": ("ppo", True, "none"),
    "gspo_tight": ("gspo", False, "none"),
    "gspo_tight_r3": ("gspo", True, "none"),
    # The field's stabilizers (docs/losses.md), token and GSPO forms: study 2's arms.
    "m2po": ("m2po", False, "none"),
    "m2po_gspo": ("m2po_gspo", False, "none"),
    "bapo": ("bapo", False, "none"),
    "bapo_gspo": ("bapo_gspo", False, "none"),
    "age_clip": ("age_clip", False, "none"),
    "age_clip_gspo": ("age_clip_gspo", False, "none"),
    "cispo": ("cispo", False, "none"),
    "sapo": ("sapo", False, "none"),
    "decoupled_ppo": ("decoupled_ppo", False, "none"),
}

#: ε of the matched-step controls' uniformly tighter clip, ε_low = ε_high (the default run's is
#: 0.2): the default of ``configs/*_tight.py`` and :func:`stale_grid`. A study protocol calibrates
#: its own so that the control's clip fraction matches SAT's (``configs/studies/stale.py``).
TIGHT_EPS = 0.1

#: Loss fields a method sets besides its objective, R3 and correction.
METHOD_LOSS: dict[str, dict[str, Any]] = {
    name: {"eps_low": TIGHT_EPS, "eps_high": TIGHT_EPS}
    for name in ("grpo_tight", "grpo_tight_r3", "gspo_tight", "gspo_tight_r3")
}
# The stabilizers' own knob as a config field (so a grid can --set it), at the loss's default:
# M2PO's τ, BAPO's ρ₀, the age-aware clip's κ (to be tuned on calibration seeds).
METHOD_LOSS.update(
    {name: {"tau": 0.04} for name in ("m2po", "m2po_gspo")}
    | {name: {"rho_target": 0.4} for name in ("bapo", "bapo_gspo")}
    | {name: {"kappa": 0.5} for name in ("age_clip", "age_clip_gspo")}
    | {"sapo": {"aggregation": "seq-mean-token-mean"}}  # the SAPO paper's
)

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
    "tis_pg": "TIS-PG (no clip)",
    "tis_pg_r3": "TIS-PG (no clip) w/ R3",
    "grpo_tight": "GRPO, tight clip",
    "grpo_tight_r3": "GRPO, tight clip, w/ R3",
    "gspo_tight": "GSPO, tight clip",
    "gspo_tight_r3": "GSPO, tight clip, w/ R3",
    "m2po": "M2PO",
    "m2po_gspo": "M2PO-GSPO",
    "bapo": "BAPO",
    "bapo_gspo": "BAPO-GSPO",
    "age_clip": "Age-aware clip",
    "age_clip_gspo": "Age-aware clip (GSPO)",
    "cispo": "CISPO",
    "sapo": "SAPO",
    "decoupled_ppo": "Decoupled PPO (A-3PO)",
}

# Fields the grid sets itself; a --set of one of them would be silently overwritten.
GRID_FIELDS = ("name", "seed", "lag", "lag_mode", "workdir", "resume")


def _check_preset(preset: str, where: str = "") -> None:
    """Raises ValueError (its message prefixed by ``where``) for a name not in ``PRESETS``."""
    if preset not in PRESETS:
        raise ValueError(f"{where}unknown preset {preset!r}; expected one of {sorted(PRESETS)}")


@dataclasses.dataclass(frozen=True)
class Grid:
    """A named grid: methods × lags × learning rates (None: the config's own) × seeds.

    ``method_loss``: ``(method, ((field, value), ...))`` pairs of ``config.loss`` fields this grid
    sets for that method, over :data:`METHOD_LOSS` (the stale grid's tight ε). ``settings``:
    ``KEY=VALUE`` items applied to every run before the command line's ``--set`` (the task,
    model and knobs a protocol fixes).
    """

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
    method_loss: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    settings: tuple[str, ...] = ()
    #: The grid's own lag mode (a protocol fixes it); None: the command's ``--lag_mode``. An
    #: explicit ``--lag_mode`` still wins (its runs are named by their mode).
    lag_mode: str | None = None
    #: Run every cell of seed 0, then of seed 1, ... (:func:`expand`): the grid's runs then
    #: share a warm-up per seed even when they span machines, whose warm-ups differ in float
    #: rounding (a session boundary splits at most one seed, which ``results.md`` flags).
    seed_major: bool = False
    #: The grid's seeds are first_seed, first_seed + 1, ...: a study re-run on seeds it did not
    #: use, or phase 1 on seeds its calibration did not choose a setting on.
    first_seed: int = 0
    #: ``(method, lags)`` pairs: the arms run at their own lags rather than ``lags`` (a protocol
    #: whose low-staleness reference runs only some arms).
    arm_lags: tuple[tuple[str, tuple[int, ...]], ...] = ()
    #: ``(method, seeds)`` pairs: the arms run on their own number of seeds, from ``first_seed``
    #: (a protocol that gives its primary comparison more seeds than the other arms).
    arm_seeds: tuple[tuple[str, int], ...] = ()
    #: The lag at which the primary comparison is the plain paired difference treatment − control
    #: (study 2); None: the comparison is the interaction between the lowest and highest lag.
    primary_lag: int | None = None

    @property
    def seed_range(self) -> range:
        return range(self.first_seed, self.first_seed + self.seeds)

    def lags_of(self, method: str) -> tuple[int, ...]:
        """The lags ``method`` runs at: its own (``arm_lags``) or the grid's."""
        return dict(self.arm_lags).get(method, self.lags)

    def seeds_of(self, method: str) -> range:
        """The seeds ``method`` runs on: its own count (``arm_seeds``) from ``first_seed``, or the
        grid's."""
        return range(
            self.first_seed, self.first_seed + dict(self.arm_seeds).get(method, self.seeds)
        )

    @property
    def all_lags(self) -> tuple[int, ...]:
        """Every lag some method of the grid runs at, ascending."""
        return tuple(sorted({lag for m in self.methods for lag in self.lags_of(m)}))

    @property
    def max_seeds(self) -> int:
        """The most seeds any method of the grid runs on."""
        return max(len(self.seeds_of(m)) for m in self.methods)


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
}


def stale_grid(
    arms: Sequence[str] = ("grpo", "sat_grpo", "grpo_tight"),
    *,
    lags: Sequence[int] = (1, 8),
    seeds: int = 8,
    baseline: str = "grpo",
    primary: tuple[str, str] | None = ("sat_grpo", "grpo"),
    tight_eps: float = TIGHT_EPS,
    preset: str = "stale",
    settings: Sequence[str] = (),
    lag_mode: str | None = None,
    first_seed: int = 0,
    arm_loss: Mapping[str, Mapping[str, Any]] | None = None,
    arm_lags: Mapping[str, Sequence[int]] | None = None,
    arm_seeds: Mapping[str, int] | None = None,
    primary_lag: int | None = None,
) -> Grid:
    """The staleness study's grid: ``arms`` × ``lags`` × ``seeds`` on the ``preset`` base run,
    paired on seed.

    The defaults are phase 1's minimum (a base, SAT on the same base and the matched-step
    control, at lag 1 and a high lag, 8 seeds; the pre-registered comparison ``primary`` is
    (treatment, control) = (SAT, base)); the protocol (docs/results/stale/PROTOCOL.md) fixes
    the arms, lags, seeds, the control's ``tight_eps`` (ε_low = ε_high of every ``*_tight``
    arm), the ``settings`` (``KEY=VALUE`` over the preset: mismatch knobs, learning rate) and the
    ``lag_mode`` after calibration, and the study file's ``stale`` grid
    (``configs/studies/stale.py``) is then this function at those values.

    A protocol whose arms differ (study 2, ``configs/studies/stale2.py``) gives ``arm_loss``
    (arm -> ``config.loss`` fields over the tight ε: a calibrated constant), ``arm_lags`` (arm
    -> its own lags, a subset of ``lags``), ``arm_seeds`` (arm -> its own number of seeds, at
    most ``seeds``) and ``primary_lag`` (the lag at which ``primary`` is a plain paired
    difference, :func:`sat_jax.study.stats.difference_tests`, rather than a lag interaction).

    Raises:
      ValueError: an unknown arm or preset, a baseline or primary arm not among the arms,
        seeds < 1, a negative ``first_seed``, no lags, ``tight_eps`` outside (0, 1), a setting
        that names a field the grid sets itself, an unknown lag mode; a per-arm entry for an
        arm not in ``arms``, lags outside ``lags``, a seed count outside [1, seeds], a
        ``primary_lag`` without ``primary`` or at which a primary arm does not run.
    """
    arms = tuple(arms)
    unknown = [a for a in arms if a not in METHODS]
    if not arms or unknown or len(set(arms)) != len(arms):
        raise ValueError(
            f"stale grid: arms must be distinct names from {sorted(METHODS)}, got {arms}"
        )
    if baseline not in arms:
        raise ValueError(f"stale grid: baseline {baseline!r} is not one of the arms {arms}")
    if primary is not None and (len(primary) != 2 or not set(primary) <= set(arms)):
        raise ValueError(f"stale grid: primary {primary!r} must be two of the arms {arms}")
    _check_preset(preset, "stale grid: ")
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"stale grid: seeds must be an int >= 1, got {seeds!r}")
    if isinstance(first_seed, bool) or not isinstance(first_seed, int) or first_seed < 0:
        raise ValueError(f"stale grid: first_seed must be an int >= 0, got {first_seed!r}")
    if not lags or any(int(v) < 0 for v in lags):
        raise ValueError(f"stale grid: lags must be non-negative integers, got {list(lags)}")
    if not 0 < float(tight_eps) < 1:
        raise ValueError(f"stale grid: tight_eps must lie in (0, 1), got {tight_eps!r}")
    for item in settings:
        if item.partition("=")[0] in GRID_FIELDS:
            raise ValueError(f"stale grid: setting {item!r} names a field the grid sets")
    if lag_mode is not None and lag_mode not in LAG_MODES:
        raise ValueError(f"stale grid: lag_mode must be one of {LAG_MODES}, got {lag_mode!r}")
    arm_loss, arm_lags, arm_seeds = (
        dict(arm_loss or {}),
        dict(arm_lags or {}),
        dict(arm_seeds or {}),
    )
    for what, table in (("arm_loss", arm_loss), ("arm_lags", arm_lags), ("arm_seeds", arm_seeds)):
        strays = sorted(set(table) - set(arms))
        if strays:
            raise ValueError(f"stale grid: {what} names {strays}, not among the arms {arms}")
    for arm, own in arm_lags.items():
        own = tuple(int(v) for v in own)
        if not own or not set(own) <= set(int(v) for v in lags) or len(set(own)) != len(own):
            raise ValueError(
                f"stale grid: arm_lags[{arm!r}] must be distinct lags among {list(lags)}, got "
                f"{list(own)}"
            )
        arm_lags[arm] = own
    for arm, n in arm_seeds.items():
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= seeds:
            raise ValueError(
                f"stale grid: arm_seeds[{arm!r}] must be an int in [1, {seeds}], got {n!r}"
            )
    if primary_lag is not None:
        if primary is None:
            raise ValueError("stale grid: primary_lag needs a primary comparison")
        for arm in primary:
            if int(primary_lag) not in arm_lags.get(arm, tuple(int(v) for v in lags)):
                raise ValueError(
                    f"stale grid: primary arm {arm!r} does not run at primary_lag {primary_lag}"
                )
    eps = {"eps_low": float(tight_eps), "eps_high": float(tight_eps)}
    # The tight ε goes to the tight-clip arms only (the stabilizers' own knobs are their
    # METHOD_LOSS defaults, at the base's ε); then each arm's calibrated constants.
    fields = {
        a: {**(eps if "eps_low" in METHOD_LOSS.get(a, {}) else {}), **arm_loss.get(a, {})}
        for a in arms
    }
    method_loss = tuple((a, tuple(f.items())) for a, f in fields.items() if f)
    return Grid(
        "stale",
        arms,
        baseline=baseline,
        lags=tuple(int(v) for v in lags),
        seeds=seeds,
        description="the staleness study (docs/results/stale): a base, SAT on the same base and "
        "the matched-step control (a uniformly tighter clip), at lag 1 and a high lag",
        primary=None if primary is None else tuple(primary),
        preset=preset,
        method_loss=method_loss,
        settings=tuple(settings),
        lag_mode=lag_mode,
        seed_major=True,
        first_seed=first_seed,
        arm_lags=tuple(arm_lags.items()),
        arm_seeds=tuple(arm_seeds.items()),
        primary_lag=None if primary_lag is None else int(primary_lag),
    )


#: The study files' directory: ``configs/studies/`` of the source tree.
STUDIES_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "configs",
    "studies",
)


def load_study(path: str) -> dict[str, Any]:
    """The names a study file defines (its module namespace); its ``GRIDS`` must map each name
    to a :class:`Grid` of that name.

    Raises:
      ValueError: the file defines no ``GRIDS``, or an entry that is not a Grid of its name.
    """
    spec = importlib.util.spec_from_file_location(
        f"sat_jax_study_{os.path.splitext(os.path.basename(path))[0]}", path
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    grids = getattr(module, "GRIDS", None)
    if not isinstance(grids, Mapping) or not grids:
        raise ValueError(f"study file {path}: needs GRIDS, a dict of grid name -> Grid")
    for name, grid in grids.items():
        if not isinstance(grid, Grid) or grid.name != name:
            raise ValueError(f"study file {path}: GRIDS[{name!r}] must be a Grid named {name!r}")
    return vars(module)


@functools.cache
def study_grids(directory: str = STUDIES_DIR) -> dict[str, Grid]:
    """Every grid of the study files in ``directory`` (none where it does not exist: an installed
    package without the source tree), by name.

    Raises:
      ValueError: a bad study file, or a name defined twice (also by :data:`GRIDS`).
    """
    out: dict[str, Grid] = {}
    paths = sorted(
        os.path.join(directory, f)
        for f in (os.listdir(directory) if os.path.isdir(directory) else ())
        if f.endswith(".py") and not f.startswith("_")
    )
    for path in paths:
        for name, grid in load_study(path)["GRIDS"].items():
            if name in out or name in GRIDS:
                raise ValueError(f"study file {path}: grid {name!r} is defined twice")
            out[name] = grid
    return out


def grids() -> dict[str, Grid]:
    """The built-in grids and the study files' grids, by name."""
    return {**GRIDS, **study_grids()}


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
        """``<method>-<lagmode><lag>-lr<lr>-seed<s>``: the run's directory under ``DIR/runs``.

        The rate is written with ``:g`` (``lr0.0003``) where that is exact, else in full
        (``lr0.00010000001``), so two rates never share a directory.
        """
        lr = f"{self.lr:g}"
        if float(lr) != self.lr:
            lr = repr(self.lr)
        return f"{self.method}-{self.lag_mode}{self.lag}-lr{lr}-seed{self.seed}"


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
    preset: str | None = None,
) -> Grid:
    """The named grid with the command line's choices applied, checked. ``seeds`` and ``lags``
    apply to every method (they replace the arms' own ``arm_seeds`` and ``arm_lags``).

    Raises:
      ValueError: unknown grid, method or preset, seeds < 1, no lags, a baseline not in the
        methods.
    """
    if isinstance(grid, str):
        known = grids()
        if grid not in known:
            raise ValueError(f"--grid: unknown grid {grid!r}; expected one of {tuple(known)}")
        grid = known[grid]
    changes = {}
    if seeds is not None:
        if int(seeds) < 1:
            raise ValueError(f"--seeds must be >= 1, got {seeds}")
        changes["seeds"], changes["arm_seeds"] = int(seeds), ()
    if lags is not None:
        if not lags or any(int(v) < 0 for v in lags):
            raise ValueError(f"--lags must be non-negative integers, got {list(lags)}")
        changes["lags"], changes["arm_lags"] = tuple(int(v) for v in lags), ()
    if lrs is not None:
        changes["lrs"] = tuple(float(v) for v in lrs)
    if methods is not None:
        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            raise ValueError(f"--methods: unknown method(s) {unknown}")
        changes["methods"] = tuple(methods)
    if baseline is not None:
        changes["baseline"] = baseline
    if preset is not None:
        _check_preset(preset, "--preset: ")
        changes["preset"] = preset
    grid = dataclasses.replace(grid, **changes)
    if grid.baseline not in grid.methods:
        raise ValueError(
            f"--baseline {grid.baseline!r} is not one of the grid's methods {grid.methods}"
        )
    return grid


def method_config(method: str, preset: str = "default", loss: Mapping[str, Any] | None = None):
    """The ``preset`` base run with ``method`` swapped in (for ``default``, the config of
    ``configs/<method>.py``), its :data:`METHOD_LOSS` fields set and then ``loss``
    (``config.loss`` field -> value)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {sorted(METHODS)}")
    _check_preset(preset)
    objective, r3, correction = METHODS[method]
    fields = {**METHOD_LOSS.get(method, {}), **(loss or {})}
    return config_lib.method_config(
        method, objective, r3=r3, correction=correction, base=PRESETS[preset], **fields
    )


def expand(
    grid: Grid, out_dir: str, *, lag_mode: str | None = None, overrides: Sequence[str] = ()
) -> list[tuple[RunSpec, object]]:
    """(spec, config) of every run of ``grid``: methods × lags × learning rates × seeds in that
    order (seed innermost, so one method's runs, which share a compiled step, are adjacent), or
    with ``grid.seed_major`` seed outermost and that order within each seed.
    ``lag_mode``: every run's (None: the grid's own, else broadcast).

    ``overrides`` (``KEY=VALUE``, :func:`apply_override`) apply to every run before the grid's own
    fields; a learning rate from ``grid.lrs`` replaces ``optim.learning_rate``.

    Raises:
      ValueError: an override names a field the grid sets, or is malformed; two runs would share
        a directory.
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
    lag_mode = lag_mode or grid.lag_mode or "broadcast"
    out = []
    method_loss = {m: dict(fields) for m, fields in grid.method_loss}
    for method in grid.methods:
        for lag, lr_choice in itertools.product(grid.lags_of(method), grid.lrs or (None,)):
            for seed in grid.seeds_of(method):
                c = method_config(method, grid.preset, method_loss.get(method))
                for item in (*grid.settings, *overrides):
                    apply_override(c, item)
                lr = float(c.optim.learning_rate if lr_choice is None else lr_choice)
                spec = RunSpec(method, lag_mode, int(lag), lr, seed)
                c.optim.learning_rate = lr
                c.seed, c.lag, c.lag_mode = seed, int(lag), lag_mode
                c.workdir = os.path.join(os.path.abspath(out_dir), "runs", spec.name)
                c.resume = True
                c.log.progress = False
                out.append((spec, c))
    if grid.seed_major:
        out.sort(key=lambda run: run[0].seed)  # stable: the order above within a seed
    owners: dict[str, RunSpec] = {}
    for spec, c in out:
        first = owners.setdefault(c.workdir, spec)
        if first is not spec:
            raise ValueError(f"runs {first} and {spec} would share the directory {c.workdir}")
    return out
