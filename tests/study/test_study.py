"""sat_jax.study on synthetic metrics and fake runs (nothing here trains): grid expansion,
config overrides, resume (a finished run is not re-run), the collapse rule, Student's t and the
paired statistics against hand-computed cases, the tables and results files, the shared train
step's key, and the command line's errors (exit 2 before anything runs)."""

import csv
import dataclasses
import gzip
import importlib.util
import json
import math
import os
import types

import pytest
from _study_cli import invoke

from sat_jax import cli
from sat_jax import config as config_lib
from sat_jax.config import presets
from sat_jax.run import metrics as run_metrics
from sat_jax.study import grid as study_grid
from sat_jax.study import report, runner, stats, tables
from sat_jax.train import components

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --------------------------------------------------------------------------- grid expansion


def test_paper_core_envelope_sizes_and_names(tmp_path):
    paper = study_grid.expand(study_grid.resolve("paper"), str(tmp_path))
    assert len(paper) == 13 * 2 * 3  # Table 1's 13 methods × lags 1, 8 × 3 seeds
    names = [spec.name for spec, _ in paper]
    assert len(set(names)) == len(names)
    assert names[0] == "grpo-broadcast1-lr0.0001-seed0"
    env = study_grid.resolve("envelope", seeds=2, lags=(1, 4), lrs=(1e-4, 1e-3))
    runs = study_grid.expand(env, str(tmp_path), lag_mode="fixed")
    assert len(runs) == 2 * 2 * 2 * 2
    spec, c = runs[3]  # grpo, lag 1, lr 1e-3, seed 1 (seed innermost, then lr, lag, method)
    assert (spec.method, spec.lag, spec.lr, spec.seed) == ("grpo", 1, 1e-3, 1)
    assert (c.optim.learning_rate, c.lag, c.seed, c.lag_mode) == (1e-3, 1, 1, "fixed")
    assert c.workdir == os.path.join(str(tmp_path), "runs", "grpo-fixed1-lr0.001-seed1")
    assert c.resume is True
    core = {spec.method for spec, _ in study_grid.expand(study_grid.resolve("core"), "x")}
    assert core == {"grpo_r3", "gspo_r3", "dppo", "sat_grpo_r3", "sat_gspo_r3"}


def test_a_preset_grid_starts_every_run_from_its_preset(tmp_path):
    runs = study_grid.expand(study_grid.resolve("stale-phase0"), str(tmp_path))
    assert len(runs) == 2 * 2 * 3 * 1  # grpo, sat_grpo × lags 1, 8 × 3 lrs × 1 seed
    base = presets.stale_sort()
    for spec, c in runs:
        assert c.data.task == base.data.task == "sort_digits"
        assert c.model.num_experts == base.model.num_experts and c.loss.r3 is False
        assert c.loss.objective == {"grpo": "ppo", "sat_grpo": "sat"}[spec.method]
        assert c.name == spec.method and c.optim.learning_rate == spec.lr
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        study_grid.method_config("grpo", "nope")
    # --preset swaps the base run under the same grid
    mul = study_grid.expand(study_grid.resolve("stale-phase0", preset="stale"), str(tmp_path))
    assert [s.name for s, _ in mul] == [s.name for s, _ in runs]
    assert {c.data.task for _, c in mul} == {presets.stale_base().data.task}
    with pytest.raises(ValueError, match="--preset: unknown preset 'nope'"):
        study_grid.resolve("stale-phase0", preset="nope")


def test_stale_grid_expands_to_exactly_its_declared_runs(tmp_path):
    # The function's default: phase 1's minimum, 3 arms × lags 1, 8 × 8 seeds, seed by seed
    # (all of a seed's runs before the next seed's, so a seed's runs share one machine's warm-up).
    default = study_grid.expand(study_grid.stale_grid(), str(tmp_path))
    assert [(s.method, s.lag, s.seed) for s, _ in default] == [
        (m, lag, seed)
        for seed in range(8)
        for m in ("grpo", "sat_grpo", "grpo_tight")
        for lag in (1, 8)
    ]
    # Every parameter is the protocol's to fix.
    g = study_grid.stale_grid(
        ("gspo_r3", "sat_gspo_r3", "gspo_tight_r3", "tis_pg_r3"),
        lags=(1, 16),
        seeds=3,
        baseline="gspo_r3",
        primary=("sat_gspo_r3", "gspo_r3"),
        tight_eps=0.05,
        settings=("num_steps=300", "rollout.router_noise=0.2"),
    )
    runs = study_grid.expand(g, str(tmp_path), lag_mode="fixed", overrides=["num_steps=200"])
    want = [
        (m, lag, seed)
        for seed in range(3)
        for m in ("gspo_r3", "sat_gspo_r3", "gspo_tight_r3", "tis_pg_r3")
        for lag in (1, 16)
    ]
    assert [(s.method, s.lag, s.seed) for s, _ in runs] == want
    assert len({s.name for s, _ in runs}) == len(want) == 24
    assert g.primary == ("sat_gspo_r3", "gspo_r3") and g.preset == "stale"
    # Seeds from first_seed on (a re-run on unused seeds), still seed by seed.
    later = study_grid.expand(study_grid.stale_grid(seeds=2, first_seed=8), str(tmp_path))
    assert [(s.method, s.lag, s.seed) for s, _ in later] == [
        (m, lag, seed)
        for seed in (8, 9)
        for m in ("grpo", "sat_grpo", "grpo_tight")
        for lag in (1, 8)
    ]
    assert all(c.seed == s.seed and c.workdir.endswith(s.name) for s, c in later)
    for spec, c in runs:
        objective, r3, _ = study_grid.METHODS[spec.method]
        assert (c.loss.objective, c.loss.r3, c.lag, c.seed, c.lag_mode) == (
            objective,
            r3,
            spec.lag,
            spec.seed,
            "fixed",
        )
        tight = spec.method == "gspo_tight_r3"
        assert (c.loss.eps_low, c.loss.eps_high) == ((0.05, 0.05) if tight else (0.2, 0.2))
        # The stale preset, the grid's settings, then the command line's --set over them.
        assert c.data.task == presets.stale_base().data.task
        assert (c.num_steps, c.rollout.router_noise) == (200, 0.2)
    tis = [c for s, c in runs if s.method == "tis_pg_r3"]
    assert tis and all(c.loss.tis_pg_cap == 2.0 for c in tis)


def test_the_stale_grid_is_the_protocol(tmp_path):
    """``--grid stale`` expands to exactly PROTOCOL.md's 48 runs: GSPO, SAT-GSPO and the
    matched-step control × fixed lags 1 and 4 × seeds 4-11 (seed by seed) on the sorting preset,
    lr 7e-5, 300 steps, evaluated on 512 held-out prompts; the control's ε is the protocol's."""
    g = study_grid.resolve("stale")
    assert g.primary == ("sat_gspo", "gspo") and g.baseline == "gspo"
    runs = study_grid.expand(g, str(tmp_path))
    assert [(s.method, s.lag, s.seed) for s, _ in runs] == [
        (m, lag, seed)
        for seed in range(4, 12)
        for m in ("gspo", "sat_gspo", "gspo_tight")
        for lag in (1, 4)
    ]
    eps = study_grid.load_study(os.path.join(study_grid.STUDIES_DIR, "stale.py"))["STALE_TIGHT_EPS"]
    for spec, c in runs:
        assert (spec.lag_mode, c.lag_mode, c.lag, c.seed) == ("fixed", "fixed", spec.lag, spec.seed)
        assert c.loss.objective == study_grid.METHODS[spec.method][0] and c.loss.r3 is False
        assert (c.data.task, c.data.mixture) == ("sort_digits", "16:1,24:1,32:1")
        assert (c.optim.learning_rate, c.num_steps, c.eval.every) == (7e-5, 300, 25)
        assert c.eval.num_prompts == 512 == c.data.eval_size
        want = eps if spec.method == "gspo_tight" else 0.2
        assert (c.loss.eps_low, c.loss.eps_high) == (want, want)
    assert runs[0][0].name == "gspo-fixed1-lr7e-05-seed4"
    with open(os.path.join(ROOT, "docs", "results", "stale", "PROTOCOL.md"), encoding="utf-8") as f:
        protocol = f.read()
    assert f"ε_low = ε_high = {eps:g}" in protocol and "Seeds 4–11" in protocol


