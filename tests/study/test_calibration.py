"""Phase-0 manipulation checks (sat_jax/study/calibration.py) on hand-written results.csv rows."""

import json
import math

import pytest
from _results_csv import write_results

from sat_jax.study import calibration


def _row(method, lag, lr, tail20, mismatch, q="", binding="", collapse="", **extra):
    extra.setdefault("status", "finished")
    extra.setdefault("seed", 0)
    extra.setdefault("lag_mode", "broadcast")
    return dict(
        method=method,
        lag=lag,
        lr=lr,
        tail20=tail20,
        mismatch_t25=mismatch,
        q_t25=q,
        binding_t25=binding,
        collapse_step=collapse,
        **extra,
    )


def test_checks_and_choice(tmp_path):
    rows = [
        # lr 1e-4: passes every check (drop 0.05, d̄_π 0.03, q 0.1 < 0.182, binding 5%).
        _row("grpo", 1, 1e-4, 0.40, 0.01),
        _row("grpo", 8, 1e-4, 0.35, 0.03),
        _row("sat_grpo", 1, 1e-4, 0.9, 0.01, 0.05, 0.01),
        _row("sat_grpo", 8, 1e-4, 0.1, 0.03, 0.10, 0.05),
        # lr 3e-4: no drop but a sustained collapse at lag 8 counts as harm; q too large.
        _row("grpo", 1, 3e-4, 0.40, 0.02),
        _row("grpo", 8, 3e-4, 0.41, 0.04, collapse=150),
        _row("sat_grpo", 1, 3e-4, 0.4, 0.02, 0.1, 0.02),
        _row("sat_grpo", 8, 3e-4, 0.4, 0.04, 0.20, 0.06),
        # lr 1e-3: d̄_π out of range; no SAT runs.
        _row("grpo", 1, 1e-3, 0.40, 0.05),
        _row("grpo", 8, 1e-3, 0.10, 0.12),
    ]
    write_results(tmp_path / "bf16", rows)
    entries = calibration.checks(
        "bf16", calibration.read_rows(tmp_path / "bf16"), baseline="grpo", sat="sat_grpo"
    )
    by_lr = {e["lr"]: e for e in entries}
    e = by_lr[1e-4]
    assert (e["harm"], e["in_range"], e["can_act"], e["binds"], e["passes"]) == (
        True,
        True,
        True,
        True,
        True,
    )
    assert e["base_tail20"] == (0.40, 0.35) and e["lags"] == (1, 8)
    e = by_lr[3e-4]
    assert e["harm"] is True and e["base_collapse"] == (None, 150)
    assert e["can_act"] is False and e["passes"] is False  # 0.20 > log 1.2
    e = by_lr[1e-3]
    assert e["in_range"] is False and e["can_act"] is None and e["passes"] is False
    assert math.isnan(e["q"][1])
    assert calibration.choose(entries)["lr"] == 1e-4
    assert calibration.choose([by_lr[3e-4]]) is None
    md = calibration.markdown(entries, families=[("grpo", "sat_grpo")], command="c", eps_high=0.2)
    assert "**Chosen**: setting `bf16`, `grpo` and `sat_grpo`, at lr 0.0001" in md
    assert "0.182" in md


def test_a_registered_settings_checks_are_stated_and_nothing_is_chosen(tmp_path):
    """--registered (a protocol's counted seeds): each entry's held, failed and uncheckable
    checks are named, and the page chooses no setting, whether or not the checks pass."""
    rows = [
        _row("grpo", 1, 1e-4, 0.40, 0.01),
        _row("grpo", 8, 1e-4, 0.35, 0.03),
        _row("sat_grpo", 1, 1e-4, 0.9, 0.01, 0.05, 0.01),
        _row("sat_grpo", 8, 1e-4, 0.1, 0.03, 0.10, 0.02),  # binds on 2% < 3%
    ]
    write_results(tmp_path / "s", rows)
    out = tmp_path / "checks.md"
    args = ["--baseline", "grpo", "--sat", "sat_grpo", "--out", str(out), str(tmp_path / "s")]
    assert calibration.main([*args, "--registered"]) == 0
    text = out.read_text()
    assert (
        "- `s` (`grpo` / `sat_grpo`, lr 0.0001, lags 1 / 8, 1 seeds): 3 of 5 checks hold; "
        "**not held: binds ≥ 3%**; not checkable from these runs: heterogeneous." in text
    )
    assert "Chosen" not in text and "No setting passes" not in text
    assert calibration.main(args) == 0  # the map's own wording without the flag
    assert "No setting passes every check" in out.read_text()


