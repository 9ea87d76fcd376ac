"""The one study test that trains: ``sat-jax compare --grid`` on a toy grid (one method × two lags,
two steps each), in process. The second run steps the first run's compiled trainer step, and a
second invocation re-runs nothing."""

import os

import pytest
from _study_cli import invoke
from _tiny_models import TINY_RUN
from _traces import compiles_of

from sat_jax.study import runner
from sat_jax.train import components, learner

TINY = [*TINY_RUN, "num_steps=2", "sft.steps=3", "sft.batch_size=16", "eval.every=2"]


def run_cli(*args):
    return invoke(*args)


def test_toy_grid_trains_shares_the_step_and_resumes(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(components, "_TRAIN_STEPS", type(components._TRAIN_STEPS)())
    out = tmp_path / "study"
    args = [
        "compare",
        "--grid=core",
        "--methods=grpo",
        "--baseline=grpo",
        "--lags=1,2",
        "--seeds=1",
        f"--out={out}",
        *(f"--set={s}" for s in TINY),
        f"--set=sft.cache_dir={tmp_path / 'cache'}",
        "--nokeep_checkpoints",
    ]
    with compiles_of("train_on_mesh") as step:
        assert run_cli(*args) == 0
    names = ["grpo-broadcast1-lr0.0001-seed0", "grpo-broadcast2-lr0.0001-seed0"]
    for name in names:
        assert os.path.isfile(out / "runs" / name / "done.json")
        # --nokeep_checkpoints: a finished run's checkpoints are deleted, its log kept.
        assert not os.path.exists(out / "runs" / name / "checkpoints")
        assert os.path.isfile(out / "runs" / name / "metrics.jsonl.gz")
    # Both runs stepped one jitted step (one entry built for both), traced and lowered once.
    assert len(components._TRAIN_STEPS) == 1
    assert (step.traces, step.lowerings) == (1, 1)
    md = (out / "results.md").read_text()
    assert "| GRPO | 2 | 0.0001 | 1 |" in md and "2 runs trained, 0 already finished" in md
    # The CPU each run recorded (the warm-up, and so the pairing, depends on it).
    assert f"- the runs' CPUs: {runner.run_provenance()['cpu']} (2 runs)" in md
    assert f"the runs' commits: {runner.run_provenance()['commit']} (2 runs)" in md
    assert len((out / "results.csv").read_text().splitlines()) == 3
    assert (out / "plots" / "accuracy.png").is_file()

    def refuse(*a, **k):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(learner, "train", refuse)
    capsys.readouterr()
    assert run_cli(*args) == 0
    assert "2 runs already finished, skipped" in capsys.readouterr().err
    assert "0 runs trained, 2 already finished" in (out / "results.md").read_text()


@pytest.fixture(autouse=True)
def _restore_sharing():
    saved = components.SHARE_TRAIN_STEPS
    yield
    components.SHARE_TRAIN_STEPS = saved
