"""Tests of the task, list and JSONL prompt sources."""

import json
import os
import subprocess
import sys

import pytest

from sat_jax.data import (
    AdditionTask,
    CharTokenizer,
    JsonlSource,
    ListSource,
    TaskSource,
    TfdsSource,
    check_prompts,
)


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_task_source():
    task = AdditionTask(num_digits=1, train_size=30, eval_size=10)
    train, held_out = TaskSource(task, "train"), TaskSource(task, "eval")
    assert (len(train), len(held_out)) == (30, 10)
    assert train.name == "addition_1/train"
    ex = held_out[3]
    assert ex["index"] == 3 and ex["prompt"] == task.eval[3]["prompt"]
    assert held_out[-1]["index"] == 9
    assert held_out.reward(ex["answer"], ex) == 1.0
    assert [e["prompt"] for e in held_out] == [task.eval[i]["prompt"] for i in range(10)]
    with pytest.raises(IndexError, match="out of range"):
        held_out[10]
    with pytest.raises(ValueError, match="split"):
        TaskSource(task, "test")


def test_jsonl_source_reads_records(tmp_path):
    path = _write(
        tmp_path / "math.jsonl",
        [
            json.dumps({"question": "2+2?", "solution": 4, "id": "a"}),
            "",
            json.dumps({"question": "half of 1?", "solution": "1/2", "id": "b"}),
        ],
    )
    src = JsonlSource(path, prompt_field="question", answer_field="solution")
    assert len(src) == 2
    assert src[0] == {
        "question": "2+2?",
        "solution": 4,
        "id": "a",
        "prompt": "2+2?",
        "answer": "4",
        "index": 0,
    }
    assert src.reward(r"\boxed{0.5}", src[1]) == 1.0
    assert src.reward("5", src[0]) == 0.0


def test_jsonl_answer_fn_and_custom_reward(tmp_path):
    path = _write(tmp_path / "a.jsonl", [json.dumps({"prompt": "p", "answer": "work #### 7"})])
    src = JsonlSource(
        path, answer_fn=lambda a: a.split("####")[-1].strip(), reward_fn=lambda c, ex: 0.25
    )
    assert src[0]["answer"] == "7"
    assert src.reward("7", src[0]) == 0.25


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        JsonlSource(tmp_path / "nope.jsonl")


def test_jsonl_empty_file(tmp_path):
    path = _write(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match=r"empty.jsonl' contains no examples"):
        JsonlSource(path)


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"prompt": "x", "answer": ', "malformed JSON"),
        ('["prompt", "answer"]', "expected a JSON object"),
        ('{"prompt": "x"}', "missing field 'answer'"),
        ('{"prompt": ["x"], "answer": "1"}', "must be a string or a number"),
    ],
)
def test_jsonl_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    good = json.dumps({"prompt": "1+1=", "answer": "2"})
    path = _write(tmp_path / "bad.jsonl", [good, "", bad_line])
    with pytest.raises(ValueError, match=rf"bad.jsonl:3: .*{message}"):
        JsonlSource(path)


def test_list_source():
    src = ListSource([{"prompt": "p", "answer": 3}], name="mine")
    assert src[0]["answer"] == "3" and src.name == "mine"
    with pytest.raises(ValueError, match="empty"):
        ListSource([])
    with pytest.raises(ValueError, match=r"examples\[0\] has no 'answer'"):
        ListSource([{"prompt": "p"}])


def test_tfds_import_is_lazy(monkeypatch, tmp_path):
    # A fresh interpreter that finds the same sat_jax as this one: importing the data layer must
    # not import tensorflow_datasets.
    code = "import sys, sat_jax.data; print('tensorflow_datasets' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    # Without the package, building a TFDS source says what to install.
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(ImportError, match="tensorflow-datasets"):
        TfdsSource("gsm8k")


def test_jsonl_non_utf8_line_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = json.dumps({"prompt": "1+1=", "answer": "2"}).encode()
    path.write_bytes(good + b"\n\n" + b'{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl:3: not valid UTF-8 \(byte b'\\xe9' at"):
        JsonlSource(path)


def test_check_prompts_counts_and_names_the_longest():
    tok = CharTokenizer()
    src = ListSource(
        [
            {"prompt": "1+1=", "answer": "2"},  # 5 tokens with BOS
            {"prompt": "12+34=", "answer": "46"},  # 7
            {"prompt": "123+45=", "answer": "168"},  # 8
        ],
        name="sums",
    )
    assert check_prompts(src, tok, 8) == 3
    with pytest.raises(ValueError) as e:
        check_prompts(src, tok, 6)
    assert str(e.value) == (
        "2 of 3 prompts take more than 6 prompt slots (max_prompt_len); the longest, row 2 of "
        "'sums' ('123+45='), takes 8 tokens"
    )
    assert check_prompts(src, tok, 6, rows=1) == 1  # only the rows an evaluation reads
    # Warm-up targets plus EOS against the response slots: "168" + EOS is 4.
    assert check_prompts(src, tok, 8, max_answer_len=4) == 3
    with pytest.raises(ValueError, match=r"1 of 3 targets take more than 3 response slots"):
        check_prompts(src, tok, 8, max_answer_len=3)
    # A "target" (the response with its working) is what a warm-up trains on, when there is one.
    traced = ListSource([{"prompt": "1+1=", "answer": "2", "target": "1+1=2"}], name="traced")
    with pytest.raises(ValueError, match=r"the longest, row 0 of 'traced' \('1\+1=2'\), takes 6"):
        check_prompts(traced, tok, 8, max_answer_len=5)


def test_check_prompts_applies_the_prompt_format_and_chunks():
    tok = CharTokenizer()
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(10)]
    assert check_prompts(rows, tok, 5, chunk=3) == 10  # a plain list of dicts; "9+1=" + BOS = 5
    with pytest.raises(ValueError, match=r"10 of 10 prompts .* takes 8 tokens"):
        check_prompts(rows, tok, 5, prompt_format=lambda t: "q: " + t, chunk=3)


def test_check_prompts_names_the_row_a_tokenizer_cannot_encode(tmp_path):
    path = _write(
        tmp_path / "p.jsonl",
        [
            json.dumps({"prompt": "1+1=", "answer": "2"}),
            "",
            json.dumps({"prompt": "Two?", "answer": 2}),
        ],
    )
    with pytest.raises(ValueError, match=r"p.jsonl:3: prompt unknown character 'T' at position 0"):
        check_prompts(JsonlSource(path), CharTokenizer(), 16)
    task_src = TaskSource(AdditionTask(num_digits=1, train_size=30, eval_size=10))
    with pytest.raises(ValueError, match=r"row \d+ of 'addition_1/train': prompt unknown char"):
        check_prompts(task_src, CharTokenizer(alphabet="0123456789="), 16)
