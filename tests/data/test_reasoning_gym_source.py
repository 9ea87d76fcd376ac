"""The reasoning-gym prompt source: seeded, content-disjoint splits of the stated sizes, and
rewards that agree with each generator's own answers and scorer."""

import threading

import numpy as np
import pytest

rg = pytest.importorskip("reasoning_gym", reason="needs reasoning-gym (sat_jax[tasks])")

from sat_jax.data.grading import Grader  # noqa: E402
from sat_jax.data.reasoning_gym_source import (  # noqa: E402
    ReasoningGymTask,
    check_reasoning_gym,
    parse_datasets,
    reasoning_gym_splits,
)

SPEC = "chain_sum:3,countdown:1"
CONFIGS = {"chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}


@pytest.fixture(scope="module")
def grader():
    g = Grader(deadline=30.0)
    yield g
    g.close()


@pytest.fixture(scope="module")
def splits(grader):
    return reasoning_gym_splits(SPEC, CONFIGS, train_size=48, eval_size=24, seed=3, grader=grader)


def test_splits_are_disjoint_seeded_and_of_the_stated_sizes(splits):
    train, held_out = splits
    assert (len(train), len(held_out)) == (48, 24)
    train_q = {ex["prompt"] for ex in train}
    # chain_sum with two 1-digit terms has only 190 questions: repeats are likely, and
    # a question never crosses the split.
    assert not train_q & {ex["prompt"] for ex in held_out}
    again = reasoning_gym_splits(SPEC, CONFIGS, train_size=48, eval_size=24, seed=3)
    assert [ex["prompt"] for ex in again[1]] == [ex["prompt"] for ex in held_out]
    assert again[0][17] == train[17]  # any example alone, in any order
    other = reasoning_gym_splits(SPEC, CONFIGS, train_size=48, eval_size=24, seed=4)
    assert [ex["prompt"] for ex in other[0]] != [ex["prompt"] for ex in train]
    counts = {
        name: sum(ex["dataset"] == name for ex in train) for name in ("chain_sum", "countdown")
    }
    assert counts["chain_sum"] > counts["countdown"] > 0  # weights 3 : 1


def test_rewards_follow_the_generators_answers(splits):
    train, held_out = splits
    for ex in list(held_out)[:12]:
        answer, entry = ex["answer"], ex["entry"]
        scorer = rg.create_dataset(ex["dataset"], **CONFIGS.get(ex["dataset"], {}))
        assert scorer.score_answer(answer, entry) == 1.0  # the reference's own verdict
        assert train.reward(f"think...<answer>{answer}</answer>", ex) == 1.0
        assert train.reward(f"<answer>{answer}</answer> <answer>0</answer>", ex) == 0.0
        assert train.reward(answer, ex) == 0.0  # unmarked
        assert train.reward("<answer>", ex) == 0.0  # malformed
        wrong = "1+1" if ex["dataset"] == "countdown" else str(int(answer) + 1)
        assert scorer.score_answer(wrong, entry) < 1.0
        assert train.reward(f"<answer>{wrong}</answer>", ex) == 0.0


def test_partial_credit_is_the_scorers_score(grader):
    _, held_out = reasoning_gym_splits(
        "countdown", None, train_size=2, eval_size=2, partial_credit=True, grader=grader
    )
    ex = held_out[0]
    scorer = rg.create_dataset("countdown")
    # Countdown gives a little for a well-formed expression that does not hit the target.
    partial = scorer.score_answer("1+2", ex["entry"])
    assert 0 < partial < 1
    assert held_out.reward("<answer>1+2</answer>", ex) == pytest.approx(partial)
    assert held_out.reward(f"<answer>{ex['answer']}</answer>", ex) == 1.0


def test_plain_format_and_warmup_targets():
    train, held_out = reasoning_gym_splits(
        "chain_sum", CONFIGS, train_size=8, eval_size=4, answer_format="plain"
    )
    ex = train[0]
    assert ex["target"] == ex["answer"] and "<answer>" not in ex["prompt"]
    assert train.reward(f" {ex['answer']} ", ex) == 1.0
    task = ReasoningGymTask(train, held_out)
    pairs = task.supervised_pairs(4, seed=0)
    assert all(p in {e["prompt"] for e in train} for p, _ in pairs)
    wrong = task.corrupt("-14", np.random.default_rng(0))
    assert wrong != "-14" and wrong.startswith("-") and len(wrong) == 3


def test_a_stalling_scorer_is_cut_off_on_a_worker_thread():
    """Countdown's scorer evaluates the expression: 9**9**9**9 never returns."""
    g = Grader(deadline=1.0)
    train, held_out = reasoning_gym_splits("countdown", None, train_size=2, eval_size=2, grader=g)
    ex = held_out[0]
    out = {}

    def grade():
        out["bad"] = held_out.reward("<answer>9**9**9**9</answer>", ex)
        out["good"] = held_out.reward(f"<answer>{ex['answer']}</answer>", ex)

    t = threading.Thread(target=grade)
    t.start()
    t.join(timeout=120)
    g.close()
    assert not t.is_alive() and out == {"bad": 0.0, "good": 1.0} and g.timeouts == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"datasets": "no_such_gym"}, "unknown reasoning-gym generator 'no_such_gym'"),
        ({"datasets": "countdown:0"}, "positive weight"),
        ({"datasets": "countdown,countdown"}, "twice"),
        ({"configs": {"chain_sum": {}}}, r"data.rg.config.chain_sum configures a generator"),
        ({"configs": {"countdown": {"seed": 1}}}, r"countdown.seed is set by the source"),
        ({"configs": {"countdown": {"max_nums": 3}}}, r"countdown.max_nums: not a field"),
        ({"configs": {"countdown": {"min_numbers": 1}}}, "rejected by countdown"),
        ({"train_size": 0}, "data.rg.train_size must be an int >= 1"),
        ({"eval_size": 0}, "data.eval_size must be an int >= 1"),
        ({"answer_format": "xml"}, "data.rg.answer_format"),
    ],
)
def test_bad_arguments_are_one_clear_error(kwargs, match):
    args = dict(datasets="countdown", configs=None, train_size=4, eval_size=4) | kwargs
    with pytest.raises(ValueError, match=match):
        check_reasoning_gym(**args)


def test_parse_datasets():
    assert parse_datasets("a") == [("a", 1.0)]
    assert parse_datasets("a:2, b") == [("a", 2.0), ("b", 1.0)]


def test_sources_from_a_run_config():
    from sat_jax import config as config_lib
    from sat_jax.data.reasoning_gym_source import reasoning_gym_sources

    c = config_lib.get_config()
    c.data.rg.datasets, c.data.rg.train_size, c.data.eval_size = "chain_sum", 6, 3
    c.data.rg.config.chain_sum = {"max_terms": 2, "max_digits": 1}
    train, held_out, task = reasoning_gym_sources(c.data)
    assert (len(train), len(held_out)) == (6, 3) and isinstance(task, ReasoningGymTask)
    c.data.tokenizer = "/some/hf/tokenizer"  # the warm-up encodes with the char tokenizer only
    assert reasoning_gym_sources(c.data)[2] is None
