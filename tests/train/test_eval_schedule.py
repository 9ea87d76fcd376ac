"""Evaluations of two sizes in one run (``eval.full_at``): which steps read the larger held-out
prefix, that the smaller one is that prefix's start, and the config's refusals."""

import pytest
from _tiny_models import tiny_run

from sat_jax import config as config_lib
from sat_jax.config.validation import ConfigError, full_eval_steps, validate
from sat_jax.data import build_sources
from sat_jax.run.metrics import read_metrics
from sat_jax.train import components, learner


def _config(tmp_path, **eval_fields):
    c = tiny_run(config_lib.get_config(), tmp_path / "run", tmp_path / "cache")
    c.num_steps = 4
    c.eval.every, c.eval.num_prompts = 2, 4
    for k, v in eval_fields.items():
        setattr(c.eval, k, v)
    return c


def test_full_steps_read_the_larger_prefix_and_the_others_its_start(tmp_path):
    c = _config(tmp_path, full_at="0,4", full_num_prompts=8)
    learner.train(c, quiet=True)
    records = read_metrics(c.workdir)
    evals = {int(r["step"]): r for r in records if "eval/pass@1" in r}
    assert sorted(evals) == [0, 2, 4]
    assert [evals[s]["eval/num_prompts"] for s in (0, 2, 4)] == [8.0, 4.0, 8.0]
    # The built evaluation set is the larger prefix; a small evaluation reads its first rows.
    parts = components.build(c, warmup=False)
    assert len(parts.eval_examples) == 8
    _, eval_src, _ = build_sources(c.data)
    assert parts.eval_examples == [eval_src[i] for i in range(8)]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(full_at="0,x"), "eval.full_at must be comma-separated steps"),
        (dict(full_at="0,9"), r"steps \[9\] lie outside \[0, num_steps=4\]"),
        (dict(full_at="3"), r"steps \[3\] are not evaluation steps"),
        (dict(full_at="2", full_num_prompts=2), "eval.full_num_prompts=2 must be >= "),
        (dict(full_at="2", every=0), "are not evaluation steps"),
    ],
)
def test_bad_schedules_are_refused_in_one_line(tmp_path, fields, message):
    c = _config(tmp_path, **fields)
    with pytest.raises(ConfigError, match=message):
        validate(c)


def test_the_default_evaluates_one_size():
    c = config_lib.get_config()
    assert full_eval_steps(c) == frozenset()
