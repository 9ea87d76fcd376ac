"""Every built-in task's reward is exact: only the canonical response in ASCII digits scores, and a
sampled response with PAD, BOS or an unknown id before its EOS scores 0 in rollouts and in
evaluation alike. Each task faces a table of adversarial strings (at least 30)."""

import types

import jax
import numpy as np
import pytest

from sat_jax.data import (
    AdditionTask,
    CharTokenizer,
    LongMultiplicationTask,
    MultiplicationTask,
    SortDigitsTask,
    decode_response,
)
from sat_jax.rl.rollout import RolloutEngine, evaluate

_SCRIPTS = {
    "arabic-indic": "٠١٢٣٤٥٦٧٨٩",
    "devanagari": "०१२३४५६७८९",
    "fullwidth": "０１２３４５６７８９",
    "math-bold": "𝟎𝟏𝟐𝟑𝟒𝟓𝟔𝟕𝟖𝟗",
}


def _digits_to(script: str, text: str, count: int | None = None) -> str:
    """``text`` with its first ``count`` (all when None) ASCII digits written in ``script``."""
    out, left = [], len(text) if count is None else count
    for ch in text:
        if ch.isascii() and ch.isdigit() and left > 0:
            out.append(_SCRIPTS[script][int(ch)])
            left -= 1
        else:
            out.append(ch)
    return "".join(out)


def _generic_adversaries(t: str) -> list[str]:
    """Near misses of the exact response ``t`` that no exact reward may accept."""
    last = str((int(t[-1]) + 1) % 10)
    out = [
        t + " ",
        " " + t,
        t + "\n",
        "\t" + t,
        "\u00a0" + t,
        t + "\u3000",
        t + "\u200b",
        "\u200b" + t,
        t + "\x00",
        "\ufffd" + t,
        t[:-1],
        t[1:],
        t + t[-1],
        t + t,
        "",
        "0" + t,
        t + "0",
        t + ".",
        t + ".0",
        "+" + t,
        "-" + t,
        t + "a",
        "=" + t,
        t + "=",
        t[:-1] + last,
        t + " " + t,
        t.replace(t[0], " " + t[0], 1),
    ]
    out += [_digits_to(s, t) for s in _SCRIPTS] + [_digits_to(s, t, 1) for s in _SCRIPTS]
    return out