def test_the_stale_rerun_is_the_protocol_on_seeds_12_to_19(tmp_path):
    """``--grid stale-rerun``: every run of ``--grid stale``, config for config, on seeds 12-19."""
    first = study_grid.expand(study_grid.resolve("stale"), str(tmp_path))
    rerun = study_grid.expand(study_grid.resolve("stale-rerun"), str(tmp_path))
    assert len(rerun) == len(first) == 48
    assert [s.seed for s, _ in rerun] == [s.seed + 8 for s, _ in first]
    assert study_grid.resolve("stale-rerun").primary == study_grid.resolve("stale").primary
    for (a, ca), (b, cb) in zip(first, rerun, strict=True):
        assert dataclasses.replace(b, seed=a.seed) == a
        da, db = ca.to_dict(), cb.to_dict()
        assert db.pop("seed") == da.pop("seed") + 8
        del da["workdir"], db["workdir"]
        assert cb.workdir.endswith(b.name) and da == db


def test_arms_run_at_their_own_lags_and_seeds_with_their_own_constants(tmp_path):
    """A protocol whose arms differ (study 2): some arms only at the high lag, fewer seeds for the
    secondary arms, a calibrated constant per arm; the tight ε goes to the tight clip only."""
    g = study_grid.stale_grid(
        ("gspo", "sat_gspo", "gspo_tight", "m2po_gspo", "age_clip_gspo"),
        lags=(1, 8),
        seeds=3,
        first_seed=20,
        baseline="gspo",
        primary=("sat_gspo", "gspo_tight"),
        primary_lag=8,
        tight_eps=0.07,
        preset="stale_sort",
        arm_loss={"m2po_gspo": {"tau": 1e-4}, "age_clip_gspo": {"kappa": 0.3}},
        arm_lags={"m2po_gspo": (8,), "age_clip_gspo": (8,)},
        arm_seeds={"m2po_gspo": 2, "age_clip_gspo": 2},
    )
    runs = study_grid.expand(g, str(tmp_path))
    want = [
        (m, lag, seed)
        for seed in (20, 21, 22)
        for m in ("gspo", "sat_gspo", "gspo_tight", "m2po_gspo", "age_clip_gspo")
        for lag in ((8,) if m in ("m2po_gspo", "age_clip_gspo") else (1, 8))
        if seed < 22 or m not in ("m2po_gspo", "age_clip_gspo")
    ]
    assert [(s.method, s.lag, s.seed) for s, _ in runs] == want and len(want) == 22
    assert g.all_lags == (1, 8) and g.max_seeds == 3 and list(g.seeds_of("m2po_gspo")) == [20, 21]
    for spec, c in runs:
        eps = 0.07 if spec.method == "gspo_tight" else 0.2
        assert (c.loss.eps_low, c.loss.eps_high) == (eps, eps), spec.name
        assert c.loss.get("tau") == (1e-4 if spec.method == "m2po_gspo" else None)
        assert c.loss.get("kappa") == (0.3 if spec.method == "age_clip_gspo" else None)
    # The command line's --seeds and --lags apply to every arm.
    wide = study_grid.resolve(g, seeds=1, lags=(8,))
    assert [(s.method, s.lag, s.seed) for s, _ in study_grid.expand(wide, str(tmp_path))] == [
        (m, 8, 20) for m in g.methods
    ]


def test_study2_counted_grid_builder_is_the_planned_protocol(tmp_path):
    """``configs/studies/stale2.py``'s ``counted_grid``: 12 seeds from 20 for the primary arms at
    mean lag 1 and 8, 8 for the secondary arms at 8 only, each at its constant, the settings of
    the calibration plus the 512-prompt evaluations tail20 reads; a dropped arm is left out."""
    study = study_grid.load_study(os.path.join(study_grid.STUDIES_DIR, "stale2.py"))
    g = study["counted_grid"](tight_eps=0.07, kappa=0.3, tau=1e-4, rho_target=0.4)
    assert g.name == "stale2" and g.primary == ("sat_gspo", "gspo_tight") and g.primary_lag == 8
    runs = study_grid.expand(g, str(tmp_path))
    primary = {"gspo", "sat_gspo", "gspo_tight"}
    count = {(s.method, s.lag): 0 for s, _ in runs}
    for spec, _ in runs:
        count[spec.method, spec.lag] += 1
    assert count == {
        **{(m, lag): 12 for m in primary for lag in (1, 8)},
        **{(m, 8): 8 for m in ("age_clip_gspo", "m2po_gspo", "bapo_gspo")},
    }
    assert len(runs) == 96 and {s.seed for s, _ in runs} == set(range(20, 32))
    for spec, c in runs:
        assert c.lag_mode == "sampled" and c.lag_dist == "zipf" and c.lag_cap == 32
        assert c.optim.learning_rate == 4e-5 and c.num_steps == 300
        assert c.eval.full_at == "0,250,275,300" and c.eval.num_prompts == 128
        eps = 0.07 if spec.method == "gspo_tight" else 0.2
        assert (c.loss.eps_low, c.loss.eps_high) == (eps, eps), spec.name
        assert c.loss.get("kappa") == (0.3 if spec.method == "age_clip_gspo" else None)
        assert c.loss.get("tau") == (1e-4 if spec.method == "m2po_gspo" else None)
        if spec.method == "bapo_gspo":
            assert c.loss.rho_target == 0.4
    dropped = study["counted_grid"](tight_eps=0.1, kappa=1.0, tau=None, rho_target=None)
    assert dropped.methods == ("gspo", "sat_gspo", "gspo_tight", "age_clip_gspo")


def test_study2_registered_grids_are_the_counted_grid_at_the_calibrated_constants(tmp_path):
    """``stale2`` and ``stale2-rerun`` are ``counted_grid`` at arms.md's constants (ε 0.05,
    κ 1.0, τ 1e-3, ρ₀ 0.5), on seeds 20-31 and 32-43: the re-run shares no seed."""
    study = study_grid.load_study(os.path.join(study_grid.STUDIES_DIR, "stale2.py"))
    constants = dict(tight_eps=0.05, kappa=1.0, tau=1e-3, rho_target=0.5)
    assert study["ARM_CONSTANTS"] == constants
    seeds = {}
    for name, first in (("stale2", 20), ("stale2-rerun", 32)):
        g = study["GRIDS"][name]
        assert g == study["counted_grid"](**constants, first_seed=first, name=name)
        runs = study_grid.expand(g, str(tmp_path / name))
        assert len(runs) == 96
        seeds[name] = {s.seed for s, _ in runs}
        assert seeds[name] == set(range(first, first + 12))
        for spec, c in runs:
            eps = 0.05 if spec.method == "gspo_tight" else 0.2
            assert (c.loss.eps_low, c.loss.eps_high) == (eps, eps), spec.name
            assert c.loss.get("kappa") == (1.0 if spec.method == "age_clip_gspo" else None)
            assert c.loss.get("tau") == (1e-3 if spec.method == "m2po_gspo" else None)
            assert c.loss.get("rho_target") == (0.5 if spec.method == "bapo_gspo" else None)
    assert not seeds["stale2"] & seeds["stale2-rerun"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(arm_lags={"nope": (8,)}), r"arm_lags names \['nope'\]"),
        (dict(arm_lags={"grpo": (4,)}), r"arm_lags\['grpo'\] must be distinct lags among"),
        (dict(arm_seeds={"grpo": 9}), r"arm_seeds\['grpo'\] must be an int in \[1, 8\]"),
        (dict(arm_loss={"gspo": {"tau": 1.0}}), r"arm_loss names \['gspo'\]"),
        (dict(primary=None, primary_lag=8), "primary_lag needs a primary comparison"),
        (
            dict(arm_lags={"sat_grpo": (1,)}, primary_lag=8),
            "primary arm 'sat_grpo' does not run at primary_lag 8",
        ),
    ],
)
def test_stale_grid_refuses_bad_arm_entries(kwargs, match):
    with pytest.raises(ValueError, match=match):
        study_grid.stale_grid(**kwargs)


