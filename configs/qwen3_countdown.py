"""Qwen3-4B-Base learning Countdown (reasoning-gym) with SAT-GSPO, on one TPU v6e-8 slice.

One command, once the checkpoint is in a local directory on every host (nothing else is
downloaded: the prompts are generated)::

    pip install -e ".[hf,tasks]"
    sat-jax train --config configs/qwen3_countdown.py \\
        --config.model.hf_path=~/Qwen3-4B-Base --config.data.tokenizer=~/Qwen3-4B-Base

The slice: v6e-8, 8 chips of 32 GiB, one host; the mesh is fsdp 8 (parameters, gradients and
Adam moments split 8 ways). Per chip: fp32 parameters, gradients and two Adam moments of 4.0B
parameters are 8.0 GB, the broadcast lag's stale fp32 copy 2.0 GB; each step's 32 × 8 responses
of up to 256 + 1024 tokens train in 4 updates of 8 rows a chip. ``tests/data/test_task_configs.py``
computes the state bytes from the shardings at full depth and compiles the train step, at these
rows and tokens a chip, on a fake 8-device mesh with two blocks, and adds XLA's scratch.

The task: Countdown with 3 or 4 numbers (``reasoning_gym.games.countdown``), the answer an
expression between ``<answer>`` tags, reward 1 only when the generator's scorer gives a full
score; 10,000 training and 256 held-out questions, disjoint, generated once when the run starts.
Prompts in the Qwen chat format; responses end at ``<|im_end|>``.
"""

from ml_collections import config_dict

from sat_jax.config import method_config

# config.json of Qwen/Qwen3-4B-Base (planning only: the run reads the checkpoint's own file).
QWEN3_4B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2560,
    "initializer_range": 0.02,
    "intermediate_size": 9728,
    "max_position_embeddings": 32768,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# The slice this file is sized for, read by the fit test.
SLICE = {"name": "v6e-8", "chips": 8, "hbm_gib": 32}


def get_config() -> config_dict.ConfigDict:
    c = method_config("qwen3_4b_countdown_sat_gspo", "sat_gspo", r3=False)
    c.hf_config_reference = config_dict.ConfigDict(QWEN3_4B_CONFIG)

    c.model.hf_path = "REQUIRED:/path/to/Qwen3-4B-Base"
    c.model.remat = True
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.attention_chunk = 256
    # 256 responses a step in 4 updates of 64 (8 rows a chip): activations and the LM head's
    # [rows, chunk, vocab] fp32 buffers stay a few GiB.
    c.optim.num_minibatches = 4
    c.loss.logprob_chunk = 128

    c.data.source = "reasoning_gym"
    c.data.rg.datasets = "countdown"
    c.data.rg.config = config_dict.ConfigDict(
        {"countdown": {"min_numbers": 3, "max_numbers": 4, "min_target": 10, "max_target": 100}}
    )
    c.data.rg.train_size = 10000
    c.data.eval_size = 256
    c.data.tokenizer = "REQUIRED:/path/to/Qwen3-4B-Base"
    c.data.eos_token = "<|im_end|>"
    c.data.chat_template = True
    c.data.max_prompt_len = 256
    c.data.max_new_tokens = 1024
    c.sft.steps = 0

    c.mesh.data = 1
    c.mesh.fsdp = 8
    c.rollout.dtype = "bfloat16"
    c.rollout.engine = "continuous"
    c.rollout.group_size = 8
    c.rollout.prompts_per_step = 32
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0

    c.loss.eps_low = 0.2
    c.loss.eps_high = 0.2
    c.loss.alpha = 0.9
    c.loss.kl_coef = 0.0  # no reference policy on the chips
    c.loss.advantage = "grpo"
    c.lag_mode = "broadcast"
    c.lag = 4
    c.num_steps = 300

    c.optim.learning_rate = 1e-6
    c.optim.b1 = 0.9
    c.optim.b2 = 0.98

    c.eval.every = 25
    c.eval.num_prompts = 256
    c.checkpoint.every = 25
    return c
