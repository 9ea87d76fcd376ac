"""Tests of the built-in arithmetic tasks."""

import pytest

from sat_jax.data import AdditionTask, CharTokenizer, MultiplicationTask, make_task


def test_addition_examples_are_correct_and_short():
    task = AdditionTask(num_digits=2, train_size=200, eval_size=50, seed=3)
    assert task.name == "addition_2"
    assert len(task.train) == 200 and len(task.eval) == 50
    tok = CharTokenizer()
    for ex in list(task.train) + list(task.eval):
        a, b = ex["prompt"][:-1].split("+")
        assert ex["prompt"].endswith("=")
        assert ex["answer"] == str(int(a) + int(b))
        assert len(tok.encode(ex["prompt"], add_bos=True)) <= task.max_prompt_chars + 1
        assert len(tok.encode(ex["answer"], add_eos=True)) <= task.max_answer_chars + 1


def test_splits_are_disjoint_and_deterministic():
    task = AdditionTask(num_digits=1, eval_size=20, seed=0)
    # 1 digit: 100 operand pairs, 20 held out, all 80 others for training.
    train = {ex["prompt"] for ex in task.train}
    held_out = {ex["prompt"] for ex in task.eval}
    assert len(train) == 80 and len(held_out) == 20
    assert not train & held_out
    again = AdditionTask(num_digits=1, eval_size=20, seed=0)
    assert [ex["prompt"] for ex in again.eval] == [ex["prompt"] for ex in task.eval]
    other = AdditionTask(num_digits=1, eval_size=20, seed=1)
    assert [ex["prompt"] for ex in other.eval] != [ex["prompt"] for ex in task.eval]


def test_large_digit_counts_sample_without_enumerating():
    task = AdditionTask(num_digits=6, train_size=300, eval_size=100, seed=0)
    prompts = [ex["prompt"] for ex in task.train] + [ex["prompt"] for ex in task.eval]
    assert len(set(prompts)) == 400


def test_reward_is_exact_match():
    task = AdditionTask(num_digits=2, train_size=10, eval_size=10)
    ex = {"prompt": "37+85=", "answer": "122"}
    assert task.reward("122", ex) == 1.0
    assert task.reward(" 122 ", ex) == 0.0
    assert task.reward("0122", ex) == 0.0
    assert task.reward("122=", ex) == 0.0
    assert task.reward("12", ex) == 0.0
    assert task.reward("", ex) == 0.0


def test_multiplication():
    task = MultiplicationTask(num_digits=2, train_size=50, eval_size=10)
    assert task.name == "multiplication_2"
    for ex in task.train:
        a, b = ex["prompt"][:-1].split("*")
        assert ex["answer"] == str(int(a) * int(b))
        assert task.reward(ex["answer"], ex) == 1.0


def test_supervised_pairs():
    task = AdditionTask(num_digits=2, train_size=30, eval_size=10)
    pairs = task.supervised_pairs(8, seed=5)
    assert pairs == task.supervised_pairs(8, seed=5)
    assert len(pairs) == 8 and len(set(pairs)) == 8
    train = {(ex["prompt"], ex["answer"]) for ex in task.train}
    assert set(pairs) <= train
    # More pairs than training examples: drawn with replacement.
    assert len(task.supervised_pairs(100, seed=0)) == 100
    with pytest.raises(ValueError, match="n must be >= 1"):
        task.supervised_pairs(0, seed=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_digits"):
        AdditionTask(num_digits=0)
    with pytest.raises(ValueError, match="eval_size"):
        AdditionTask(num_digits=1, eval_size=100)
    with pytest.raises(ValueError, match="exceeds"):
        AdditionTask(num_digits=1, train_size=90, eval_size=20)
    with pytest.raises(ValueError, match="unknown task name 'countdown'"):
        make_task("countdown")
    assert make_task("addition", num_digits=1, eval_size=10).name == "addition_1"
