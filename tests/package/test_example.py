"""The README's losses example is examples/train_step.py, and it runs and learns."""

import re
import runpy
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_step.py"


@pytest.fixture(scope="module")
def example():
    return runpy.run_path(str(EXAMPLE))


def test_the_readme_quotes_the_example():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The losses in your own train step", 1)[1]
    quoted = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    example = re.search(r"# readme: start\n(.*?)# readme: end\n", EXAMPLE.read_text(), re.S)
    assert quoted == example.group(1)


def test_the_example_runs_as_a_script(capsys):
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["0", "5", "10", "15", "19"]


def test_a_train_step_climbs_the_surrogate(example):
    """On-policy (no engine noise) every ratio is 1, so SAT's gradient is the policy gradient of
    Σ m·A·log π / Σ m; a step must raise that objective, and the SAT metrics show no mismatch."""
    params = example["init_params"]
    batch = example["make_batch"](jax.random.key(1), params, mismatch=0.0)
    logprobs = example["policy_logprobs"]

    def objective(params):
        m = batch["mask"].astype(jnp.float32)
        logp = logprobs(params, batch["tokens"])
        return float(jnp.sum(m * batch["advantages"][:, None] * logp) / jnp.sum(m))

    opt_state = example["optimizer"].init(params)
    new, _, metrics = example["train_step"](params, opt_state, batch)
    chex.assert_trees_all_equal_shapes_and_dtypes(new, params)
    chex.assert_tree_all_finite(new)
    chex.assert_trees_all_close(
        {k: metrics[k] for k in ("mismatch", "ratio_mean", "sat/binding_rate")},
        {"mismatch": 0.0, "ratio_mean": 1.0, "sat/binding_rate": 0.0},
        atol=1e-6,
    )
    assert objective(new) > objective(params)
