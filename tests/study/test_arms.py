"""Study 2's arm rules (sat_jax/study/arms.py) on hand-written sweep directories."""

import json
import os

import pytest
from _results_csv import write_results

from sat_jax.study import arms


def _sweep(root, name, method, tail20s=(0.5,) * 4, masked=None, moved=None, lag=8):
    """``root/name`` with one finished run per entry of ``tail20s`` (seeds 0, 1, ...); each run
    logs 8 steps of ``loss/m2po/masked_frac`` = ``masked`` (its last 2 steps: the trailing 25%)
    and ``loss/bapo/steps`` > 0 on the first round(8 · ``moved``) steps."""
    runs = [f"{method}-sampled{lag}-lr4e-05-seed{seed}" for seed in range(len(tail20s))]
    rows = [
        dict(method=method, lag=lag, lr=4e-5, seed=seed, tail20=t, run_dir=str(root / name / r))
        for seed, (t, r) in enumerate(zip(tail20s, runs, strict=True))
    ]
    write_results(root / name, rows, status="finished", lag_mode="sampled")
    for run in runs:
        d = root / name / "runs" / run
        d.mkdir(parents=True)
        with open(d / "metrics.jsonl", "w") as f:
            for step in range(1, 9):
                record = {"step": step, "loss/mismatch": 0.01}  # every training step logs it
                if masked is not None:  # early steps mask more: only the trailing 25% counts
                    record["loss/m2po/masked_frac"] = masked if step > 6 else 0.5
                if moved is not None:
                    record["loss/bapo/steps"] = 3.0 if step <= round(8 * moved) else 0.0
                f.write(json.dumps(record) + "\n")


def _setting(root, binding=0.03):
    rows = [
        dict(method="sat_gspo", lag=8, lr=4e-5, seed=s, tail20=0.4, binding_t25=binding)
        for s in range(4)
    ] + [dict(method="sat_gspo", lag=1, lr=4e-5, seed=0, tail20=0.4, binding_t25=0.5)]
    write_results(root / "setting", rows, status="finished", lag_mode="sampled")


def _decide(root, arm, binding=0.03):
    return arms.decide(arm, arms.collect(str(root))[arm], binding)


def test_the_clips_take_the_best_mean_tail20_with_the_stated_tie_breaks(tmp_path):
    for eps, t in ((0.05, 0.40), (0.07, 0.452), (0.1, 0.455), (0.14, 0.30)):
        _sweep(tmp_path, f"tight-eps{eps}", "gspo_tight", (t,) * 4)
    for kappa, t in ((0.03, 0.452), (0.1, 0.455), (0.3, 0.44), (1.0, 0.2)):
        _sweep(tmp_path, f"age-kappa{kappa}", "age_clip_gspo", (t,) * 4)
    found = arms.collect(str(tmp_path))
    tight = arms.decide("tight", found["tight"], 0.03)
    # 0.07 and 0.1 are within 0.005 of the best (0.455): the larger ε.
    assert tight["status"] == "chosen" and tight["value"] == 0.1
    age = arms.decide("age", found["age"], 0.03)
    assert age["status"] == "chosen" and age["value"] == 0.03  # the smaller κ of the tie
    # Means over seeds: one seed's high value does not carry a worse mean.
    _sweep(tmp_path / "b", "tight-eps0.05", "gspo_tight", (0.9, 0.1, 0.1, 0.1))
    for eps in (0.07, 0.1, 0.14):
        _sweep(tmp_path / "b", f"tight-eps{eps}", "gspo_tight", (0.4,) * 4)
    assert arms.decide("tight", arms.collect(str(tmp_path / "b"))["tight"], 0.03)["value"] == 0.14


def test_a_rule_waits_for_every_seed_of_every_value_it_reads(tmp_path):
    for eps in (0.05, 0.07, 0.1):
        _sweep(tmp_path, f"tight-eps{eps}", "gspo_tight")
    _sweep(tmp_path, "tight-eps0.14", "gspo_tight", (0.9,) * 3)  # a seed still running
    assert _decide(tmp_path, "tight") == {"status": "waiting", "missing": [0.14]}


def test_m2po_keeps_the_papers_tau_if_it_acts_else_matches_sat_binding(tmp_path):
    _sweep(tmp_path / "a", "m2po-tau0.04", "m2po_gspo", masked=0.02)
    assert _decide(tmp_path / "a", "m2po") == {
        "status": "chosen",
        "value": 0.04,
        "why": "it masks 2.00% ≥ 1%",
    }

    root = tmp_path / "b"
    _sweep(root, "m2po-tau0.04", "m2po_gspo", masked=0.0)
    assert _decide(root, "m2po") == {
        "status": "waiting",
        "missing": [1e-3, 3e-4, 1e-4, 3e-5, 1e-5],
    }
    for tau, share in ((1e-3, 0.004), (3e-4, 0.012), (1e-4, 0.026), (3e-5, 0.05), (1e-5, 0.2)):
        _sweep(root, f"m2po-tau{tau}", "m2po_gspo", masked=share)
    _setting(root, binding=0.0319)
    found = arms.collect(str(root))
    out = arms.decide("m2po", found["m2po"], arms.sat_binding_rate(str(root)))
    assert out["status"] == "chosen" and out["value"] == 1e-4  # 2.6% is closest to 3.19%
    # 1e-3 masks 0.4%, which is closest to a 0.5% binding rate but does not act (< 1%).
    assert arms.decide("m2po", found["m2po"], 0.005)["value"] == 3e-4

    root = tmp_path / "c"
    for tau in arms.ARMS["m2po"]["values"]:
        _sweep(root, f"m2po-tau{tau}", "m2po_gspo", masked=0.005)
    assert _decide(root, "m2po")["status"] == "dropped"


