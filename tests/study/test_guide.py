"""The stabilizer guide on hand-written studies: each difference, the share recovered, the
verdicts, pooling of a study's directories, and the errors."""

import math
import os

import numpy as np
import pytest

from sat_jax.study import guide, pooled, tables

COLUMNS = ["method", "label", "lag_mode", "lag", "lr", "seed", "status", "tail20", "collapse_step"]
LABELS = {"gspo": "GSPO", "sat_gspo": "SAT-GSPO", "gspo_tight": "tight clip", "m2po_gspo": "M2PO"}

# tail20 per (method, lag) on seeds 0-3.
BASE_LO = [0.50, 0.60, 0.55, 0.45]
BASE_HI = [0.40, 0.46, 0.47, 0.39]  # loses 0.10, 0.14, 0.08, 0.06: mean 0.095
SAT_HI = [0.45, 0.50, 0.50, 0.43]  # +0.05, +0.04, +0.03, +0.04 over the base: mean 0.04
SAT_LO = [0.51, 0.59, 0.56, 0.45]  # +0.01, -0.01, +0.01, 0: mean 0.0025
TIGHT_HI = [0.47, 0.53, 0.52, 0.44]  # SAT - tight: -0.02, -0.03, -0.02, -0.01
TIGHT_LO = [0.48, 0.58, 0.53, 0.43]  # -0.02 on every seed
M2PO_HI = [0.39, 0.47, 0.46, 0.40]  # -0.01, +0.01, -0.01, +0.01 over the base


def write_study(d, cells, lr=4e-5, mode="sampled", seeds=range(4), collapse=None):
    rows = []
    for (method, lag), values in cells.items():
        for seed, v in zip(seeds, values, strict=True):
            rows.append(
                {
                    "method": method,
                    "label": LABELS[method],
                    "lag_mode": mode,
                    "lag": lag,
                    "lr": lr,
                    "seed": seed,
                    "status": "finished",
                    "tail20": v,
                    "collapse_step": (collapse or {}).get((method, lag, seed), ""),
                }
            )
    os.makedirs(d, exist_ok=True)
    tables.write_csv(os.path.join(d, "results.csv"), rows, COLUMNS)
    with open(os.path.join(d, "results.md"), "w", encoding="utf-8") as f:
        f.write("# Study\n\n## Provenance\n\n- JAX 0.10.2, Python 3.11.7; 1 × cpu (cpu)\n")
    return str(d)


CELLS = {
    ("gspo", 1): BASE_LO,
    ("gspo", 8): BASE_HI,
    ("sat_gspo", 1): SAT_LO,
    ("sat_gspo", 8): SAT_HI,
    ("gspo_tight", 1): TIGHT_LO,
    ("gspo_tight", 8): TIGHT_HI,
    ("m2po_gspo", 8): M2PO_HI,
}


def test_effects_match_hand_computed_values(tmp_path):
    d = write_study(tmp_path / "s", CELLS, collapse={("m2po_gspo", 8, 2): 150})
    e = guide.effects(pooled.read([d]), base="gspo", treatment="sat_gspo")
    assert (e["lo"], e["hi"], e["lag_mode"], e["lr"]) == (1, 8, "sampled", 4e-5)
    assert e["cost"]["mean"] == pytest.approx(0.095) and e["cost"]["wins"] == 4
    arms = {a["method"]: a for a in e["arms"]}
    # The base first, then the treatment, then the others in the order they appear.
    assert [a["method"] for a in e["arms"]] == ["gspo", "sat_gspo", "gspo_tight", "m2po_gspo"]
    sat = arms["sat_gspo"]
    assert sat["vs_base_hi"]["mean"] == pytest.approx(0.04)
    assert sat["recovered"] == pytest.approx(0.04 / 0.095)
    assert sat["vs_base_lo"]["mean"] == pytest.approx(0.0025)
    assert "sat_minus" not in sat
    tight = arms["gspo_tight"]
    assert tight["sat_minus"]["mean"] == pytest.approx(-0.02)
    assert tight["sat_minus"]["wins"] == 0
    # Exact Wilcoxon on four negative differences (ties in |d| get mid-ranks): p = 2/16.
    assert tight["sat_minus"]["wilcoxon"]["p"] == pytest.approx(0.125)
    assert tight["vs_base_lo"]["mean"] == pytest.approx(-0.02)
    m2po = arms["m2po_gspo"]
    assert m2po["vs_base_lo"] is None  # M2PO ran only at the high lag
    assert m2po["vs_base_hi"]["mean"] == pytest.approx(0.0)
    assert m2po["collapses_hi"] == 1 and arms["gspo"]["collapses_hi"] == 0
    mean, sd, n = arms["gspo"]["tail_hi"]
    assert n == 4 and mean == pytest.approx(sum(BASE_HI) / 4)
    assert sd == pytest.approx(float(np.std(BASE_HI, ddof=1)))


