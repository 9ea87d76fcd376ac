"""HFTokenizer on a tiny byte-level BPE ``tokenizer.json`` trained here (no network), the Qwen chat
format against hand-written strings, and the common ``Tokenizer`` protocol."""

from __future__ import annotations

import json

import chex
import numpy as np
import pytest

from sat_jax.data import CharTokenizer
from sat_jax.data.tokenizer import Tokenizer, load_tokenizer, qwen_chat_prompt

tokenizers = pytest.importorskip(
    "tokenizers", reason="HFTokenizer tests need the tokenizers package (sat_jax[hf])"
)
from sat_jax.data.tokenizer import HFTokenizer  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "What is 12 + 35? The answer is 47.",
    "Solve for x: 2x + 3 = 11. So x = 4.",
    "You are a helpful assistant. Put the final answer in \\boxed{}.",
    "user assistant system think",
] * 4


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    # As a Qwen3 base checkpoint: EOS and PAD are <|endoftext|>; AddedToken-dict form for one.
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|endoftext|>",
                "pad_token": {"content": "<|endoftext|>", "special": True},
            }
        )
    )
    return path


def test_round_trip_and_special_ids(tok_dir):
    tok = HFTokenizer(tok_dir)
    assert tok.eos_id == tok.token_to_id("<|endoftext|>") == tok.pad_id == 0
    assert tok.vocab_size == 320
    for text in ["What is 12 + 35?", "x = 4.\n\nDone", "  spaces\tand ünïcode ✓ ", ""]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    # decode stops at EOS (a sampled row padded after it) and accepts arrays.
    ids = tok.encode("The answer is 47.")
    row = np.array(ids + [tok.eos_id] + [tok.pad_id] * 3 + tok.encode("junk"), np.int32)
    assert tok.decode(row) == "The answer is 47."
    assert tok.decode(row, stop_at_eos=False).startswith("The answer is 47.<|endoftext|>")
    with pytest.raises(ValueError, match="outside"):
        tok.decode([tok.vocab_size])
    # Special tokens written in text are single ids.
    assert tok.encode("<|im_start|>user")[0] == tok.token_to_id("<|im_start|>")


def test_chat_template_matches_hand_written_string(tok_dir):
    tok = HFTokenizer(tok_dir, eos_token="<|im_end|>")
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 12 + 35?"},
    ]
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 12 + 35?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages) == expected
    assert qwen_chat_prompt(messages, enable_thinking=False) == (
        expected + "<think>\n\n</think>\n\n"
    )
    multi = messages + [{"role": "assistant", "content": "47"}, {"role": "user", "content": "x?"}]
    assert qwen_chat_prompt(multi, add_generation_prompt=False) == (
        expected + "47<|im_end|>\n<|im_start|>user\nx?<|im_end|>\n"
    )
    ids = tok.encode_chat(messages)
    assert ids.count(tok.token_to_id("<|im_start|>")) == 3
    assert tok.eos_id == tok.token_to_id("<|im_end|>")
    # EOS is <|im_end|> here, so decoding stops at the end of the system turn by default.
    assert tok.decode(ids, stop_at_eos=False) == expected
    assert tok.decode(ids) == "<|im_start|>system\nYou are a helpful assistant."
    ids, lengths = tok.batch_encode([expected, "What"], pad_to=64)
    chex.assert_shape(ids, (2, 64))
    chex.assert_type(ids, np.int32)
    assert tok.decode(ids[0, : lengths[0]], stop_at_eos=False) == expected
    assert (ids[1, lengths[1] :] == tok.pad_id).all()


def test_chat_format_errors():
    with pytest.raises(ValueError, match=r"messages\[1\] has role 'tool'"):
        qwen_chat_prompt([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])
    with pytest.raises(ValueError, match=r"messages\[1\] is a system message"):
        qwen_chat_prompt([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(ValueError, match=r"messages\[0\]\['content'\]"):
        qwen_chat_prompt([{"role": "user", "content": None}])


def test_bad_paths_and_tokens(tok_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer(tmp_path)
    with pytest.raises(ValueError, match="eos_token '<nope>'"):
        HFTokenizer(tok_dir / "tokenizer.json", eos_token="<nope>")
    with pytest.raises(ValueError, match="more than pad_to=2"):
        HFTokenizer(tok_dir).batch_encode(["What is 12 + 35?"], pad_to=2)


def test_both_tokenizers_satisfy_the_protocol(tok_dir):
    char = load_tokenizer("char")
    hf = load_tokenizer(tok_dir)
    for tok in (char, hf):
        assert isinstance(tok, Tokenizer)
        ids = tok.encode("12+35=")
        assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == "12+35="
        assert 0 <= tok.eos_id < tok.vocab_size and 0 <= tok.pad_id < tok.vocab_size
    assert isinstance(char, CharTokenizer) and isinstance(hf, HFTokenizer)


def _config(tok_dir, **data):
    from sat_jax.config import get_config

    c = get_config()
    c.data.tokenizer = str(tok_dir)
    for key, value in data.items():
        c.data[key] = value
    return c


def test_chat_template_on_a_base_tokenizer_needs_the_chat_eos(tok_dir):
    from sat_jax.config import ConfigError, validate

    # tok_dir's tokenizer_config.json names <|endoftext|>, as a base checkpoint's does.
    with pytest.raises(ConfigError) as e:
        validate(_config(tok_dir, chat_template=True))
    assert str(e.value) == (
        "invalid config: data.chat_template=True with data.eos_token='' ends responses at the "
        "tokenizer's default '<|endoftext|>' (a base checkpoint's), but a chat reply ends with "
        "'<|im_end|>': set data.eos_token='<|im_end|>'"
    )
    validate(_config(tok_dir, chat_template=True, eos_token="<|im_end|>"))
    validate(_config(tok_dir, chat_template=False))  # plain prompts end at the tokenizer's EOS


def test_prompts_are_checked_when_the_run_builds_them(tok_dir, tmp_path, monkeypatch):
    from sat_jax.config import ConfigError, validate
    from sat_jax.train import components

    def no_model(*args, **kwargs):
        raise AssertionError("the data check must come before the model is built")

    monkeypatch.setattr(components, "init_model", no_model)
    path = tmp_path / "math.jsonl"
    prompts = ["What is 1 + 2?", "What is 3 + 4?", "What is 12 + 35? The answer is 47. " * 3]
    path.write_text("".join(json.dumps({"prompt": p, "answer": "3"}) + "\n" for p in prompts))
    c = _config(tok_dir, source="jsonl", path=str(path), max_prompt_len=24)
    c.rollout.prompts_per_step, c.rollout.group_size = 2, 4
    validate(c, num_devices=8)  # a Hugging Face tokenizer's rows are checked when it is loaded
    with pytest.raises(ConfigError, match=r"1 of 3 prompts take more than 24 prompt slots .*"):
        components.build(c)
    with pytest.raises(ConfigError, match=rf"the longest, {path}:3 \('What is 12"):
        components.build(c)
    c.data.max_prompt_len = 64
    c.rollout.prompts_per_step = 4
    with pytest.raises(
        ConfigError,
        match="prompts_per_step=4: batch_size=4 is larger than the source \\(3 examples",
    ):
        components.build(c)