def test_every_study_file_loads_and_its_grids_expand(tmp_path):
    """Each file under configs/studies/ defines grids named as its keys, which the protocol it
    belongs to names, and which resolve and expand into distinct runs; a bad file is refused."""
    files = sorted(f for f in os.listdir(study_grid.STUDIES_DIR) if f.endswith(".py"))
    assert "stale.py" in files
    names = []
    for f in files:
        grids = study_grid.load_study(os.path.join(study_grid.STUDIES_DIR, f))["GRIDS"]
        for name, grid in grids.items():
            assert study_grid.resolve(name) == grid
            runs = study_grid.expand(grid, str(tmp_path))
            # An arm may run at fewer lags or seeds than the grid's (study 2's secondary arms).
            arm_lags, arm_seeds = dict(grid.arm_lags or ()), dict(grid.arm_seeds or ())
            cells = sum(
                len(arm_lags.get(m, grid.lags)) * arm_seeds.get(m, grid.seeds) for m in grid.methods
            )
            assert (
                len({c.workdir for _, c in runs}) == len(runs) == cells * len(grid.lrs or (None,))
            )
            names.append(name)
    assert sorted(study_grid.study_grids()) == sorted(names)
    assert {"stale-phase0", "stale", "stale-rerun"} <= set(names)
    with open(os.path.join(ROOT, "docs", "results", "stale", "PROTOCOL.md"), encoding="utf-8") as f:
        assert "configs/studies/stale.py" in f.read()
    bad = tmp_path / "bad.py"
    bad.write_text("from sat_jax.study.grid import GRIDS as _G\nGRIDS = {'other': _G['core']}\n")
    with pytest.raises(ValueError, match="must be a Grid named 'other'"):
        study_grid.load_study(str(bad))
    bad.write_text("X = 1\n")
    with pytest.raises(ValueError, match="needs GRIDS"):
        study_grid.load_study(str(bad))


def test_a_grid_fixes_its_own_lag_mode_and_an_explicit_one_wins(tmp_path):
    g = study_grid.stale_grid(
        ("gspo", "sat_gspo"), baseline="gspo", primary=None, seeds=1, lag_mode="fixed"
    )
    runs = study_grid.expand(g, str(tmp_path))
    assert {(s.lag_mode, c.lag_mode) for s, c in runs} == {("fixed", "fixed")}
    assert runs[0][0].name == "gspo-fixed1-lr0.0001-seed0"
    runs = study_grid.expand(g, str(tmp_path), lag_mode="broadcast")
    assert {(s.lag_mode, c.lag_mode) for s, c in runs} == {("broadcast", "broadcast")}
    # A grid that fixes none: broadcast.
    assert study_grid.expand(study_grid.resolve("stale-phase0"), "x")[0][0].lag_mode == "broadcast"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(arms=("grpo", "nope")), "arms must be distinct names"),
        (dict(arms=("grpo", "grpo")), "arms must be distinct names"),
        (dict(baseline="gspo"), "baseline 'gspo' is not one of the arms"),
        (dict(primary=("sat_gspo", "grpo")), "primary .* must be two of the arms"),
        (dict(preset="nope"), "unknown preset 'nope'"),
        (dict(seeds=0), "seeds must be an int >= 1"),
        (dict(first_seed=-1), "first_seed must be an int >= 0, got -1"),
        (dict(lags=()), "lags must be non-negative"),
        (dict(tight_eps=1.5), "tight_eps must lie in"),
        (dict(settings=("lag=3",)), "names a field the grid sets"),
        (dict(lag_mode="queue"), "lag_mode must be one of"),
    ],
)
def test_stale_grid_refuses_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        study_grid.stale_grid(**kwargs)


@pytest.mark.parametrize(
    "name",
    [n for n in study_grid.METHODS if os.path.exists(os.path.join(ROOT, "configs", n + ".py"))],
)
def test_methods_equal_the_config_files(name):
    spec = importlib.util.spec_from_file_location("c", os.path.join(ROOT, "configs", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert study_grid.method_config(name).to_dict() == module.get_config().to_dict()


def test_overrides_apply_to_every_run_and_grid_fields_are_refused(tmp_path):
    g = study_grid.resolve("core", seeds=1, lags=(8,))
    runs = study_grid.expand(
        g, str(tmp_path), overrides=["num_steps=7", "optim.learning_rate=3e-4", "log.plots=false"]
    )
    assert {(c.num_steps, c.optim.learning_rate, c.log.plots) for _, c in runs} == {
        (7, 3e-4, False)
    }
    assert runs[0][0].name == "grpo_r3-broadcast8-lr0.0003-seed0"
    with pytest.raises(ValueError, match="--set lag: the grid sets this field"):
        study_grid.expand(g, str(tmp_path), overrides=["lag=3"])
    with pytest.raises(ValueError, match="use --lrs"):
        study_grid.expand(
            study_grid.resolve("envelope"), str(tmp_path), overrides=["optim.learning_rate=1e-3"]
        )


def test_override_parses_with_the_field_type():
    c = config_lib.get_config()
    for item in ("optim.learning_rate=3e-4", "rollout.group_size=4", "log.plots=false"):
        study_grid.apply_override(c, item)
    assert c.optim.learning_rate == 3e-4 and isinstance(c.optim.learning_rate, float)
    assert c.rollout.group_size == 4 and isinstance(c.rollout.group_size, int)
    assert c.log.plots is False


@pytest.mark.parametrize(
    "item,message",
    [
        ("optim.nonexistent=1", "unknown config field 'optim.nonexistent'"),
        ("nope.lr=1", "unknown config field 'nope.lr'"),
        ("optim=1", "unknown config field 'optim'"),
        ("optim.learning_rate", "KEY=VALUE"),
        ("rollout.group_size=2.5", "rollout.group_size: expected a int, got '2.5'"),
        ("log.plots=maybe", "log.plots: expected true or false"),
    ],
)
def test_override_rejects_bad_input(item, message):
    with pytest.raises(ValueError, match=message):
        study_grid.apply_override(config_lib.get_config(), item)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(grid="nope"), "unknown grid 'nope'"),
        (dict(grid="core", seeds=0), "--seeds must be >= 1"),
        (dict(grid="core", baseline="grpo"), "--baseline 'grpo' is not one of"),
        (dict(grid="core", methods=("grpo", "nope")), "unknown method"),
    ],
)
def test_resolve_rejects_bad_choices(kwargs, message):
    with pytest.raises(ValueError, match=message):
        study_grid.resolve(kwargs.pop("grid"), **kwargs)


@pytest.mark.parametrize(
    "text,message",
    [
        ("1,x", "comma-separated list of integers"),
        ("", "comma-separated list"),
        ("1,-2", ">= 0"),
        ("1,1", "repeated"),
    ],
)
def test_parse_ints_errors(text, message):
    with pytest.raises(ValueError, match=message):
        study_grid.parse_ints(text, "--lags")


def test_parse_lists():
    assert study_grid.parse_ints(" 1, 8 ", "--lags") == (1, 8)
    assert study_grid.parse_floats("1e-4,3e-4", "--lrs") == (1e-4, 3e-4)
    for bad in ("0", "-1e-4", "x", "nan"):
        with pytest.raises(ValueError, match="--lrs"):
            study_grid.parse_floats(bad, "--lrs")


# --------------------------------------------------------------------------- resume