def test_choose_prefers_binding_then_the_lower_lr():
    def e(lr, binding):
        return {"passes": True, "lr": lr, "binding": (0.0, binding)}

    assert calibration.choose([e(3e-4, 0.05), e(1e-4, 0.04)])["lr"] == 3e-4
    assert calibration.choose([e(3e-4, 0.05), e(1e-4, 0.05)])["lr"] == 1e-4


def test_cli_writes_the_map_and_refuses_a_missing_study(tmp_path, capsys):
    write_results(
        tmp_path / "s", [_row("grpo", 1, 1e-4, 0.4, 0.01), _row("grpo", 8, 1e-4, 0.4, 0.02)]
    )
    out = tmp_path / "phase0.md"
    args = ["--baseline", "grpo", "--sat", "sat_grpo", "--out", str(out)]
    assert calibration.main([*args, str(tmp_path / "s")]) == 0
    assert "No setting passes every check" in out.read_text()
    assert out.read_text().startswith(f"# {calibration.TITLE}\n")
    assert calibration.main([*args, "--title", "Study 2: checks", str(tmp_path / "s")]) == 0
    assert out.read_text().startswith("# Study 2: checks\n")
    assert calibration.main([*args, str(tmp_path / "nope")]) == 2
    assert "no results.csv in" in capsys.readouterr().err
    run = tmp_path / "s" / "runs" / "sat_grpo-broadcast2-lr0.0001-seed0"
    run.mkdir(parents=True)
    with open(run / "metrics.jsonl", "w") as f:
        for step, lag in ((1, 1), (2, 2)):
            f.write(json.dumps({"step": step, "lag/mean": lag, "loss/mismatch": 0.01}) + "\n")
    assert calibration.main([*args, str(tmp_path / "s"), "--by-staleness", str(run)]) == 0
    text = out.read_text()
    assert "## By staleness" in text and "`sat_grpo-broadcast2-lr0.0001-seed0`" in text
    assert "| 2 | 1 | 0.0100 | – |" in text


def test_read_rows_parses_empty_cells(tmp_path):
    write_results(tmp_path / "s", [_row("grpo", 1, 1e-4, "", 0.01)])
    (r,) = calibration.read_rows(tmp_path / "s")
    assert math.isnan(r["tail20"]) and r["collapse_step"] is None and r["lag"] == 1
    with pytest.raises(FileNotFoundError):
        calibration.read_rows(tmp_path / "nope")


def test_partial_runs_are_not_read_and_clip_fractions_are_shown(tmp_path):
    rows = [
        _row("grpo", 1, 1e-4, 0.40, 0.01),
        _row("grpo", 8, 1e-4, 0.30, 0.03, clip_t25=0.011),
        _row("sat_grpo", 8, 1e-4, 0.9, 0.03, 0.10, 0.05, clip_t25=0.042),
        # A run still going at lag 8 of another lr: not read, so that lr has one lag only.
        _row("grpo", 1, 3e-4, 0.40, 0.01),
        _row("grpo", 8, 3e-4, 0.10, 0.03, status="partial"),
    ]
    write_results(tmp_path / "s", rows)
    read = calibration.read_rows(tmp_path / "s")
    assert len(read) == 4
    (e,) = calibration.checks("s", read, baseline="grpo", sat="sat_grpo")
    assert e["lr"] == 1e-4 and e["clipped"] == (0.011, 0.042) and e["passes"] is True
    md = calibration.markdown([e], families=[("grpo", "sat_grpo")], command="c", eps_high=0.2)
    assert "1.10% / 4.20%" in md


def test_each_higher_lag_is_its_own_entry_against_the_lowest():
    rows = [
        _row("grpo", 1, 3e-4, 0.70, 0.008),
        _row("grpo", 8, 3e-4, 0.61, 0.038),
        _row("grpo", 16, 3e-4, 0.48, 0.090),
        _row("sat_grpo", 8, 3e-4, 0.6, 0.039, 0.02, 0.014),
        _row("sat_grpo", 16, 3e-4, 0.5, 0.062, 0.03, 0.040),
    ]
    e8, e16 = calibration.checks("s", rows, baseline="grpo", sat="sat_grpo")
    assert e8["lags"] == (1, 8) and e16["lags"] == (1, 16)
    assert e8["base_tail20"] == (0.70, 0.61) and e16["base_tail20"] == (0.70, 0.48)
    assert (e8["in_range"], e8["binds"], e8["passes"]) == (True, False, False)
    assert (e16["in_range"], e16["binds"], e16["passes"]) == (False, True, False)