def test_verdicts_read_the_interval_only():
    def p(lo, hi, n=4):
        return {"n": n, "mean": (lo + hi) / 2, "lo": lo, "hi": hi, "wins": 0, "sd": 1.0}

    assert guide.verdict(p(0.01, 0.05)) == "better"
    assert guide.verdict(p(-0.05, -0.01)) == "worse"
    assert guide.verdict(p(-0.01, 0.05)) == "no difference detected"
    assert guide.verdict(p(math.nan, math.nan, n=1)) == "–"
    assert guide.verdict(None) == "–"


def test_page_pools_a_study_and_its_rerun_and_names_what_it_read(tmp_path, capsys):
    fixed = {k: v for k, v in CELLS.items() if k[0] != "m2po_gspo"}
    fixed = {
        ("gspo" if m == "gspo" else m, 4 if lag == 8 else 1): v for (m, lag), v in fixed.items()
    }
    a = write_study(tmp_path / "a", fixed, lr=7e-5, mode="fixed")
    b = write_study(tmp_path / "b", fixed, lr=7e-5, mode="fixed", seeds=range(4, 8))
    c = write_study(tmp_path / "c", CELLS)
    out = tmp_path / "docs" / "stabilizers.md"
    argv = [
        "--treatment=sat_gspo",
        "--base=gspo",
        f"--study=fixed lag 4={a},{b}",
        f"--study=heterogeneous lag={c}",
        f"--out={out}",
    ]
    assert guide.main(argv) == 0
    text = out.read_text()
    assert capsys.readouterr().out == text + "\n"  # the page, echoed
    assert "## fixed lag 4" in text and "## heterogeneous lag" in text
    assert "seeds 0–7 (pooled over the directories: exploratory" in text
    assert "seeds 0–3. Endpoint" in text
    # Staleness costs the base 0.095 on every seed in both blocks (8 seeds when pooled).
    assert "0.095 [" in text and "(n=8, lower on 8/8 seeds)" in text
    # SAT recovers 42% of it; the tight clip is better than SAT at the high lag on every seed.
    assert "| SAT-GSPO | " in text and "| 42% |" in text
    assert "-0.020 [" in text and "(n=8, 0/8 up): worse" in text
    # An arm that did not run at the low lag shows a dash there.
    m2po = next(line for line in text.splitlines() if line.startswith("| M2PO |"))
    assert m2po.split(" | ")[4] == "–"
    assert "JAX 0.10.2" in text and "python -m sat_jax.study.guide" in text


def test_errors_name_the_problem(tmp_path, capsys):
    c = write_study(tmp_path / "c", CELLS)
    assert guide.main(["--treatment=sat_gspo", "--base=gspo", "--study=nodirs", "--out=x"]) == 2
    assert "NAME=DIR" in capsys.readouterr().err
    no_base_lo = {k: v for k, v in CELLS.items() if k != ("gspo", 1)}
    d = write_study(tmp_path / "d", no_base_lo)
    with pytest.raises(ValueError, match="no run of gspo at lag 1"):
        guide.markdown([guide.Study("x", (d,))], base="gspo", treatment="sat_gspo", title="t")
    with pytest.raises(ValueError, match="no run of sat at lag 8"):
        guide.markdown([guide.Study("x", (c,))], base="gspo", treatment="sat", title="t")
    rows = pooled.read([c])
    other_lr = [{**r, "lr": 1e-4, "seed": r["seed"] + 4} for r in rows]
    with pytest.raises(ValueError, match="one learning rate"):
        guide.effects(rows + other_lr, base="gspo", treatment="sat_gspo")
    with pytest.raises(ValueError, match="a low and a high lag"):
        guide.effects([r for r in rows if r["lag"] == 8], base="gspo", treatment="sat_gspo")


def test_share_recovered_reads_the_base_cost_on_the_arms_own_seeds(tmp_path):
    """An arm run on fewer seeds than the base divides its gain by what staleness cost the base
    on those seeds: here seeds 0-1 (cost 0.12), not all four (0.095)."""
    d = write_study(tmp_path / "s", {k: v for k, v in CELLS.items() if k[0] != "m2po_gspo"})
    rows = pooled.read([d])
    m2po = {"method": "m2po_gspo", "label": "M2PO", "lag": 8, "status": "finished"}
    for seed, v in enumerate([0.46, 0.52]):
        rows.append({**rows[0], **m2po, "seed": seed, "tail20": v, "collapse_step": ""})
    e = guide.effects(rows, base="gspo", treatment="sat_gspo")
    arms = {a["method"]: a for a in e["arms"]}
    # M2PO gains +0.06 on seeds 0 and 1, where the base lost 0.10 and 0.14.
    assert arms["m2po_gspo"]["vs_base_hi"]["n"] == 2 and e["cost"]["n"] == 4
    assert arms["m2po_gspo"]["recovered"] == pytest.approx(0.06 / 0.12)
    assert arms["sat_gspo"]["recovered"] == pytest.approx(0.04 / 0.095)
    text = "\n".join(guide._block(guide.Study("s", (d,)), rows, e, "sat_gspo"))
    assert "| 50% (of the base's cost on these 2 seeds) |" in text
    assert "| 42% |" in text  # SAT ran on the base's four seeds: no note