def test_finished_runs_are_skipped_and_changed_ones_rerun(tmp_path):
    g = study_grid.resolve(
        "envelope", seeds=2, lags=(1,), lrs=(1e-4,), methods=("grpo",), baseline="grpo"
    )
    runs = study_grid.expand(g, str(tmp_path))
    calls = []

    def fake_train(config):
        calls.append(config.seed)
        os.makedirs(config.workdir, exist_ok=True)
        return {"interrupted": False, "end_step": config.num_steps, "wall_seconds": 0.1}

    logs = []
    first = runner.run_all(runs, train=fake_train, log=logs.append)
    assert calls == [0, 1] and first["trained"] == [s.name for s, _ in runs]
    assert logs[-1].startswith("[2/2] elapsed") and ", done |" in logs[-1]
    second = runner.run_all(runs, train=fake_train, log=logs.append)
    assert calls == [0, 1] and second["trained"] == [] and len(second["skipped"]) == 2
    # Asking for more steps makes a finished run unfinished (the learner resumes it).
    longer = study_grid.expand(g, str(tmp_path), overrides=["num_steps=500"])
    runner.run_all(longer, train=fake_train, log=logs.append)
    assert calls == [0, 1, 0, 1]
    # A change outside the resumable fields too.
    other = study_grid.expand(g, str(tmp_path), overrides=["loss.eps_high=0.3"])
    assert not any(runner.is_finished(c) for _, c in other)


def test_every_run_records_its_code_and_a_study_refuses_to_mix_code(tmp_path, monkeypatch):
    g = study_grid.resolve(
        "envelope", seeds=2, lags=(1,), lrs=(1e-4,), methods=("grpo",), baseline="grpo"
    )
    runs = study_grid.expand(g, str(tmp_path))
    calls = []

    def fake_train(config):
        calls.append(config.seed)
        return {"interrupted": False, "end_step": config.num_steps}

    # Only the first run: the second stays pending.
    runner.run_all(runs[:1], train=fake_train, log=lambda m: None)
    with open(os.path.join(runs[0][1].workdir, runner.DONE_FILE), encoding="utf-8") as f:
        recorded = json.load(f)["provenance"]
    here = runner.run_provenance()
    assert recorded == here and len(here["code"]) == 16
    assert {"commit", "jax", "jaxlib", "python", "devices", "cpu", "packages"} <= set(here)
    assert set(here["packages"]) == set(runner.NUMERIC_PACKAGES)
    assert here["packages"]["flax"] != "not installed"
    # Another program (any change to the package source) may not add runs to this study.
    monkeypatch.setattr(runner, "run_provenance", lambda: {**here, "code": "0123456789abcdef"})
    with pytest.raises(runner.MixedCodeError, match=runs[0][0].name):
        runner.run_all(runs, train=fake_train, log=lambda m: None)
    assert calls == [0]  # refused before anything ran
    # A started but unfinished run records its code too: resuming it with other code is refused.
    monkeypatch.undo()
    os.makedirs(runs[1][1].workdir)
    with open(os.path.join(runs[1][1].workdir, runner.PROVENANCE_FILE), "w") as f:
        json.dump({**here, "code": "fedcba9876543210"}, f)
    with pytest.raises(runner.MixedCodeError, match="fedcba9876543210"):
        runner.run_all(runs, train=fake_train, log=lambda m: None)


_ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu sse2 avx f16c fma avx2 bmi2 sha_ni vaes

processor\t: 1
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
"""
_ZEN4 = _ZEN3.replace("model\t\t: 1", "model\t\t: 17").replace(
    "vaes", "vaes avx512f avx512bw avx512vl avx512_bf16 avx512_vnni"
)
_NEOVERSE = """processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd evtstrm aes crc32 asimddp sve sve2 bf16 i8mm
CPU implementer\t: 0x41
CPU variant\t: 0x0
CPU part\t: 0xd4f
"""


def test_the_cpu_identity_tells_apart_generations_sold_under_one_name():
    """Two hosts both named "AMD EPYC" that XLA:CPU compiles for differently (AVX2 against
    AVX-512) record different CPUs, so a report's CPU line tells their runs apart."""
    zen3 = runner.cpu_identity(_ZEN3)
    assert zen3 == "AMD EPYC (family 25 model 1 stepping 1, avx avx2 fma f16c)"
    zen4 = runner.cpu_identity(_ZEN4)
    assert zen4 == (
        "AMD EPYC (family 25 model 17 stepping 1, avx avx2 fma f16c avx512f avx512bw avx512vl "
        "avx512_vnni avx512_bf16)"
    )
    # Arm's /proc/cpuinfo has no model name: the machine names it, the part tells the core.
    assert runner.cpu_identity(_NEOVERSE, "aarch64") == (
        "aarch64 (implementer 0x41 part 0xd4f variant 0x0, asimd asimddp sve sve2 bf16 i8mm)"
    )
    assert runner.cpu_identity("", "x86_64") == "x86_64"
    assert runner.cpu_identity("") == "unknown CPU"
    # What a run records: this host's identity, with its core count.
    here = runner.run_provenance()["cpu"]
    assert here.endswith(f", {os.cpu_count()} cores") and here.split(" (")[0].strip()