def test_each_family_is_read_from_the_directories_that_hold_its_baseline(tmp_path, capsys):
    # One directory with GSPO and SAT-GSPO only, one with GRPO and SAT-GRPO only: each gives
    # the entries of its own family, and a family whose baseline a directory lacks gives none.
    write_results(
        tmp_path / "gspo",
        [
            _row("gspo", 1, 3e-4, 0.70, 0.008),
            _row("gspo", 8, 3e-4, 0.50, 0.030),
            _row("sat_gspo", 8, 3e-4, 0.6, 0.030, 0.04, 0.045),
        ],
    )
    write_results(
        tmp_path / "grpo",
        [
            _row("grpo", 1, 3e-4, 0.70, 0.008),
            _row("grpo", 8, 3e-4, 0.61, 0.038),
            _row("sat_grpo", 8, 3e-4, 0.6, 0.039, 0.02, 0.014),
        ],
    )
    gspo_rows = calibration.read_rows(tmp_path / "gspo")
    assert calibration.checks("gspo", gspo_rows, baseline="grpo", sat="sat_grpo") == []
    out = tmp_path / "phase0.md"
    args = ["--baseline", "grpo,gspo", "--sat", "sat_grpo,sat_gspo", "--out", str(out)]
    assert calibration.main([*args, str(tmp_path / "grpo"), str(tmp_path / "gspo")]) == 0
    md = out.read_text()
    assert "| grpo | `grpo` / `sat_grpo` | 0.0003 | 1 / 8 |" in md
    assert "| gspo | `gspo` / `sat_gspo` | 0.0003 | 1 / 8 |" in md
    assert md.count("| 0.0003 | 1 / 8 |") == 2
    assert "**Chosen**: setting `gspo`, `gspo` and `sat_gspo`, at lr 0.0003" in md
    with pytest.raises(SystemExit):
        calibration.main(["--baseline", "grpo,gspo", "--sat", "sat_grpo", "--out", str(out), "x"])
    assert "name unequal counts" in capsys.readouterr().err


def test_by_staleness_groups_the_trailing_steps_by_their_lag():
    # 8 steps of a broadcast-2 cycle (lag 1, 2, 1, 2, ...); the trailing 50% are steps 5-8.
    records = [{"step": 0, "eval/pass@1": 0.2}]
    for step in range(1, 9):
        lag = 1 + (step + 1) % 2
        records.append(
            {
                "step": step,
                "lag/mean": float(lag),
                "loss/mismatch": 0.01 * lag + 0.001 * step,
                "loss/sat/binding_rate": 0.02 * lag,
                "loss/clip_frac": 0.03,
            }
        )
    rows = calibration.by_staleness(records, trailing=0.5)
    assert [(r["lag"], r["steps"]) for r in rows] == [(1, 2), (2, 2)]
    one, two = rows
    assert one["d̄_π"] == pytest.approx(0.01 + 0.001 * (5 + 7) / 2)
    assert two["d̄_π"] == pytest.approx(0.02 + 0.001 * (6 + 8) / 2)
    assert (one["binding"], two["binding"]) == (pytest.approx(0.02), pytest.approx(0.04))
    assert math.isnan(one["q"]) and one["clipped"] == pytest.approx(0.03)
    assert calibration.by_staleness([]) == []
    with pytest.raises(ValueError, match="trailing"):
        calibration.by_staleness(records, trailing=0)


def test_several_seeds_are_averaged(tmp_path):
    """A setting run on several seeds is checked on the means over them; a collapse counts when
    more seeds collapse at the high lag than at the low one and at least half do."""

    def seeds(method, lag, values, **kw):
        return [
            _row(method, lag, 4e-5, *v, seed=s, lag_mode="fixed", **kw)
            for s, v in enumerate(values)
        ]

    rows = [
        *seeds("gspo", 1, [(0.70, 0.002), (0.74, 0.002), (0.72, 0.002)]),
        *seeds("gspo", 8, [(0.60, 0.030), (0.75, 0.040), (0.66, 0.035)]),
        *seeds(
            "sat_gspo",
            8,
            [(0.7, 0.02, 0.03, 0.020), (0.7, 0.02, 0.03, 0.035), (0.7, 0.02, 0.03, 0.040)],
        ),
    ]
    write_results(tmp_path / "fixed", rows)
    (e,) = calibration.checks(
        "fixed", calibration.read_rows(tmp_path / "fixed"), baseline="gspo", sat="sat_gspo"
    )
    assert e["seeds"] == 3 and e["lags"] == (1, 8)
    assert e["base_tail20"] == pytest.approx((0.72, 0.67))  # a mean drop of 0.05: harm
    assert e["mismatch"][1] == pytest.approx(0.035) and e["binding"][1] == pytest.approx(0.095 / 3)
    # One seed of three under 3% (seed 0, 2.0%) does not fail the mean (3.17%).
    assert (e["harm"], e["in_range"], e["can_act"], e["binds"], e["passes"]) == (True,) * 5
    md = calibration.markdown([e], families=[("gspo", "sat_gspo")], command="c", eps_high=0.2)
    assert "| fixed | `gspo` / `sat_gspo` | 4e-05 | 1 / 8 | 3 | 0.720 / 0.670 | 0/3 / 0/3 |" in md

    # No drop, but two of three seeds collapse at the high lag and none at lag 1: harm.
    flat = [dict(r) for r in rows]
    for r in flat:
        if r["method"] == "gspo":
            r["tail20"] = 0.7
    for r in flat[3:5]:
        r["collapse_step"] = 150
    write_results(tmp_path / "collapse", flat)
    (e,) = calibration.checks(
        "collapse", calibration.read_rows(tmp_path / "collapse"), baseline="gspo", sat="sat_gspo"
    )
    assert e["base_collapses"] == (0, 2) and e["harm"] is True
    # One of three is not enough.
    flat[4]["collapse_step"] = ""
    write_results(tmp_path / "one", flat)
    (e,) = calibration.checks(
        "one", calibration.read_rows(tmp_path / "one"), baseline="gspo", sat="sat_gspo"
    )
    assert e["base_collapses"] == (0, 1) and e["harm"] is False


