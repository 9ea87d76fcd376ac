"""The long-response built-in tasks (long multiplication with its working, digit sorting), their
difficulty mixtures, the warm-up's corrupted share and the config's length check."""

import collections
import importlib.util
import pathlib

import jax
import numpy as np
import pytest

from sat_jax.config import ConfigError, get_config, validate
from sat_jax.data import (
    AdditionTask,
    CharTokenizer,
    LongMultiplicationTask,
    SortDigitsTask,
    make_task,
    multiplication_trace,
    parse_mixture,
    task_from_config,
)
from sat_jax.data.tasks import _stratified_order, apportion
from sat_jax.models import ModelConfig, abstract_params
from sat_jax.rl.sft import corrupt_pairs, layout_pairs

# ---------------------------------------------------------------- long multiplication


def test_trace_is_partial_products_then_their_sum():
    # 1234 * 7, 1234 * 60, 1234 * 500: least significant digit of b first.
    assert multiplication_trace(1234, 567) == "8638+74040+617000=699678"
    # A zero digit of b writes a 0 term; a 1-digit b has one term.
    assert multiplication_trace(25, 103) == "75+0+2500=2575"
    assert multiplication_trace(99, 9) == "891=891"


def test_examples_are_right_and_fit_the_stated_bounds():
    task = LongMultiplicationTask("2x1:1,3x3:2,4x4:1", train_size=400, eval_size=100, seed=1)
    tok = CharTokenizer()
    longest_prompt = longest_target = 0
    for ex in list(task.train) + list(task.eval):
        a, b = (int(x) for x in ex["prompt"][:-1].split("*"))
        da, db = (int(x) for x in ex["level"].split("x"))
        assert (len(str(a)), len(str(b))) == (da, db)
        assert ex["answer"] == str(a * b) and ex["target"] == multiplication_trace(a, b)
        assert task.reward(ex["target"], ex) == 1.0
        longest_prompt = max(longest_prompt, len(tok.encode(ex["prompt"], add_bos=True)))
        longest_target = max(longest_target, len(tok.encode(ex["target"], add_eos=True)))
    # 4x4: "1234*5678=" is 10 characters; all-nines: 4 terms of 5..8 digits, 3 "+", "=", 8.
    assert task.max_prompt_chars == 10 and task.max_target_chars == 5 + 6 + 7 + 8 + 3 + 1 + 8
    assert longest_prompt <= task.max_prompt_chars + 1
    assert longest_target <= task.max_target_chars + 1
    assert len(multiplication_trace(9999, 9999)) == task.max_target_chars


def test_default_mixture_is_25_to_30_response_tokens():
    task = LongMultiplicationTask(train_size=300, eval_size=30)
    tok = CharTokenizer()
    lengths = collections.defaultdict(set)
    for ex in task.train:
        lengths[ex["level"]].add(len(tok.encode(ex["target"], add_eos=True)))
    # 3x2: 4 + 5 digit terms, "+", "=", 5 digits, EOS; 3x3 and 4x3 likewise.
    assert max(lengths["3x2"]) == 17 and max(lengths["3x3"]) == 25 and max(lengths["4x3"]) == 29
    assert task.max_target_chars + 1 == 29


@pytest.mark.parametrize(
    "cls,mixture", [(LongMultiplicationTask, "2x2:1,3x2:3"), (SortDigitsTask, "3:1,8:2")]
)
def test_splits_are_disjoint_and_deterministic(cls, mixture):
    task = cls(mixture, train_size=600, eval_size=200, seed=0)
    train = [ex["prompt"] for ex in task.train]
    held_out = [ex["prompt"] for ex in task.eval]
    assert len(set(train)) == 600 and len(set(held_out)) == 200
    assert not set(train) & set(held_out)
    again = cls(mixture, train_size=600, eval_size=200, seed=0)
    assert [ex["prompt"] for ex in again.train] == train
    assert [ex["prompt"] for ex in again.eval] == held_out
    other = cls(mixture, train_size=600, eval_size=200, seed=1)
    assert [ex["prompt"] for ex in other.eval] != held_out
    assert task.train[-1] == task.train[599] and len(task.train[2:5]) == 3
    with pytest.raises(IndexError, match="train split of size 600"):
        task.train[600]


# ---------------------------------------------------------------- mixtures