def test_code_digest_reads_the_source(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    (pkg / "notes.txt").write_text("not code")
    first = runner.code_digest(str(pkg))
    (pkg / "notes.txt").write_text("still not code")
    assert runner.code_digest(str(pkg)) == first
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    assert runner.code_digest(str(pkg)) != first


def test_an_interrupted_run_stops_the_grid_unmarked(tmp_path):
    g = study_grid.resolve(
        "envelope", seeds=3, lags=(1,), lrs=(1e-4,), methods=("grpo",), baseline="grpo"
    )
    runs = study_grid.expand(g, str(tmp_path))
    calls = []

    def fake_train(config):
        calls.append(config.seed)
        return {"interrupted": config.seed == 1}

    with pytest.raises(runner.Interrupted):
        runner.run_all(runs, train=fake_train, log=lambda m: None)
    assert calls == [0, 1]
    assert [runner.is_finished(c) for _, c in runs] == [True, False, False]


@pytest.mark.parametrize("keep", [True, False])
def test_finished_runs_drop_their_checkpoints_only_when_asked(tmp_path, keep):
    g = study_grid.resolve(
        "envelope", seeds=4, lags=(1,), lrs=(1e-4,), methods=("grpo",), baseline="grpo"
    )
    runs = study_grid.expand(g, str(tmp_path))

    def ckpt(config):
        return os.path.join(config.workdir, "checkpoints")

    def fake_train(config):
        # Each run saves checkpoints as it goes; seed 1 fails and seed 2 is interrupted after
        # saving, so neither is finished.
        os.makedirs(os.path.join(ckpt(config), "100"), exist_ok=True)
        with open(os.path.join(ckpt(config), "100", "state"), "w", encoding="utf-8") as f:
            f.write("x")
        if config.seed == 1:
            raise RuntimeError("broken run")
        return {"interrupted": config.seed == 2}

    with pytest.raises(runner.Interrupted):
        runner.run_all(runs, train=fake_train, log=lambda m: None, keep_checkpoints=keep)
    assert [runner.is_finished(c) for _, c in runs] == [True, False, False, False]
    # The finished run's checkpoints go only when asked; the failed and the interrupted run keep
    # theirs (what they resume from); the run never started has none.
    assert [os.path.isdir(ckpt(c)) for _, c in runs] == [keep, True, True, False]
    assert os.path.isfile(os.path.join(runs[0][1].workdir, runner.DONE_FILE))
    # Deleting by hand: a finished run's once, an unfinished run's never.
    assert runner.drop_checkpoints(runs[0][1]) is keep
    assert runner.drop_checkpoints(runs[0][1]) is False
    for _, config in runs[1:]:
        with pytest.raises(ValueError, match="not a finished run"):
            runner.drop_checkpoints(config)
    assert os.path.isdir(ckpt(runs[1][1])) and os.path.isdir(ckpt(runs[2][1]))


def test_a_failing_run_is_recorded_and_the_grid_goes_on(tmp_path):
    g = study_grid.resolve(
        "envelope", seeds=3, lags=(1,), lrs=(1e-4,), methods=("grpo",), baseline="grpo"
    )
    runs = study_grid.expand(g, str(tmp_path))

    def fake_train(config):
        if config.seed == 1:
            raise FloatingPointError("nan loss")
        return {"interrupted": False}

    logs, progress = [], []
    result = runner.run_all(
        runs,
        train=fake_train,
        log=logs.append,
        after_run=lambda p: progress.append(len(p["trained"] + p["failed"])),
    )
    assert progress == [1, 2, 3]
    assert result["failed"] == [runs[1][0].name] and len(result["trained"]) == 2
    assert "FAILED" in logs[3] and "FloatingPointError: nan loss" in logs[3]
    error = open(os.path.join(runs[1][1].workdir, runner.ERROR_FILE)).read()
    assert "Traceback" in error and "nan loss" in error
    assert [runner.is_finished(c) for _, c in runs] == [True, False, True]
    with pytest.raises(FloatingPointError):
        runner.run_all(runs, train=fake_train, log=logs.append, fatal=FloatingPointError)


def test_a_later_success_removes_the_stale_error(tmp_path):
    g = study_grid.resolve(
        "envelope", seeds=1, lags=(1,), lrs=(1e-4,), methods=("grpo",), baseline="grpo"
    )
    runs = study_grid.expand(g, str(tmp_path))
    error = os.path.join(runs[0][1].workdir, runner.ERROR_FILE)
    attempts = []

    def fake_train(config):
        attempts.append(config.seed)
        if len(attempts) == 1:
            raise OSError("disk full")
        return {"interrupted": False}

    assert runner.run_all(runs, train=fake_train, log=lambda m: None)["failed"] == [runs[0][0].name]
    assert "disk full" in open(error).read()
    again = runner.run_all(runs, train=fake_train, log=lambda m: None)
    assert again["trained"] == [runs[0][0].name] and again["failed"] == []
    assert not os.path.exists(error) and runner.is_finished(runs[0][1])


def test_close_learning_rates_get_their_own_directories(tmp_path):
    g = study_grid.resolve(
        "envelope",
        seeds=1,
        lags=(1,),
        lrs=(1e-4, 1.0000001e-4, 3e-4),
        methods=("grpo",),
        baseline="grpo",
    )
    names = [spec.name for spec, _ in study_grid.expand(g, str(tmp_path))]
    assert names == [
        "grpo-broadcast1-lr0.0001-seed0",
        "grpo-broadcast1-lr0.00010000001-seed0",
        "grpo-broadcast1-lr0.0003-seed0",
    ]


def test_two_runs_in_one_directory_are_refused(tmp_path, monkeypatch):
    # Whatever makes two names equal, the grid refuses it before any run.
    monkeypatch.setattr(study_grid.RunSpec, "name", property(lambda spec: f"seed{spec.seed}"))
    g = study_grid.resolve(
        "envelope", seeds=1, lags=(1, 8), lrs=(1e-4,), methods=("grpo",), baseline="grpo"
    )
    with pytest.raises(ValueError, match=r"runs RunSpec\(.*lag=1.*\) and RunSpec\(.*lag=8.*share"):
        study_grid.expand(g, str(tmp_path))


def test_progress_line_and_estimate():
    assert runner.progress_line(3, 12, 100.0, 297.0) == "[3/12] elapsed 1m40s, ETA 4m57s"
    assert runner.progress_line(12, 12, 3700.0, 0.0) == "[12/12] elapsed 1h01m40s, done"
    assert "ETA unknown" in runner.progress_line(2, 12, 1.0, None)
    # Two cold runs (30 s, 40 s), one warm (2 s); left: one cold, three warm -> 35 + 3·2.
    assert runner.estimate([30.0, 40.0], [2.0], 1, 3) == pytest.approx(41.0)
    assert runner.estimate([30.0], [], 0, 2) == pytest.approx(60.0)
    assert runner.estimate([], [], 1, 1) is None


def test_program_groups_ignore_seed_and_lag(tmp_path):
    g = study_grid.resolve("envelope", seeds=2, lags=(1, 8), lrs=(1e-4, 1e-3))
    groups = {runner.program_group(c) for _, c in study_grid.expand(g, str(tmp_path))}
    assert len(groups) == 2 * 2  # methods × learning rates


# --------------------------------------------------------------------------- statistics


@pytest.mark.parametrize(
    "p,df,expected",
    [
        (0.975, 4, 2.7764),
        (0.975, 1, 12.7062),
        (0.975, 2, 4.3027),
        (0.975, 30, 2.0423),
        (0.995, 10, 3.1693),
        (0.95, 5, 2.0150),
        (0.5, 3, 0.0),
        (0.025, 4, -2.7764),
    ],
)
def test_t_quantile_against_tables(p, df, expected):
    assert stats.t_quantile(p, df) == pytest.approx(expected, abs=1e-4)


def test_t_quantile_rejects_bad_input():
    with pytest.raises(ValueError, match="p must be in"):
        stats.t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="df must be"):
        stats.t_quantile(0.9, 0)


def test_paired_hand_computed():
    # d = (1, 1, 3): mean 5/3, sd = sqrt(((2/3)² + (2/3)² + (4/3)²) / 2) = sqrt(4/3),
    # half width = t_{0.975,2} · sd / √3 = 4.302653 · 0.666667 = 2.868435.
    p = stats.paired({0: 1.0, 1: 2.0, 2: 4.0, 7: 1.0}, {0: 0.0, 1: 1.0, 2: 1.0, 3: 9.0})
    assert p["n"] == 3 and p["seeds"] == [0, 1, 2] and p["wins"] == 3
    assert p["mean"] == pytest.approx(5 / 3)
    assert p["sd"] == pytest.approx(math.sqrt(4 / 3))
    assert p["lo"] == pytest.approx(5 / 3 - 2.868435, abs=1e-5)
    assert p["hi"] == pytest.approx(5 / 3 + 2.868435, abs=1e-5)
    one = stats.paired({0: 0.5}, {0: 0.25})
    assert one["mean"] == 0.25 and math.isnan(one["lo"]) and math.isnan(one["sd"])
    assert stats.paired({}, {0: 1.0})["n"] == 0


def test_collapse_rule():
    rule = stats.CollapseRule()
    assert not rule(base=0.3, best=0.6, final=0.55)
    assert rule(base=0.3, best=0.35, final=0.29)  # below the base policy
    assert rule(base=0.1, best=0.6, final=0.29)  # fell by more than half from its best
    assert not rule(base=0.1, best=0.6, final=0.30)  # exactly half: not more than half
    assert not rule(base=math.nan, best=math.nan, final=math.nan)
    assert not stats.CollapseRule(margin=0.05)(base=0.3, best=0.35, final=0.26)
    assert "below 0.5 × its best" in rule.describe()


def records(evals, mismatch, q=None):
    """Synthetic metrics.jsonl rows: eval/pass@1 at the given steps, one training row per step."""
    rows = [{"step": 0, "sft/final_loss": 1.0}]
    for step, v in evals.items():
        rows.append({"step": step, "eval/pass@1": v})
    for i, m in enumerate(mismatch):
        row = {
            "step": i + 1,
            "loss/mismatch": m,
            "lag/mean": float(i % 3),
            "train/reward_mean": 0.5,
        }
        if q is not None:
            row.update({"loss/sat/q": q[i], "loss/sat/binding_rate": 0.01 * i})
        row["loss/clip_frac"] = 0.1 * i
        rows.append(row)
    return rows


def test_summarize_run_hand_computed():
    r = records(
        {0: 0.2, 4: 0.6, 8: 0.5},
        [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8],
        q=[1, 2, 3, 4, 5, 6, 7, 8],
    )
    r.append({"step": 8, "eval/pass@1": 0.55})  # a resumed step logged again: the later wins
    s = stats.summarize_run(r)
    assert (s["base"], s["best"], s["best_step"], s["final"], s["final_step"]) == (
        0.2,
        0.6,
        4,
        0.55,
        8,
    )
    # The last 25% of 8 steps: steps 7 and 8 (i = 6, 7: lag i % 3 = 0, 1).
    assert s["mismatch_t25"] == pytest.approx(0.75) and s["q_t25"] == pytest.approx(7.5)
    assert s["binding_t25"] == pytest.approx(0.065) and s["lag_t25"] == pytest.approx(0.5)
    assert s["clip_t25"] == pytest.approx(0.65)
    assert s["steps"] == 8 and s["collapsed"] is False
    assert s["tail20"] == pytest.approx(0.55) and s["collapse_step"] is None  # 1 of 2 evals
    plain = stats.summarize_run(records({0: 0.2, 4: 0.1}, [0.1, 0.2]))
    assert math.isnan(plain["q_t25"]) and plain["collapsed"] is True
    assert plain["mismatch_t25"] == pytest.approx(0.2)  # ceil(0.25 · 2) = 1 step


