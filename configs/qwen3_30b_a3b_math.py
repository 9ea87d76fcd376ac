"""Qwen3-30B-A3B-Base on a reasoning-gym maths mixture with SAT-GSPO w/ R3, on a TPU v6e-64 slice.

The paper's setting (``configs/qwen3_30b_a3b.py``: its model, loss, optimizer and sampling) with
prompts generated rather than read from a JSONL, so it starts with the checkpoint alone::

    pip install -e ".[hf,tasks]"
    sat-jax train --config configs/qwen3_30b_a3b_math.py \\
        --config.model.hf_path=~/Qwen3-30B-A3B-Base \\
        --config.data.tokenizer=~/Qwen3-30B-A3B-Base

The slice: v6e-64 (16 hosts of 4 chips, 32 GiB each), mesh fsdp 16 × expert 4, as
``docs/scaling.md``'s table sizes it (10.9 GiB a chip of state with the stale copy and the KL
reference); ``benchmarks/scale.py`` (its default mesh is this one) compiles this model's step
there; ``tests/data/test_task_configs.py`` computes the state bytes a chip on its mesh.
Responses are capped at 4,096 tokens (the paper's 32k needs the larger meshes of that table);
each step's 64 × 16 responses train in 8 updates of 8 rows a shard.

The mixture (weights in ``data.rg.datasets``): GSM-style word problems from symbolic templates,
multi-operator integer arithmetic, fraction simplification, decimal arithmetic and prime
factorisation; each scored by its generator, 1 only for a full score.
"""

import importlib.util
import os

from ml_collections import config_dict

_BASE = importlib.util.spec_from_file_location(
    "qwen3_30b_a3b", os.path.join(os.path.dirname(os.path.abspath(__file__)), "qwen3_30b_a3b.py")
)
qwen3_30b_a3b = importlib.util.module_from_spec(_BASE)
_BASE.loader.exec_module(qwen3_30b_a3b)

SLICE = {"name": "v6e-64", "chips": 64, "hbm_gib": 32}


def get_config() -> config_dict.ConfigDict:
    c = qwen3_30b_a3b.get_config()
    c.name = "qwen3_30b_a3b_math_sat_gspo_r3"
    c.data.source = "reasoning_gym"
    c.data.path = c.data.eval_path = ""
    c.data.rg.datasets = (
        "gsm_symbolic:4,basic_arithmetic:2,fraction_simplification:1,"
        "decimal_arithmetic:1,prime_factorization:1"
    )
    c.data.rg.train_size = 50000
    c.data.eval_size = 512
    c.data.max_prompt_len = 512
    c.data.max_new_tokens = 4096
    c.eval.num_prompts = 512
    # 64 prompts × 16 a step, in 8 updates of 128 responses (8 rows a (data, fsdp) shard).
    c.rollout.prompts_per_step = 64
    c.optim.num_minibatches = 8
    c.mesh.data = 1
    c.mesh.fsdp = 16
    c.mesh.expert = 4
    return c