def test_mixture_counts_are_exact():
    task = LongMultiplicationTask("2x2:1,3x2:2,3x3:1", train_size=1001, eval_size=10, seed=0)
    # 1001 * (1, 2, 1) / 4 = 250.25, 500.5, 250.25: floors 250, 500, 250, the 1 left to 3x2.
    assert task.level_counts("train") == {"2x2": 250, "3x2": 501, "3x3": 250}
    # 10 * (1, 2, 1) / 4 = 2.5, 5, 2.5: the tie goes to the earlier level.
    assert task.level_counts("eval") == {"2x2": 3, "3x2": 5, "3x3": 2}
    seen = collections.Counter(ex["level"] for ex in task.train)
    assert seen == {"2x2": 250, "3x2": 501, "3x3": 250}
    # The levels are shuffled together, not in blocks.
    first = [ex["level"] for ex in task.train[:40]]
    assert len(set(first)) == 3
    assert apportion(7, [1.0, 1.0, 1.0]) == [3, 2, 2]
    assert apportion(5, [0.5, 4.5]) == [1, 4]


@pytest.mark.parametrize(
    "cls,mixture", [(LongMultiplicationTask, "2x2:1,3x2:2,3x3:1"), (SortDigitsTask, "4:1,12:3")]
)
def test_every_held_out_prefix_keeps_the_mixture(cls, mixture):
    """An evaluation on the first m held-out prompts sees each level within one example of its
    share m * n_level / n, for every m, and the whole split holds the exact level counts."""
    task = cls(mixture, train_size=400, eval_size=203, seed=3)
    counts = task.level_counts("eval")
    share = {name: c / 203 for name, c in counts.items()}
    seen = collections.Counter()
    for m, ex in enumerate(task.eval, start=1):
        seen[ex["level"]] += 1
        assert all(abs(seen[name] - m * share[name]) <= 1 for name in counts), (m, seen)
    assert seen == counts
    first = [ex["level"] for ex in task.eval[:8]]
    assert len(set(first)) == len(counts)  # interleaved, not blocked


def test_stratified_order_by_hand():
    # Level 0 (3 examples) at 1/6, 1/2, 5/6; level 1 (2) at 1/4, 3/4; each level's order kept.
    order = _stratified_order(np.array([0, 0, 1, 0, 1]), 2)
    assert order.tolist() == [0, 2, 1, 4, 3]