def test_markdown_table():
    assert tables.markdown_table(["a", "b"], [[1, "x|y"]]) == "| a | b |\n|---|---|\n| 1 | x\\|y |"
    with pytest.raises(ValueError, match="1 cells for 2 headers"):
        tables.markdown_table(["a", "b"], [[1]])
    assert tables.fmt_paired({"n": 3, "mean": 0.1, "lo": -0.05, "hi": 0.25, "wins": 2}) == (
        "+0.100 [-0.050, +0.250] (n=3, 2/3 up)"
    )


#: Per-seed final pass@1 of a fake envelope study, by (method, lag).
FINALS = {
    ("grpo", 1): [0.5, 0.6, 0.7],
    ("grpo", 8): [0.4, 0.4, 0.5],
    ("sat_grpo", 1): [0.5, 0.6, 0.8],
    ("sat_grpo", 8): [0.5, 0.5, 0.7],
}


def _fake_study(tmp_path, finals):
    """A finished envelope study on disk: finals[(method, lag)] = per-seed final pass@1."""
    g = study_grid.resolve("envelope", seeds=3, lags=(1, 8), lrs=(1e-4,))
    runs = study_grid.expand(g, str(tmp_path))
    for spec, c in runs:
        os.makedirs(c.workdir, exist_ok=True)
        final = finals[(spec.method, spec.lag)][spec.seed]
        q = [0.1] * 4 if spec.method == "sat_grpo" else None
        with open(os.path.join(c.workdir, "metrics.jsonl"), "w") as f:
            for row in records({0: 0.2, 2: 0.4, 4: final}, [0.01 * spec.lag] * 4, q=q):
                f.write(json.dumps(row) + "\n")
        runner.mark_finished(c, {"wall_seconds": 2.0})
    return g, runs


def test_a_compressed_log_reads_as_the_plain_one_and_its_run_stays_finished(tmp_path):
    """A counted run's metrics.jsonl.gz gives the same records and results.csv as the plain log,
    and the grid still skips the run."""
    finals = {(m, lag): [0.5, 0.6, 0.7] for m in ("grpo", "sat_grpo") for lag in (1, 8)}
    g, plain = _fake_study(tmp_path / "plain", finals)
    _, packed = _fake_study(tmp_path / "packed", finals)
    for (_, a), (_, b) in zip(plain, packed, strict=True):
        with open(os.path.join(a.workdir, "metrics.jsonl"), "rb") as f:
            raw = f.read()
        path = run_metrics.compress_metrics(b.workdir)
        assert path.name == "metrics.jsonl.gz" and gzip.decompress(path.read_bytes()) == raw
        assert not os.path.exists(os.path.join(b.workdir, "metrics.jsonl"))
        assert run_metrics.read_metrics(b.workdir) == run_metrics.read_metrics(a.workdir)

    def csv_rows(root, runs):
        out = report.write(
            str(root), g, runs, command="c", lag_mode="broadcast", overrides=[], invocation={}
        )
        with open(out["csv"]) as f:
            return list(csv.DictReader(f))

    assert csv_rows(tmp_path / "packed", packed) == csv_rows(tmp_path / "plain", plain)
    assert {r["status"] for r in csv_rows(tmp_path / "packed", packed)} == {"finished"}
    trained = []
    again = runner.run_all(packed, train=trained.append, log=lambda m: None)
    assert trained == [] and len(again["skipped"]) == len(packed)


def test_the_runner_compresses_a_finished_log_and_a_longer_run_appends_to_it(tmp_path):
    g = study_grid.resolve(
        "envelope", seeds=1, lags=(1,), lrs=(1e-4,), methods=("grpo",), baseline="grpo"
    )
    [(_, config)] = study_grid.expand(g, str(tmp_path))
    lines = [json.dumps({"step": s, "time": 0.0, "loss/total": 0.5 * s}) + "\n" for s in (1, 2)]

    def fake_train(config):
        os.makedirs(config.workdir, exist_ok=True)
        with open(os.path.join(config.workdir, "metrics.jsonl"), "w") as f:
            f.writelines(lines)
        return {"interrupted": False}

    runner.run_all(study_grid.expand(g, str(tmp_path)), train=fake_train, log=lambda m: None)
    packed = os.path.join(config.workdir, "metrics.jsonl.gz")
    assert gzip.decompress(open(packed, "rb").read()).decode() == "".join(lines)
    assert not os.path.exists(os.path.join(config.workdir, "metrics.jsonl"))
    # Asked to go further, the learner resumes at step 1: the log is plain again, step 2 dropped.
    run_metrics.RunLogger(config.workdir, enable_tensorboard=False, resume_step=1).close()
    assert not os.path.exists(packed)
    assert [r["step"] for r in run_metrics.read_metrics(config.workdir)] == [1]