# (task, example, exact response, task-specific adversaries)
_CASES = {
    "addition": (
        AdditionTask(num_digits=2, train_size=10, eval_size=10),
        {"prompt": "37+85=", "answer": "122", "a": 37, "b": 85},
        "122",
        ["37+85=122", "85+37=122", "122=122", "1.22e2", "12 2", "1,22", "0x7a", "CXXII", "0122"],
    ),
    "multiplication": (
        MultiplicationTask(num_digits=2, train_size=10, eval_size=10),
        {"prompt": "12*34=", "answer": "408", "a": 12, "b": 34},
        "408",
        ["48+360=408", "12*34=408", "408=408", "4.08e2", "0408", "40 8", "408.00", "4o8"],
    ),
    "long_multiplication": (
        LongMultiplicationTask("3x2:1", train_size=10, eval_size=5),
        # 199 * 8 = 1592, 199 * 1 * 10 = 1990, 1592 + 1990 = 3582.
        {"prompt": "199*18=", "answer": "3582", "a": 199, "b": 18},
        "1592+1990=3582",
        [
            "3582",
            "0=3582",
            "١٢=3582",
            "5=3582",
            "1990+1592=3582",
            "1592+1990+0=3582",
            "1592=3582",
            "1591+1991=3582",
            "01592+1990=3582",
            "1592+01990=3582",
            "1592+1990=03582",
            "1592+1990=3583",
            "1592+1990=",
            "1592+199",
            "1592+1990=3582=",
            "1592+1990=3582+0",
            "1592 + 1990 = 3582",
            "1592++1990=3582",
            "1592+1990==3582",
            "2951+0991=2853",
            "1592+1990=3582 abc",
            "1592+-1990=3582",
            "1592+1990=+3582",
        ],
    ),
    "long_multiplication_lsb": (
        LongMultiplicationTask("3x2:1", train_size=10, eval_size=5, lsb_first=True),
        {"prompt": "199*18=", "answer": "3582", "a": 199, "b": 18},
        "2951+0991=2853",
        [
            "1592+1990=3582",
            "2853",
            "0=2853",
            "١=2853",
            "0991+2951=2853",
            "2951+991=2853",
            "2951+0991=28530",
            "2951+0991=3582",
            "2951+0991=",
            "2951+0991=2853=",
            "2951 + 0991 = 2853",
            "2951+0991=2854",
        ],
    ),
    "sort_digits": (
        SortDigitsTask("7:1", train_size=10, eval_size=5),
        {"prompt": "9070312=", "answer": "0012379"},
        "0012379",
        [
            "12379",
            "9732100",
            "0012397",
            "00123799",
            "001237",
            "0 0 1 2 3 7 9",
            "0012379=",
            "9070312",
            "0,0,1,2,3,7,9",
            "9070312=0012379",
            "o012379",
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(_CASES))
def test_only_the_exact_response_scores(name):
    task, example, exact, specific = _CASES[name]
    assert task.reward(exact, example) == 1.0
    adversaries = _generic_adversaries(exact) + specific
    assert len(adversaries) >= 30 and exact not in adversaries
    scored = {s: task.reward(s, example) for s in adversaries}
    assert scored == dict.fromkeys(adversaries, 0.0)


def test_every_built_in_example_scores_its_own_target():
    for task, *_ in _CASES.values():
        for ex in list(task.eval)[:5]:
            assert task.reward(ex.get("target", ex["answer"]), ex) == 1.0


# ---------------------------------------------------------------- decoding rule

_TOK = CharTokenizer()
_ONE, _ZERO, _EIGHT = (_TOK.encode(c)[0] for c in "108")
PAD, BOS, EOS = _TOK.pad_id, _TOK.bos_id, _TOK.eos_id


@pytest.mark.parametrize(
    ("ids", "text"),
    [
        ([_ONE, _ZERO, _EIGHT, EOS], "108"),
        ([_ONE, _ZERO, _EIGHT, EOS, PAD, BOS, 60], "108"),  # after the EOS: ignored
        ([_ONE, _ZERO, _EIGHT], "108"),  # no EOS (cut at the length limit): scored as text
        ([EOS, _ONE], ""),
        ([_ONE, BOS, _ZERO, _EIGHT, EOS], None),
        ([_ONE, PAD, _ZERO, _EIGHT, EOS], None),
        ([PAD, _ONE, _ZERO, _EIGHT, EOS], None),
        ([_ONE, _ZERO, _EIGHT, PAD], None),
        ([_ONE, _TOK.vocab_size, _ZERO, _EIGHT, EOS], None),  # an embedding row past the vocab
        ([_ONE, -1, EOS], None),
    ],
)
def test_decode_response(ids, text):
    assert decode_response(_TOK, np.asarray(ids, np.int32)) == text


def test_a_malformed_response_scores_zero_in_rollouts_and_in_evaluation():
    # "108" is the right answer of 54+54; the second and third samples spell it around a BOS and
    # an unknown id, which a decoder that drops them would read as "108".
    task = AdditionTask(num_digits=2, train_size=10, eval_size=10)
    example = {"prompt": "54+54=", "answer": "108", "a": 54, "b": 54}
    rows = [[_ONE, _ZERO, _EIGHT, EOS], [_ONE, BOS, _ZERO, _EIGHT], [_ONE, 63, _ZERO, _EIGHT]]
    prompt_len = 2
    tokens = np.concatenate([np.full((3, prompt_len), BOS), np.asarray(rows)], axis=1)
    calls = []

    def reward_fn(text, ex):
        calls.append(text)
        return task.reward(text, ex)

    engine = RolloutEngine(
        sampler=types.SimpleNamespace(max_prompt_len=prompt_len),
        tokenizer=_TOK,
        reward_fn=reward_fn,
        group_size=3,
        sampling=None,
    )
    out = types.SimpleNamespace(tokens=tokens)
    texts = engine.completions(out)
    assert texts == ["108", None, None]
    assert [engine.reward(t, example) for t in texts] == [1.0, 0.0, 0.0]
    assert calls == ["108"]  # the task's reward never sees a malformed response

    engine.generate = lambda params, batch, key, version: out
    res = evaluate(engine, None, [example], 1, jax.random.key(0))
    assert res["pass@1"] == pytest.approx(1 / 3) and res["pass@3"] == 1.0