def test_an_entry_reads_only_the_seeds_its_cells_share(tmp_path):
    """Lag 1 on seeds 0-3 beside lag 16 on seed 0 only: the 1 / 16 entry compares seed 0 with
    seed 0, not seed 0's lag 16 with the four seeds' mean at lag 1; the 1 / 8 entry, where SAT
    ran seeds 0-2 only, reads those three."""
    rows = [_row("gspo", 1, 4e-5, t, 0.004, seed=s) for s, t in enumerate((0.74, 0.47, 0.59, 0.53))]
    rows += [_row("gspo", 8, 4e-5, t, 0.03, seed=s) for s, t in enumerate((0.69, 0.4, 0.5, 0.2))]
    rows += [_row("sat_gspo", 8, 4e-5, 0.5, 0.03, 0.04, b, seed=s) for s, b in enumerate((1, 2, 3))]
    rows += [_row("gspo", 16, 4e-5, 0.61, 0.058), _row("sat_gspo", 16, 4e-5, 0.6, 0.06, 0.07, 0.04)]
    write_results(tmp_path / "z", rows)
    e8, e16 = calibration.checks(
        "z", calibration.read_rows(tmp_path / "z"), baseline="gspo", sat="sat_gspo"
    )
    assert e16["lags"] == (1, 16) and e16["seeds"] == 1
    assert e16["base_tail20"] == pytest.approx((0.74, 0.61)) and e16["harm"] is True
    assert e8["lags"] == (1, 8) and e8["seeds"] == 3
    assert e8["base_tail20"] == pytest.approx((0.60, 0.53)) and e8["binding"][1] == 2
    # Without SAT at the high lag, the baseline's shared seeds (all four).
    (e,) = calibration.checks(
        "z",
        [
            r
            for r in calibration.read_rows(tmp_path / "z")
            if r["lag"] != 16 and r["method"] == "gspo"
        ],
        baseline="gspo",
        sat="sat_gspo",
    )
    assert e["base_tail20"] == pytest.approx((0.5825, 0.4475))


def test_heterogeneity_check_reads_the_age_buckets_where_logged(tmp_path):
    def rows(young, old):
        return [
            _row("gspo", 1, 4e-5, 0.50, 0.005),
            _row("gspo", 8, 4e-5, 0.40, 0.03, lag_le2_t25=young, lag_ge8_t25=old),
            _row("sat_gspo", 8, 4e-5, 0.45, 0.03, 0.05, 0.04),
        ]

    def entry(young, old, name):
        write_results(tmp_path / name, rows(young, old))
        (e,) = calibration.checks(
            name, calibration.read_rows(tmp_path / name), baseline="gspo", sat="sat_gspo"
        )
        return e

    # Every other check holds (drop 0.1, d̄_π 0.03, q 0.05 < 0.182, binding 4%).
    both = entry(0.01, 0.02, "twice")  # exactly 2x: holds
    assert both["by_age"] == (0.01, 0.02) and both["hetero"] is True and both["passes"]
    flat = entry(0.015, 0.02, "flat")  # 1.33x: fails, and so does the setting
    assert flat["hetero"] is False and not flat["passes"]
    # Runs that log no buckets (a fixed lag: every token one age) are not held to it.
    unlogged = entry("", "", "unlogged")
    assert unlogged["hetero"] is None and unlogged["passes"]
    table = calibration.markdown(
        [both, flat], families=[("gspo", "sat_gspo")], command="cmd", eps_high=0.2
    )
    assert "| 0.0100 / 0.0200 | yes | **yes** |" in table
    assert "| 0.0150 / 0.0200 | no | no |" in table