def test_results_files_from_a_fake_study(tmp_path):
    g, runs = _fake_study(tmp_path, FINALS)
    out = report.write(
        str(tmp_path),
        g,
        runs,
        command="sat-jax compare --grid envelope",
        lag_mode="broadcast",
        overrides=[],
        invocation={"seconds": 3.0},
    )
    with open(out["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and rows[0]["method"] == "grpo" and rows[0]["status"] == "finished"
    md = open(out["md"]).read()
    assert "- command: `sat-jax compare --grid envelope`" in md
    assert "collapsed" in md and "JAX " in md and "commit of this report:" in md
    # grpo lag 1: best = max(0.4, final) per seed -> (0.5, 0.6, 0.7): mean 0.6, sd 0.1.
    assert "| GRPO | 1 | 0.0001 | 3 | 0.200 | 0.600 ± 0.100 | 0.600 ± 0.100 | 0/3 |" in md
    # SAT-GRPO − GRPO at lag 8, final: d = (0.1, 0.1, 0.2), mean 0.1333, sd 0.0577,
    # half width 4.3027 · 0.0577 / √3 = 0.1434.
    assert "+0.133 [-0.010, +0.277] (n=3, 3/3 up)" in md
    env = {(e["lr"], e["lag"]): e for e in out["envelope"]}
    drop = env[(1e-4, 8)]["base_drop"]  # grpo lag 8 − lag 1: (−0.1, −0.2, −0.2)
    assert drop["mean"] == pytest.approx(-0.5 / 3) and drop["wins"] == 0
    assert env[(1e-4, 8)]["sat_can_act"] and env[(1e-4, 8)]["q"] == pytest.approx(0.1)
    assert env[(1e-4, 8)]["mismatch"] == pytest.approx(0.08)
    for p in out["plots"]:
        assert os.path.getsize(p) > 0
    assert {os.path.basename(p) for p in out["plots"]} == {
        "accuracy.png",
        "mismatch.png",
        "q.png",
        "binding.png",
        "envelope.png",
    }


def test_a_partial_run_is_listed_but_enters_no_table(tmp_path):
    """A run still going (no done.json) has no final evaluation: results.csv lists it and the
    provenance counts it, but the per-cell means, paired differences and tests are those of the
    finished runs alone."""
    g, runs = _fake_study(tmp_path, FINALS)
    g = dataclasses.replace(g, primary=("sat_grpo", "grpo"), primary_lag=8)
    more = study_grid.expand(dataclasses.replace(g, seeds=4), str(tmp_path))
    (spec, config) = next((s, c) for s, c in more if (s.method, s.lag, s.seed) == ("grpo", 8, 3))
    os.makedirs(config.workdir)
    with open(os.path.join(config.workdir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "eval/pass@1": 0.05}) + "\n")
    out = report.write(
        str(tmp_path),
        g,
        runs + [(spec, config)],
        command="c",
        lag_mode="broadcast",
        overrides=[],
        plots=False,
    )
    with open(out["csv"]) as f:
        status = {r["run_dir"]: r["status"] for r in csv.DictReader(f)}
    assert status[f"runs/{spec.name}"] == "partial" and len(status) == 13
    md = open(out["md"]).read()
    assert "- runs: 12 finished of 13 (1 partial: listed in `results.csv`" in md
    # As in the study without it: GRPO at lag 8 over seeds 0-2 only, and the primary test's
    # paired difference on those seeds.
    assert "| GRPO | 8 | 0.0001 | 3 | 0.200 |" in md
    assert "| **GRPO** (primary) | 0.0001 | +0.133 [-0.010, +0.277] (n=3, 3/3 up) | 0.25 |" in md


def test_pre_registered_section_tests_the_lag_interaction(tmp_path):
    g, runs = _fake_study(tmp_path, FINALS)
    g = dataclasses.replace(g, primary=("sat_grpo", "grpo"))
    out = report.write(
        str(tmp_path), g, runs, command="c", lag_mode="broadcast", overrides=[], plots=False
    )
    # tail20 = the last of 2 evaluations = final. Interaction per seed:
    # (sat8 − grpo8) − (sat1 − grpo1) = (0.1, 0.1, 0.2) − (0, 0, 0.1) = (0.1, 0.1, 0.1).
    (e,) = stats.primary_tests(out["rows"], "sat_grpo", "grpo")
    assert e["primary"] and e["lags"] == (1, 8)
    assert e["interaction"]["mean"] == pytest.approx(0.1) and e["interaction"]["wins"] == 3
    assert e["interaction"]["wilcoxon"]["p"] == pytest.approx(2 / 8)
    assert e["mcnemar_hi"] == {"n": 3, "b": 0, "c": 0, "p": 1.0}
    md = open(out["md"]).read()
    assert "## Pre-registered tests" in md and "**SAT-GRPO** (primary)" in md
    assert "| SAT-GRPO | 8 | 0.0001 | 3 | 0.567 ± 0.115 | 0/3 | – |" in md


def test_pre_registered_section_tests_the_difference_at_one_lag(tmp_path):
    """A protocol whose primary comparison is a plain paired difference at one lag (study 2):
    treatment − control first, then treatment − each other arm, at that lag only."""
    g, runs = _fake_study(tmp_path, FINALS)
    g = dataclasses.replace(g, primary=("sat_grpo", "grpo"), primary_lag=8)
    out = report.write(
        str(tmp_path), g, runs, command="c", lag_mode="broadcast", overrides=[], plots=False
    )
    (e,) = stats.difference_tests(out["rows"], "sat_grpo", "grpo", 8)
    # tail20 = final: sat8 − grpo8 = (0.1, 0.1, 0.2).
    assert e["primary"] and e["method"] == "grpo" and e["lag"] == 8
    assert e["diff"]["mean"] == pytest.approx(0.4 / 3) and e["diff"]["wins"] == 3
    assert e["diff"]["wilcoxon"]["p"] == pytest.approx(2 / 8)
    assert e["mcnemar"] == {"n": 3, "b": 0, "c": 0, "p": 1.0}
    md = open(out["md"]).read()
    assert "**Primary test**: SAT-GRPO − GRPO at lag 8" in md
    assert "| **GRPO** (primary) | 0.0001 | +0.133 [-0.010, +0.277] (n=3, 3/3 up) | 0.25 |" in md
    with pytest.raises(ValueError, match=r"no run of \['sat_grpo', 'grpo'\] at lag 4"):
        stats.difference_tests(out["rows"], "sat_grpo", "grpo", 4)


# --------------------------------------------------------------------------- shared train step


def test_train_step_cache_key(monkeypatch):
    built = []
    monkeypatch.setattr(
        components.trainer, "make_train_step", lambda *a, **k: built.append(a) or object()
    )
    monkeypatch.setattr(components, "_TRAIN_STEPS", type(components._TRAIN_STEPS)())
    monkeypatch.setattr(components, "SHARE_TRAIN_STEPS", True)
    parts = types.SimpleNamespace(
        model_cfg="model", spec="spec", mesh="mesh", graphdef="g", optimizer="opt"
    )

    def config(**fields):
        c = study_grid.method_config("grpo")
        for k, v in fields.items():
            study_grid.apply_override(c, f"{k}={v}")
        return c

    a = components.shared_train_step(config(), parts)
    assert components.shared_train_step(config(seed=3, lag=1, lag_mode="fixed"), parts) is a
    assert components.shared_train_step(config(num_steps=9), parts) is a  # constant schedule
    b = components.shared_train_step(config(**{"optim.learning_rate": 3e-4}), parts)
    assert b is not a and len(built) == 2
    components.shared_train_step(config(**{"optim.schedule": "cosine", "num_steps": 9}), parts)
    components.shared_train_step(config(**{"optim.schedule": "cosine", "num_steps": 10}), parts)
    assert len(built) == 4  # a cosine schedule reads the step count
    monkeypatch.setattr(components, "SHARE_TRAIN_STEPS", False)
    assert components.shared_train_step(config(), parts) is not a


# --------------------------------------------------------------------------- command line


@pytest.fixture
def no_training(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the grid would have started")

    monkeypatch.setattr(runner, "run_all", refuse)


def run_cli(capsys, *args):
    rc = invoke(*args)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--grid=nope"], "unknown grid 'nope'"),
        (["--grid=core", "--lags=1,x"], "--lags needs a comma-separated list of integers"),
        (["--grid=core", "--lags=-1"], "--lags values must be >= 0"),
        (["--grid=core", "--seeds=0"], "--seeds must be >= 1"),
        (["--grid=envelope", "--lrs=0"], "--lrs needs positive finite numbers"),
        (["--grid=core", "--methods=grpo,bogus"], "--methods: unknown method"),
        (["--grid=core", "--baseline=dpo"], "--baseline 'dpo' is not one of"),
        (["--grid=core", "--set", "lag=2"], "--set lag: the grid sets this field"),
        (["--grid=core", "--set", "optim.nope=2"], "unknown config field 'optim.nope'"),
        (
            ["--grid=core", "--set", "optim.learning_rate=-1"],
            "run grpo_r3-broadcast1-lr-1-seed0: invalid config: optim.learning_rate must be > 0",
        ),
    ],
)
def test_cli_grid_errors_exit_2(capsys, tmp_path, no_training, args, message):
    rc, _, err = run_cli(capsys, "compare", *args, f"--out={tmp_path}/s")
    assert rc == 2 and err.startswith("sat-jax: error: ") and message in err, err


def test_cli_grid_needs_out_and_no_run_dirs(capsys, tmp_path, no_training):
    rc, _, err = run_cli(capsys, "compare", "--grid=core")
    assert rc == 2 and "compare --grid needs --out DIR" in err
    rc, _, err = run_cli(capsys, "compare", "--grid=core", f"--out={tmp_path}", "runs/a")
    assert rc == 2 and "takes no run directories" in err
    rc, _, err = run_cli(capsys, "compare", "--seeds=3", str(tmp_path))
    assert rc == 2 and "--seeds is a flag of compare --grid NAME" in err


def test_cli_compare_help_names_both_uses(capsys):
    rc, out, _ = run_cli(capsys, "compare", "--help")
    assert rc == 0 and "RUN_DIR... | --grid NAME --out DIR" in out
    assert "--grid" in out and "--lrs" in out and "--set" in out


def test_lag_rows_pair_each_method_with_its_lowest_lag():
    rows = [
        {
            "method": m,
            "lag_mode": "broadcast",
            "lag": lag,
            "lr": 1e-4,
            "seed": s,
            "final": f,
            "best": f,
        }
        for m, lag, s, f in [
            ("a", 1, 0, 0.5),
            ("a", 1, 1, 0.6),
            ("a", 8, 0, 0.3),
            ("a", 8, 1, 0.5),
            ("b", 8, 0, 0.9),
        ]
    ]
    (a8, b8) = stats.lag_rows(rows)
    assert (a8["method"], a8["lag"], a8["from_lag"]) == ("a", 8, 1)
    assert a8["final"]["mean"] == pytest.approx(-0.15) and a8["final"]["n"] == 2
    assert b8["final"]["n"] == 0  # b has no lag-1 run


def test_cli_grid_refuses_config_flags(capsys, tmp_path, no_training):
    rc, _, err = run_cli(
        capsys,
        "compare",
        "--grid=core",
        f"--out={tmp_path}",
        f"--config={cli.defaults_module.__file__}",
    )
    assert rc == 2 and "change fields with --set KEY=VALUE, not --config" in err


