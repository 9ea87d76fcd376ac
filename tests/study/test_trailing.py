"""Logged metrics per cell over the runs' trailing steps (sat_jax/study/trailing.py), on
hand-written study directories."""

import json

import pytest
from _results_csv import write_results

from sat_jax.study import stats, trailing


def _run(d, name, radius, steps=8):
    """A run of ``steps`` training steps logging ``loss/mismatch``, and ``loss/sat/eps`` (1.0
    before its trailing quarter, ``radius`` within it) unless ``radius`` is None."""
    (d / "runs" / name).mkdir(parents=True)
    if radius is not None:  # SAT's runs record where they ran; GSPO's lost its record
        prov = {"commit": "abc", "jax": "0.10.2", "cpu": "AMD EPYC, 2 cores"}
        (d / "runs" / name / "provenance.json").write_text(json.dumps(prov))
    with open(d / "runs" / name / "metrics.jsonl", "w", encoding="utf-8") as f:
        f.write(json.dumps({"step": 0, "eval/pass@1": 0.1}) + "\n")
        for s in range(1, steps + 1):
            rec = {"step": s, "loss/mismatch": 0.01}
            if radius is not None:
                rec["loss/sat/eps"] = radius if s > steps * 3 // 4 else 1.0
            f.write(json.dumps(rec) + "\n")
    return f"runs/{name}"


def _study(tmp_path):
    d = tmp_path / "study"
    rows = [
        {"method": "sat_gspo", "seed": 0, "run_dir": _run(d, "s0", 0.2)},
        {"method": "sat_gspo", "seed": 1, "run_dir": _run(d, "s1", 0.3)},
        {"method": "gspo", "seed": 0, "run_dir": _run(d, "g0", None)},
        # a run still going is not read (its directory does not even exist)
        {"method": "gspo", "seed": 1, "status": "partial", "run_dir": "runs/none"},
    ]
    write_results(d, rows, status="finished", lag_mode="sampled", lag=8, lr=4e-5)
    return d


def test_trailing_steps_are_the_last_quarter_of_training_steps():
    records = [{"step": 0, "eval/pass@1": 0.1}] + [
        {"step": s, "loss/mismatch": 0.0} for s in range(1, 9)
    ]
    assert stats.train_steps(records) == list(range(1, 9))  # the eval at step 0 is not one
    assert stats.trailing_steps(stats.train_steps(records)) == {7, 8}
    assert stats.trailing_steps(stats.train_steps(records[:2])) == {1}  # at least one step
    assert stats.trailing_steps(stats.train_steps(records[:1])) == set()
    with pytest.raises(ValueError, match=r"trailing must be in \(0, 1\], got 0"):
        stats.trailing_steps(stats.train_steps(records), 0)


def test_cell_means_read_each_runs_trailing_window(tmp_path):
    d = _study(tmp_path)
    sat, gspo = trailing.cell_means(str(d), ["loss/sat/eps", "loss/mismatch"])
    assert (sat["method"], sat["lag"], sat["lr"]) == ("sat_gspo", 8, 4e-5)
    mean, sd, n = sat["loss/sat/eps"]
    assert mean == pytest.approx(0.25) and sd == pytest.approx(0.0707107, rel=1e-5) and n == 2
    assert gspo["loss/sat/eps"][2] == 0  # GSPO does not log SAT's radius
    assert gspo["loss/mismatch"] == (
        pytest.approx(0.01),
        pytest.approx(float("nan"), nan_ok=True),
        1,
    )
    page = trailing.markdown(str(d), [sat, gspo], ["loss/sat/eps"])
    assert "| SAT-GSPO | 8 | 4e-05 | 0.2500 ± 0.0707 (2) |" in page
    assert "| GSPO | 8 | 4e-05 | – |" in page


def test_a_metric_no_run_logs_is_refused_with_the_logged_keys(tmp_path):
    d = _study(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"no run logs \['loss/sat/radius'\]; the runs log "
        r"\['eval/pass@1', 'loss/mismatch', 'loss/sat/eps'\]",
    ):
        trailing.cell_means(str(d), ["loss/sat/radius"])
    with pytest.raises(ValueError, match="at least one --metric"):
        trailing.cell_means(str(d), [])
    with pytest.raises(ValueError, match=r"--trailing must be in \(0, 1\], got 1.5"):
        trailing.cell_means(str(d), ["loss/sat/eps"], 1.5)


def test_cli_writes_the_page_and_fails_in_one_line(tmp_path, capsys):
    d = _study(tmp_path)
    out = tmp_path / "docs" / "radius.md"
    assert trailing.main(["--metric", "loss/sat/eps", "--out", str(out), str(d)]) == 0
    text = out.read_text()
    assert "Written by `python -m sat_jax.study.trailing --metric loss/sat/eps --out" in text
    assert "0.2500 ± 0.0707 (2)" in text
    assert (
        "Provenance: the runs' commits: abc (2 runs); not recorded (1 runs); "
        "JAX: 0.10.2 (2 runs); not recorded (1 runs); CPUs: AMD EPYC, 2 cores (2 runs); "
        "not recorded (1 runs)." in text
    )
    assert trailing.main(["--metric", "loss/x", str(d)]) == 2
    assert capsys.readouterr().err.startswith("trailing: error: ")
    assert trailing.main(["--metric", "loss/x", str(tmp_path / "nowhere")]) == 2
    assert "no results.csv in" in capsys.readouterr().err
