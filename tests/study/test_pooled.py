"""The pooled, exploratory analysis over study directories (sat_jax/study/pooled.py), on
hand-written results.csv files."""

import pytest
from _results_csv import write_results

from sat_jax.study import pooled, stats

LR = 7e-5


def _write(d, rows):
    write_results(d, rows, status="finished", lag_mode="fixed", lr=LR)


def _study(d, seeds, sat_gain):
    """GSPO, SAT-GSPO and a control at lags 1 and 4: staleness costs GSPO 0.2, SAT recovers
    ``sat_gain`` of it plus a per-seed wobble, the control 0.1."""
    rows = []
    for s in seeds:
        w = 0.01 * ((s * 7) % 5 - 2)
        for method, hi in (("gspo", 0.3), ("sat_gspo", 0.3 + sat_gain + w), ("tight", 0.4)):
            rows += [
                {"method": method, "lag": 1, "seed": s, "tail20": 0.5 + 0.001 * s},
                {"method": method, "lag": 4, "seed": s, "tail20": hi + 0.001 * s},
            ]
    _write(d, rows)
    return d


def test_pooled_tests_are_the_protocols_tests_on_every_seed(tmp_path):
    a = _study(tmp_path / "a", range(4, 8), 0.08)
    b = _study(tmp_path / "b", range(8, 12), 0.12)
    rows = pooled.read([str(a), str(b)])
    assert len(rows) == 48 and {r["study"] for r in rows} == {str(a), str(b)}
    (primary, other) = stats.primary_tests(rows, "sat_gspo", "gspo")
    assert primary["method"] == "sat_gspo" and primary["interaction"]["n"] == 8
    # Seeds 4-7 gain 0.08, seeds 8-11 0.12, each ± the same wobble: the pooled mean is 0.10.
    wobble = sum(0.01 * ((s * 7) % 5 - 2) for s in range(4, 12)) / 8
    assert primary["interaction"]["mean"] == pytest.approx(0.10 + wobble)
    assert other["interaction"]["mean"] == pytest.approx(0.10)

    text = pooled.markdown(rows, "sat_gspo", ["gspo", "tight"], title="T")
    assert text.startswith("# T (exploratory)") and "not pre-registered" in text
    assert f"`{a}`: seeds 4–7 (24 runs); its runs hold no provenance.json" in text
    assert f"`{b}`: seeds 8–11 (24 runs)" in text
    assert "## Against GSPO" in text and "## Against tight" in text
    f = f"{primary['interaction']['mean']:+.3f}"
    assert f"{f} [" in text and "(n=8, " in text


def test_a_seed_in_two_studies_is_refused(tmp_path):
    a = _study(tmp_path / "a", range(4, 8), 0.08)
    b = _study(tmp_path / "b", range(7, 9), 0.08)
    with pytest.raises(ValueError, match=r"in both .*a and .*b: pooling would count seed 7 twice"):
        pooled.read([str(a), str(b)])


def test_studies_of_other_arms_are_refused(tmp_path):
    a = _study(tmp_path / "a", range(4, 8), 0.08)
    b = tmp_path / "b"
    _write(b, [{"method": "gspo", "lag": 8, "seed": 9, "tail20": 0.3}])
    with pytest.raises(ValueError, match="pool only the runs of one protocol"):
        pooled.read([str(a), str(b)])


def test_cli_writes_the_page_and_fails_in_one_line(tmp_path, capsys):
    a = _study(tmp_path / "a", range(4, 8), 0.08)
    out = tmp_path / "docs" / "pooled.md"
    args = ["--treatment", "sat_gspo", "--control", "gspo", "--out", str(out), str(a)]
    assert pooled.main(args) == 0
    assert "python -m sat_jax.study.pooled --treatment sat_gspo" in out.read_text()
    assert pooled.main(["--treatment", "sat", "--control", "gspo", str(a)]) == 2
    assert "no runs of ['sat']" in capsys.readouterr().err
    assert pooled.main(["--treatment", "sat_gspo", "--control", "gspo", str(tmp_path / "x")]) == 2
    assert "no results.csv in" in capsys.readouterr().err


def _study2(d, seeds, sat_minus_tight):
    """Study 2's layout: GSPO, SAT-GSPO and the tight clip at lags 1 and 8, M2PO at lag 8 on the
    first two seeds only; SAT-GSPO sits ``sat_minus_tight`` from the tight clip at lag 8."""
    rows = []
    for s in seeds:
        for method, hi in (("gspo", 0.3), ("sat_gspo", 0.4 + sat_minus_tight), ("tight", 0.4)):
            rows += [
                {"method": method, "lag": 1, "seed": s, "tail20": 0.5},
                {"method": method, "lag": 8, "seed": s, "tail20": hi + 0.001 * s},
            ]
    rows += [{"method": "m2po", "lag": 8, "seed": s, "tail20": 0.35} for s in seeds[:2]]
    _write(d, rows)
    return d


def test_pooled_difference_at_one_lag_is_study_2s_test_on_every_seed(tmp_path, capsys):
    a = _study2(tmp_path / "a", [20, 21, 22, 23], -0.02)
    b = _study2(tmp_path / "b", [32, 33, 34, 35], 0.0)
    rows = pooled.read([str(a), str(b)])
    text = pooled.markdown(rows, "sat_gspo", ["tight"], title="T", lag=8)
    assert "## At lag 8" in text and "## Against" not in text  # no lag interaction
    table = text.split("## At lag 8")[1]
    primary = next(line for line in table.splitlines() if line.startswith("| **tight**"))
    assert "| -0.010 [" in primary and "(n=8, " in primary  # four seeds at -0.02, four at 0
    m2po = next(line for line in table.splitlines() if line.startswith("| M2PO |"))
    assert "(n=4, 4/4 up)" in m2po  # the seeds M2PO ran in either study
    gspo = next(line for line in table.splitlines() if line.startswith("| GSPO |"))
    assert "(n=8, 8/8 up)" in gspo
    with pytest.raises(ValueError, match=r"one control .*got controls \['tight', 'gspo'\]"):
        pooled.markdown(rows, "sat_gspo", ["tight", "gspo"], title="T", lag=8)

    out = tmp_path / "pooled.md"
    args = ["--treatment", "sat_gspo", "--control", "tight", "--lag", "8", "--out", str(out)]
    assert pooled.main([*args, str(a), str(b)]) == 0
    assert "--lag 8" in out.read_text() and "## At lag 8" in out.read_text()
    assert pooled.main(["--treatment", "sat_gspo", "--control", "tight", "--lag", "4", str(a)]) == 2
    assert "no run of ['sat_gspo', 'tight'] at lag 4" in capsys.readouterr().err