def test_bapo_keeps_the_papers_rho_if_its_bounds_act_else_the_smallest_that_does(tmp_path):
    _sweep(tmp_path / "a", "bapo-rho0.4", "bapo_gspo", moved=0.25)
    assert _decide(tmp_path / "a", "bapo")["value"] == 0.4

    root = tmp_path / "b"
    _sweep(root, "bapo-rho0.4", "bapo_gspo", moved=0.0)
    assert _decide(root, "bapo")["missing"] == [0.5]
    _sweep(root, "bapo-rho0.5", "bapo_gspo", moved=0.125)
    assert _decide(root, "bapo")["value"] == 0.5

    root = tmp_path / "c"
    for rho in (0.4, 0.5, 0.6):
        _sweep(root, f"bapo-rho{rho}", "bapo_gspo", moved=0.0)
    assert _decide(root, "bapo")["status"] == "dropped"


def test_an_unlisted_value_is_refused_and_the_cli_writes_the_page(tmp_path, capsys):
    _sweep(tmp_path / "a", "tight-eps0.2", "gspo_tight")
    with pytest.raises(ValueError, match="ε 0.2 is not one of the values"):
        arms.collect(str(tmp_path / "a"))

    root = tmp_path / "b"
    _setting(root)
    _sweep(root, "m2po-tau0.04", "m2po_gspo", masked=0.0)
    out = tmp_path / "arms.md"
    assert arms.main([str(root), "--out", str(out)]) == 0
    text = out.read_text()
    assert "binding rate at the setting, mean lag 8 (M2PO's target): 3.00%" in text
    assert "| 0.04 | 4/4 | 0.00% |" in text
    assert "**Not decided yet**: waiting for 0.001, 0.0003" in text
    assert arms.main([str(tmp_path / "none"), "--out", str(out)]) == 2
    assert "no directory" in capsys.readouterr().err


def test_next_lists_the_sweeps_still_to_run_and_each_resolves_to_its_value(tmp_path, capsys):
    root = tmp_path / "calib"
    _setting(root, binding=0.0319)
    _sweep(root, "m2po-tau0.04", "m2po_gspo", masked=0.0)  # does not act: the smaller τ run
    _sweep(root, "bapo-rho0.4", "bapo_gspo", moved=0.5)  # acts: BAPO is decided
    for eps in (0.05, 0.07, 0.1, 0.14):
        _sweep(root, f"tight-eps{eps}", "gspo_tight")
    assert arms.main(["--next", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    # M2PO's five smaller τ, then the age-aware clip's four κ; nothing for BAPO or the clip.
    assert len(lines) == 9
    assert lines[0] == (
        "sat-jax compare --grid stale2-calib --lags 8 --methods m2po_gspo --baseline m2po_gspo "
        f"--out {root}/m2po-tau0.001 --set loss.tau=0.001"
    )
    assert lines[-1].endswith(f"--out {root}/age-kappa1.0 --set loss.kappa=1.0")
    # Each printed directory is read back as the value its command sets.
    for arm in ("m2po", "age"):
        for value in arms.ARMS[arm]["values"][arm == "m2po" :]:
            cmd = arms.sweep_command(str(root), arm, value)
            name = os.path.basename(cmd[cmd.index("--out") + 1])
            method = arms.ARMS[arm]["method"]
            _sweep(root, name, method, masked=0.005 if arm == "m2po" else None)
            assert value in arms.collect(str(root))[arm]
    assert arms.next_sweeps(str(root)) == []
    with pytest.raises(ValueError, match="not one of the listed values"):
        arms.sweep_command(str(root), "tight", 0.2)
    assert arms.main([str(root)]) == 2
    assert "give --out" in capsys.readouterr().err


def test_next_by_seed_runs_one_seed_of_every_waiting_sweep_at_a_time(tmp_path, capsys):
    root = tmp_path / "calib"
    _setting(root)
    _sweep(root, "m2po-tau0.04", "m2po_gspo", masked=0.02)  # acts: decided
    _sweep(root, "bapo-rho0.4", "bapo_gspo", moved=0.5)  # acts: decided
    # Seed 0 of every ε, seeds 0-1 of κ 0.03; the other κ not run yet.
    for eps in (0.05, 0.07, 0.1, 0.14):
        _sweep(root, f"tight-eps{eps}", "gspo_tight", (0.5,))
    _sweep(root, "age-kappa0.03", "age_clip_gspo", (0.5, 0.5))
    assert arms.main(["--next", "--by-seed", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    # Seed 0 is the lowest missing one: κ 0.1, 0.3 and 1.0 lack it, so they run first.
    assert [line.split("--out ")[1].split()[0] for line in lines] == [
        f"{root}/age-kappa{k}" for k in (0.1, 0.3, 1.0)
    ]
    assert all(line.endswith(" --seeds 1") for line in lines)
    for k in (0.1, 0.3, 1.0):
        _sweep(root, f"age-kappa{k}", "age_clip_gspo", (0.5,))
    # Then seed 1 of every sweep still without it, κ 0.03 (which has it) left out.
    cmds = arms.next_sweeps(str(root), by_seed=True)
    assert [c[c.index("--out") + 1].rsplit("/", 1)[1] for c in cmds] == [
        "tight-eps0.05", "tight-eps0.07", "tight-eps0.1", "tight-eps0.14",
        "age-kappa0.1", "age-kappa0.3", "age-kappa1.0",
    ]  # fmt: skip
    assert all(c[-2:] == ["--seeds", "2"] for c in cmds)
    # Without --by-seed every unfinished sweep, each with its plain command.
    assert len(arms.next_sweeps(str(root))) == 8
    assert all("--seeds" not in c for c in arms.next_sweeps(str(root)))
