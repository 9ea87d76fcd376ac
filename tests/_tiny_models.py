"""The smallest model configs and run configs the sharding, checkpoint, Hugging Face and
system tests share, and a tokenizer trained on the spot."""

import json
import os

from sat_jax.models import ModelConfig

CHAT_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_bpe_tokenizer(path, texts, vocab_size: int = 300) -> str:
    """A byte-level BPE ``tokenizer.json`` (and ``tokenizer_config.json``) trained on ``texts``
    into directory ``path``, with the chat format's special tokens: a Hugging Face tokenizer made
    with no download. Returns ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=CHAT_SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}, f)
    return str(path)


def mixed_moe(**overrides) -> ModelConfig:
    """Two blocks, an MoE block (4 experts, top-2) then a dense one (``mlp_only_layers``), with
    grouped-query attention (4 heads, 2 KV heads): every kind of parameter a checkpoint or a
    sharding rule meets, at a few thousand parameters. ``overrides`` replace any field."""
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        mlp_only_layers=(1,),
        intermediate_size=32,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_run(config, workdir, cache_dir):
    """Shrinks any run config to seconds on a CPU (same code paths)."""
    c = config
    c.workdir = str(workdir)
    c.num_steps = 2
    c.model.hidden_size, c.model.num_layers, c.model.num_heads = 32, 1, 2
    c.model.num_kv_heads, c.model.head_dim = 1, 16
    c.model.num_experts, c.model.num_experts_per_tok, c.model.moe_intermediate_size = 4, 2, 16
    c.rollout.prompts_per_step, c.rollout.group_size = 4, 4
    if c.data.task in ("addition", "multiplication"):
        c.data.max_new_tokens = 4  # long-response tasks keep the length their traces need
    c.sft.steps, c.sft.batch_size, c.sft.cache_dir = 3, 16, str(cache_dir)
    c.eval.every, c.eval.num_prompts = 0, 8
    c.checkpoint.every = 0
    c.log.plots = c.log.tensorboard = c.log.progress = False
    c.mesh.data = 1
    return c