def test_cli_compare_run_dirs_still_overlays(capsys, tmp_path):
    dirs = []
    for seed in range(2):
        d = tmp_path / f"sat-seed{seed}"
        d.mkdir()
        (d / "metrics.jsonl").write_text(
            "".join(
                json.dumps(r) + "\n" for r in records({0: 0.2, 2: 0.3 + 0.1 * seed}, [0.1, 0.2])
            )
        )
        dirs.append(str(d))
    rc, out, _ = run_cli(capsys, "compare", *dirs, f"--out={tmp_path / 'c.png'}")
    assert rc == 0 and out.strip() == str(tmp_path / "c.png") and (tmp_path / "c.png").is_file()


def test_cli_grid_help_names_every_grid_and_lag_mode(capsys):
    from sat_jax.rl import lag

    rc, out, _ = run_cli(capsys, "compare", "--help")
    assert rc == 0
    text = " ".join(out.split())  # the help wraps long lines
    for name in study_grid.grids():
        assert f"{name} (" in text, name
    for mode in lag.MODES:
        assert mode in text.split("--lag_mode", 1)[1].split("--", 1)[0], mode


def test_cli_report_only_writes_the_finished_and_partial_runs_and_trains_none(
    capsys, tmp_path, no_training
):
    out = tmp_path / "study"
    runs = study_grid.expand(
        study_grid.resolve("stale-phase0", methods=["grpo"], lags=[1]), str(out)
    )
    (spec_a, config_a), (spec_b, config_b) = runs[0], runs[1]
    for config, evals in ((config_a, (0.2, 0.4, 0.5)), (config_b, (0.2, 0.3))):
        os.makedirs(config.workdir)
        with open(os.path.join(config.workdir, "metrics.jsonl"), "w") as f:
            for i, v in enumerate(evals):
                f.write(json.dumps({"step": 50 * i, "eval/pass@1": v}) + "\n")
    runner.mark_finished(config_a, {"wall_seconds": 1.0, "end_step": 100})
    rc, stdout, err = run_cli(
        capsys,
        "compare",
        "--grid=stale-phase0",
        "--methods=grpo",
        "--lags=1",
        f"--out={out}",
        "--report_only",
    )
    assert rc == 0, err
    with open(out / "results.csv") as f:
        rows = {r["run_dir"]: r for r in csv.DictReader(f)}
    assert set(rows) == {f"runs/{spec_a.name}", f"runs/{spec_b.name}"}
    assert rows[f"runs/{spec_a.name}"]["status"] == "finished"
    assert rows[f"runs/{spec_b.name}"]["status"] == "partial"
    assert float(rows[f"runs/{spec_a.name}"]["final"]) == 0.5
    assert str(out / "results.md") in stdout
    md = (out / "results.md").read_text()
    assert "- this invocation only wrote the report (`--report_only`)" in md
    assert "already finished" not in md
    rc, _, err = run_cli(capsys, "compare", "--report_only", str(out))
    assert rc == 2 and "--report_only is a flag of compare --grid NAME" in err


def test_cli_compare_takes_the_grids_own_lag_mode(capsys, tmp_path, no_training, monkeypatch):
    fixed = dataclasses.replace(study_grid.study_grids()["stale-phase0"], lag_mode="fixed")
    monkeypatch.setitem(study_grid.study_grids(), "stale-phase0", fixed)
    out = tmp_path / "study"
    ((spec, config),) = study_grid.expand(
        study_grid.resolve("stale-phase0", methods=["grpo"], lags=[1], lrs=[1e-4]), str(out)
    )
    assert spec.lag_mode == "fixed"
    os.makedirs(config.workdir)
    with open(os.path.join(config.workdir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "eval/pass@1": 0.2}) + "\n")
    runner.mark_finished(config, {"wall_seconds": 1.0, "end_step": 1})
    args = ["--grid=stale-phase0", "--methods=grpo", "--lags=1", "--lrs=1e-4", f"--out={out}"]
    rc, _, err = run_cli(capsys, "compare", *args, "--report_only")
    assert rc == 0, err
    with open(out / "results.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert (row["run_dir"], row["lag_mode"], row["status"]) == (
        "runs/grpo-fixed1-lr0.0001-seed0",
        "fixed",
        "finished",
    )


def test_unpaired_seeds_flags_a_seed_whose_runs_had_different_warm_ups():
    def row(seed, loss):
        return {"seed": seed, "warmup_loss": loss}

    rows = [row(0, 0.5), row(0, 0.5), row(1, 0.4), row(1, 0.41), row(2, math.nan), row(2, 0.3)]
    assert stats.unpaired_seeds(rows) == [1]
    assert stats.unpaired_seeds([row(0, 0.5), row(0, "")]) == []
    r = stats.summarize_run([{"step": 0, "sft/final_loss": 0.25}, {"step": 0, "eval/pass@1": 0.1}])
    assert r["warmup_loss"] == 0.25
    assert math.isnan(stats.summarize_run([{"step": 0, "eval/pass@1": 0.1}])["warmup_loss"])
    assert "pairing broken**: the runs of seed(s) 1 " in report._pairing_line(rows)
    # Without digests (runs from before sft/digest) a shared warm-up cannot be checked.
    assert stats.unverified_seeds(rows) == [0, 1, 2]
    assert report._pairing_line(rows[:2]).startswith("- pairing unverified for seed(s) 0:")


def test_warm_up_digests_decide_the_pairing():
    """A cached warm-up logs its digest but no final loss: the digest is what pairs runs."""
    trained = [{"step": 0, "sft/final_loss": 0.7, "sft/digest": 123.0, "sft/cached": 0.0}]
    cached = [{"step": 0, "sft/digest": 123.0, "sft/cached": 1.0}]
    other_cpu = [{"step": 0, "sft/final_loss": 0.7, "sft/digest": 456.0, "sft/cached": 0.0}]
    r = [stats.summarize_run(x) for x in (trained, cached, other_cpu)]
    assert [x["warmup_digest"] for x in r] == [123.0, 123.0, 456.0]
    assert math.isnan(r[1]["warmup_loss"])
    rows = [dict(r[0], seed=0), dict(r[1], seed=0), dict(r[0], seed=1), dict(r[2], seed=1)]
    # Seed 1's warm-ups end at the same loss but are different parameters.
    assert stats.unpaired_seeds(rows) == [1] and stats.unverified_seeds(rows) == []
    assert "seed(s) 1 did not start from the same warm-up" in report._pairing_line(rows)
    assert report._pairing_line(rows[:2]) == (
        "- pairing: every seed's runs started from the same warm-up (equal warm-up digests)"
    )


def test_trajectory_plot_has_panels_only_for_methods_that_logged_the_key(tmp_path, monkeypatch):
    from sat_jax.study import plots as study_plots

    figures, original = [], study_plots._new_figure

    def new_figure(size):
        figures.append(original(size))
        return figures[-1]

    monkeypatch.setattr(study_plots, "_new_figure", new_figure)

    def records(method):
        q = {"loss/sat/q": 0.1} if method == "sat_gspo" else {}
        return [{"step": s, "loss/mismatch": 0.01 * s, **q} for s in range(6)]

    runs = [
        (types.SimpleNamespace(method=m, lag=lag, seed=seed), records(m))
        for m in ("gspo", "sat_gspo", "gspo_tight")
        for lag in (1, 4)
        for seed in (0, 1)
    ]
    path = study_plots.plot_trajectories(runs, "loss/sat/q", tmp_path / "q.png", title="q")
    assert path.is_file() and [ax.get_title() for ax in figures[-1].axes] == ["sat_gspo"]
    path = study_plots.plot_trajectories(runs, "loss/mismatch", tmp_path / "m.png", title="m")
    titles = [ax.get_title() for ax in figures[-1].axes]
    assert path.is_file() and titles == ["gspo", "sat_gspo", "gspo_tight"]
    assert study_plots.plot_trajectories(runs, "no/such", tmp_path / "n.png", title="n") is None
