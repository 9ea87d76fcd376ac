"""Tests of pass@k, avg@k and the evaluate helper."""

import math

import numpy as np
import pytest

from sat_jax.data import (
    AdditionTask,
    ListSource,
    TaskSource,
    avg_at_k,
    evaluate,
    mean_pass_at_k,
    pass1,
    pass_at_k,
)
from sat_jax.data.tasks import SortDigitsTask


def test_pass_at_k_hand_values():
    # 1 - C(n-c, k) / C(n, k)
    assert pass_at_k(5, 0, 2) == 0.0
    assert pass_at_k(5, 5, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)=3, C(4,2)=6
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3,2)=3, C(5,2)=10
    assert pass_at_k(5, 3, 3) == 1.0  # n - c < k
    assert pass_at_k(200, 10, 50) == pytest.approx(1 - math.comb(190, 50) / math.comb(200, 50))


def test_pass_at_k_bad_inputs():
    with pytest.raises(ValueError, match="need n >= k"):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match="c must be in"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="k must be >= 1"):
        pass_at_k(4, 1, 0)
    with pytest.raises(TypeError, match="n must be an int"):
        pass_at_k(4.0, 1, 1)


def test_avg_pass1_and_mean_pass_at_k():
    rewards = np.array([[1, 0, 0, 0], [1, 1, 0, 1], [0, 0, 0, 0]], dtype=np.float32)
    assert avg_at_k(rewards) == pytest.approx(4 / 12)
    assert pass1(rewards) == pytest.approx(4 / 12)
    assert mean_pass_at_k(rewards, 4) == pytest.approx(2 / 3)
    assert mean_pass_at_k(rewards, 2) == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    with pytest.raises(ValueError, match=r"\[num_prompts, k\]"):
        avg_at_k(np.zeros(3))


def test_evaluate_with_fake_generate_fn():
    task = AdditionTask(num_digits=1, train_size=20, eval_size=6, seed=0)
    source = TaskSource(task, "eval")
    calls = []

    def generate_fn(prompts):
        # Sample 0 and 2 right for every prompt, sample 1 wrong; prompt 0 all wrong.
        calls.append(len(prompts))
        out = []
        for p in prompts:
            a, b = p[:-1].split("+")
            right = str(int(a) + int(b))
            wrong = right + "0"
            out.append([wrong, wrong, wrong] if p == source[0]["prompt"] else [right, wrong, right])
        return out

    metrics = evaluate(generate_fn, source, k=3, batch_size=4)
    assert calls == [4, 2]
    assert metrics["n"] == 6 and metrics["k"] == 3
    assert metrics["pass@1"] == pytest.approx(10 / 18)
    assert metrics["avg@3"] == pytest.approx(10 / 18)
    assert metrics["pass@3"] == pytest.approx(5 / 6)


def test_evaluate_splits_pass1_by_difficulty_level():
    """A mixture task's examples carry their level; pass@1 is also reported per level, over that
    level's prompts only, and the overall pass@1 is their prompt-weighted mean."""
    task = SortDigitsTask("4:1,12:1", train_size=20, eval_size=10, seed=0)
    source = TaskSource(task, "eval")
    examples = [source[i] for i in range(len(source))]
    assert sorted(ex["level"] for ex in examples) == ["12"] * 5 + ["4"] * 5

    def generate_fn(prompts):
        # Lists of 4 digits always right; lists of 12 right in 1 sample of 2.
        out = []
        for p in prompts:
            right = "".join(sorted(p[:-1]))
            out.append([right, right] if len(right) == 4 else [right, right + "0"])
        return out

    metrics = evaluate(generate_fn, source, k=2)
    assert metrics["pass@1/4"] == 1.0 and metrics["pass@1/12"] == 0.5
    assert metrics["pass@1"] == pytest.approx(0.75)
    first = evaluate(generate_fn, source, k=2, num_prompts=3)  # only the levels evaluated
    seen = {ex["level"] for ex in examples[:3]}
    assert {k for k in first if k.startswith("pass@1/")} == {f"pass@1/{v}" for v in seen}


def test_evaluate_math_source_and_subset():
    source = ListSource([{"prompt": "q1", "answer": "1/2"}, {"prompt": "q2", "answer": "3"}])
    metrics = evaluate(lambda ps: [[r"\boxed{0.5}", "no"] for _ in ps], source, k=2, num_prompts=1)
    assert metrics == {"pass@1": 0.5, "avg@2": 0.5, "pass@2": 1.0, "n": 1, "k": 2}


def test_evaluate_checks_generate_fn_output():
    source = ListSource([{"prompt": "q", "answer": "1"}])
    with pytest.raises(ValueError, match="returned 2 results for 1 prompts"):
        evaluate(lambda ps: [["1"], ["1"]], source, k=1)
    with pytest.raises(ValueError, match="returned 1 completions for prompt 0"):
        evaluate(lambda ps: [["1"]], source, k=2)
    with pytest.raises(ValueError, match="returned a str completions"):
        evaluate(lambda ps: ["1"], source, k=1)
    with pytest.raises(ValueError, match="num_prompts"):
        evaluate(lambda ps: [["1"]], source, k=1, num_prompts=2)