def test_parse_mixture():
    assert parse_mixture("3x3:2,4x3", 2) == (((3, 3), 2.0), ((4, 3), 1.0))
    assert parse_mixture(" 16:0.5, 32:1.5 ", 1) == (((16,), 0.5), ((32,), 1.5))
    for bad, match in [
        ("", "non-empty"),
        ("3x3:0", "weight must be > 0"),
        ("3x3:-1", "weight must be > 0"),
        ("3x3:x", "weight must be > 0"),
        ("3x3:nan", "weight must be > 0"),
        ("3", "level must be NxN"),
        ("3x0", "level must be NxN"),
        ("3x3,3x3:2", "repeats level '3x3'"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_mixture(bad, 2)


def test_bad_tasks():
    with pytest.raises(ValueError, match=r"digit counts must be in \[1, 6\]"):
        LongMultiplicationTask("7x1")
    with pytest.raises(ValueError, match=r"list length must be in \[2, 60\]"):
        SortDigitsTask("1")
    # 1x1 has 81 distinct products a*b with a, b in 1..9.
    with pytest.raises(ValueError, match="level '1x1' has only 81 distinct instances"):
        LongMultiplicationTask("1x1:1,2x2:1", train_size=200, eval_size=10)
    with pytest.raises(ValueError, match="train_size must be an int >= 1"):
        SortDigitsTask(train_size=0)


# ---------------------------------------------------------------- sorting


def test_sort_digits():
    task = SortDigitsTask("4:1,12:1", train_size=50, eval_size=10, seed=2)
    assert task.name == "sort_digits_4_12"
    assert task.max_prompt_chars == 13 and task.max_target_chars == 12
    for ex in task.train:
        digits = ex["prompt"][:-1]
        assert len(digits) == int(ex["level"]) and ex["prompt"].endswith("=")
        assert ex["answer"] == "".join(sorted(digits))
    ex = {"prompt": "5914=", "answer": "1459"}
    assert task.reward("1459", ex) == 1.0 and task.reward(" 1459\n", ex) == 0.0
    assert task.reward("1495", ex) == 0.0  # wrong
    assert task.reward("145", ex) == 0.0  # truncated
    assert task.reward("14599", ex) == 0.0 and task.reward("1459=", ex) == 0.0  # extra text
    assert task.reward("", ex) == 0.0


# ---------------------------------------------------------------- warm-up traces


@pytest.mark.parametrize(
    "task",
    [
        LongMultiplicationTask("2x1:1,3x3:1", train_size=60, eval_size=6),
        SortDigitsTask("5:1,9:1", train_size=60, eval_size=6),
        AdditionTask(2, train_size=60, eval_size=6),
    ],
    ids=["long_multiplication", "sort_digits", "addition"],
)
def test_warmup_traces_parse_and_score_one(task):
    pairs = task.supervised_pairs(40, seed=3)
    assert pairs == task.supervised_pairs(40, seed=3)
    by_prompt = {ex["prompt"]: ex for ex in task.train}
    tok = CharTokenizer()
    for prompt, target in pairs:
        assert task.reward(target, by_prompt[prompt]) == 1.0
        # The trace round-trips through the tokenizer and the sampler's layout.
        assert tok.decode(tok.encode(target, add_eos=True)) == target
    layout_pairs(tok, pairs, task.max_prompt_chars + 1, task.max_target_chars + 1)


def test_corrupt_share_is_exact_and_corrupted_traces_score_zero():
    task = LongMultiplicationTask("3x2:1,3x3:1", train_size=300, eval_size=10)
    pairs = task.supervised_pairs(200, seed=0)
    by_prompt = {ex["prompt"]: ex for ex in task.train}
    for share, expected in [(0.0, 0), (0.3, 60), (0.5, 100), (1.0, 200)]:
        out = corrupt_pairs(task, pairs, share, seed=0)
        assert out == corrupt_pairs(task, pairs, share, seed=0)
        changed = [i for i, (p, q) in enumerate(zip(pairs, out, strict=True)) if p != q]
        assert len(changed) == expected, share
        for i in changed:
            prompt, target = out[i]
            clean = pairs[i][1]
            assert prompt == pairs[i][0]
            assert task.reward(target, by_prompt[prompt]) == 0.0
            # Only the final answer changes; the working and the answer's length stay.
            head, _, answer = target.rpartition("=")
            assert head == clean.rpartition("=")[0] and len(answer) == len(clean.rpartition("=")[2])
    assert corrupt_pairs(task, pairs, 0.3, seed=1) != corrupt_pairs(task, pairs, 0.3, seed=0)
    # floor(share * n + 1/2): 1.5 of 3 rounds up to 2, 0.4 of 4 (1.6) to 2, 0.1 of 4 to 0.
    for n, share, expected in [(3, 0.5, 2), (4, 0.4, 2), (4, 0.1, 0)]:
        out = corrupt_pairs(task, pairs[:n], share, seed=0)
        assert sum(p != q for p, q in zip(pairs[:n], out, strict=True)) == expected
    with pytest.raises(ValueError, match=r"corrupt_share must be in \[0, 1\], got 1.5"):
        corrupt_pairs(task, pairs, 1.5, seed=0)


def test_corrupt_without_working_redraws_the_whole_answer():
    task = SortDigitsTask("6:1", train_size=10, eval_size=2)
    rng = np.random.default_rng(0)
    for _ in range(50):
        wrong = task.corrupt("001459", rng)
        assert len(wrong) == 6 and wrong.isdigit() and wrong != "001459"
    with pytest.raises(ValueError, match="no digits after its last '='"):
        task.corrupt("12+3=", rng)


# ---------------------------------------------------------------- config


def _config(**data):
    c = get_config()
    for k, v in data.items():
        setattr(c.data, k, v)
    return c


def test_task_from_config():
    task = task_from_config(_config(task="long_multiplication", mixture="3x3:1", eval_size=20).data)
    assert isinstance(task, LongMultiplicationTask) and task.mixture == (((3, 3), 1.0),)
    assert len(task.eval) == 20
    default = task_from_config(_config(task="sort_digits", eval_size=20).data)
    assert default.name == "sort_digits_16_24_32"
    assert task_from_config(_config().data).name == "addition_2"
    with pytest.raises(ValueError, match="data.mixture='3x3' applies to"):
        task_from_config(_config(mixture="3x3").data)
    assert make_task("long_multiplication", mixture="3x3", eval_size=5).name == (
        "long_multiplication_3x3"
    )


def test_length_check_is_one_config_error():
    # 4x3: "1234*567=" + BOS = 10 prompt tokens; all-nines trace + EOS = 29 response tokens.
    ok = _config(task="long_multiplication", mixture="4x3", max_prompt_len=10, max_new_tokens=29)
    validate(ok)
    with pytest.raises(ConfigError, match=r"data.max_new_tokens=28 is shorter .* 29 tokens"):
        validate(
            _config(task="long_multiplication", mixture="4x3", max_prompt_len=10, max_new_tokens=28)
        )
    with pytest.raises(ConfigError, match=r"data.max_prompt_len=9 is shorter .* 10 tokens"):
        validate(
            _config(task="long_multiplication", mixture="4x3", max_prompt_len=9, max_new_tokens=29)
        )
    # The default run's 2-digit addition fits its 8 / 5 tokens; 3 digits needs 9 prompt tokens.
    validate(_config())
    with pytest.raises(ConfigError, match="data.max_prompt_len=8 is shorter .* 9 tokens"):
        validate(_config(num_digits=3))
    with pytest.raises(ConfigError, match=r"data.mixture='3x9'.*\[1, 6\]"):
        validate(_config(task="long_multiplication", mixture="3x9"))


def test_warmup_settings_are_checked():
    c = get_config()
    c.sft.corrupt_share = -0.1
    with pytest.raises(ConfigError, match=r"sft.corrupt_share must be in \[0, 1\], got -0.1"):
        validate(c)
    c = get_config()
    c.sft.schedule = "linear"
    with pytest.raises(ConfigError, match=r"sft.schedule must be one of .*got 'linear'"):
        validate(c)


def _preset(name):
    path = pathlib.Path(__file__).parents[2] / "configs" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


@pytest.mark.parametrize(
    "name,task", [("stale_base", LongMultiplicationTask), ("stale_sort", SortDigitsTask)]
)
def test_stale_presets_validate(name, task):
    c = _preset(name)
    validate(c)
    assert isinstance(task_from_config(c.data), task) and c.lag == 1


def test_stale_base_has_the_stated_size():
    c = _preset("stale_base")
    fields = c.model.to_dict()
    fields.pop("hf_path")
    cfg = ModelConfig(vocab_size=CharTokenizer().vocab_size, **fields)
    size = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_params(cfg)))
    d, v, e, f = 128, 52, 64, 32  # width, char vocab, experts, expert width
    attention = d * 4 * 32 + 2 * d * 2 * 32 + 4 * 32 * d + 2 * 32  # q, k, v, o, q/k norms
    block = attention + 2 * d + d * e + e * 3 * d * f  # + 2 norms, router, SwiGLU experts
    assert (cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok) == (4, 64, 4)
    assert size == 4 * block + 2 * v * d + d == 3_389_824


