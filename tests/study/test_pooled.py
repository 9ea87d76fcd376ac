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
    assert f"`{a}`: seeds 4–7 (24 runs)" in text and f"`{b}`: seeds 8–11 (24 runs)" in text
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
