"""A Hugging Face-format checkpoint and tokenizer run through `sat_jax.train.learner` (chat prompts
from JSONL, numeric verifier), with no network and no torch: the checkpoint is written by
`sat_jax.models.save_hf`."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="needs the tokenizers package (sat_jax[hf])")
pytest.importorskip("safetensors", reason="needs the safetensors package (sat_jax[hf])")

from sat_jax import config as config_lib  # noqa: E402
from sat_jax.models import ModelConfig, init_model, save_hf  # noqa: E402
from sat_jax.train import learner  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["What is 12 + 35? The answer is 47.", "user assistant system", "0123456789+-=?"] * 8


def _checkpoint(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    model = ModelConfig(
        vocab_size=320,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    )
    _, params = init_model(model, seed=0)
    save_hf(path, model, params)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"})
    )


def test_hf_checkpoint_trains_through_the_learner(tmp_path):
    ckpt = tmp_path / "qwen3-tiny"
    ckpt.mkdir()
    _checkpoint(ckpt)
    data = tmp_path / "math.jsonl"
    rng = np.random.default_rng(0)
    data.write_text(
        "".join(
            json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
            for a, b in rng.integers(0, 50, size=(16, 2))
        )
    )
    c = config_lib.get_config()
    c.workdir = str(tmp_path / "run")
    c.model.hf_path = str(ckpt)
    c.data.tokenizer, c.data.eos_token, c.data.chat_template = str(ckpt), "<|im_end|>", True
    c.data.source, c.data.path = "jsonl", str(data)
    c.data.max_prompt_len, c.data.max_new_tokens = 48, 6
    c.rollout.prompts_per_step, c.rollout.group_size = 4, 4
    c.num_steps, c.eval.every, c.eval.num_prompts, c.checkpoint.every = 2, 2, 4, 0
    c.log.plots = c.log.tensorboard = c.log.progress = False
    c.mesh.data = 1
    config_lib.validate(c, num_devices=8)
    parts = learner.build(c)
    assert parts.model_cfg.vocab_size == 320 and parts.sft_info == {}
    ids, _ = parts.engine.encode([{"prompt": "What is 1 + 2?"}])
    assert parts.tokenizer.decode(ids[0]).startswith("<|im_start|>user\nWhat is 1 + 2?")
    summary = learner.train(c, quiet=True)
    assert summary["end_step"] == 2
    assert all(np.isfinite(h["loss/total"]) for h in summary["history"])
    final = summary["final_eval"]
    assert len(parts.eval_examples) == 4
    assert set(final) == {"pass@1", "avg@4", "pass@4", "num_prompts"} and final["num_prompts"] == 4
    # 0/1 verifier rewards: pass@1 counts correct samples of 16, pass@4 prompts with one of 4.
    assert final["pass@1"] * 16 == round(final["pass@1"] * 16)
    assert final["pass@4"] * 4 == round(final["pass@4"] * 4)
    assert final["avg@4"] == final["pass@1"] <= final["pass@4"]
    assert (final["pass@1"] > 0) == (final["pass@4"] > 0)