def test_lsb_first_trace_and_reward():
    # Every number reversed: 8638 -> 8368, 74040 -> 04047, 617000 -> 000716, 699678 -> 876996.
    assert multiplication_trace(1234, 567, lsb_first=True) == "8368+04047+000716=876996"
    task = LongMultiplicationTask("4x3:1", train_size=20, eval_size=5, lsb_first=True)
    assert task.name == "long_multiplication_4x3_lsb"
    ex = {"prompt": "1234*567=", "answer": "699678", "a": 1234, "b": 567}
    assert task.reward("8368+04047+000716=876996", ex) == 1.0
    assert task.reward("1+2+3=876996", ex) == 0.0  # right answer after wrong working
    assert task.reward("8368+04047+000716=699678", ex) == 0.0  # the plain-order answer
    assert task.reward("8368+04047+000716=87699", ex) == 0.0  # truncated
    assert task.reward("8368+04047+000716=8769960", ex) == 0.0  # extra digit
    for e in task.train:
        assert e["answer"] == str(e["a"] * e["b"])
        assert task.reward(e["target"], e) == 1.0
        assert len(e["target"]) == len(multiplication_trace(e["a"], e["b"]))
    assert task.max_target_chars == LongMultiplicationTask("4x3:1", train_size=20).max_target_chars
    c = _config(task="long_multiplication_lsb", mixture="4x3", max_prompt_len=10, max_new_tokens=29)
    assert task_from_config(c.data).lsb_first
    validate(c)
    with pytest.raises(ValueError, match="lsb_first must be a bool"):
        LongMultiplicationTask("3x3", lsb_first=1)
