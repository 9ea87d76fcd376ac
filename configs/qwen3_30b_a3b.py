"""The paper's main setting: SAT-GSPO with R3 on Qwen3-30B-A3B-Base (Section 5.1, Appendix F).

Usage: point ``model.hf_path`` and ``data.tokenizer`` at a local copy of the checkpoint and
``data.path`` at the prompt JSONL (DAPO-Math-17k + Dolci-RL-Zero-Math-7B, fields prompt/answer);
nothing is downloaded, and until they are set the run stops with an error naming the field::

    sat-jax train --config configs/qwen3_30b_a3b.py --config.lag=8 \\
        --config.model.hf_path=/data/Qwen3-30B-A3B-Base \\
        --config.data.tokenizer=/data/Qwen3-30B-A3B-Base --config.data.path=/data/math.jsonl

Values and where they come from (paper, Appendix F unless noted): group 16 × 256 prompts = 4096
responses per iteration, 544 rollout iterations; Adam β1 0.9, β2 0.98, constant learning rate 1e-6
without warm-up or decay; clip radii ε_low = ε_high = 0.2; SAT with the Hill kernel, exponent 2,
reference quantile α = 0.9; low-variance KL (k3) coefficient 1e-3, no entropy bonus; configured lag
n ∈ {1, 8} trainer steps per weight broadcast (``lag`` = 1 here); sampling at temperature 1.0,
top-p 1.0, top-k off (Section 5.1 says 0.95 in one sentence; Appendix F and E.5 say 1.0, used
here); 32k-token response limit; bf16 arithmetic in both engines with fp32 master weights; no
auxiliary routing loss; a chat template. AIME24 evaluation every 5 iterations, 16 samples each.

``hf_config_reference`` is the checkpoint's published ``config.json`` (transformers 4.51 layout), so
shapes, parameter counts and sharding can be planned without the files
(``sat_jax.models.config_from_hf(dict(config.model.hf_config))``).
"""

from ml_collections import config_dict

from sat_jax.config import method_config

# config.json of Qwen/Qwen3-30B-A3B-Base: 48 layers, d 2048, 32 query / 4 KV heads of 128,
# 128 experts top-8 of width 768, RoPE base 1e6, vocab 151936, untied embeddings.
QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151643,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 32768,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def get_config() -> config_dict.ConfigDict:
    c = method_config("qwen3_30b_a3b_sat_gspo_r3", "sat_gspo", r3=True)
    c.hf_config_reference = config_dict.ConfigDict(QWEN3_30B_A3B_CONFIG)

    c.model.hf_path = "REQUIRED:/path/to/Qwen3-30B-A3B-Base"
    c.model.router_aux_loss_coef = 0.0  # the checkpoint says 0.001; the paper's runs use none
    c.model.remat = True
    # The paper's trainer: bf16 arithmetic, fp32 softmax (ours is float32 inside every softmax),
    # fp32 master weights and optimizer state (Appendix, training setup).
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    # Rows of up to 2,048 + 32,768 tokens: never all [T, V] logits or [heads, T, T] scores at once.
    c.model.attention_chunk = 256
    c.loss.logprob_chunk = 256

    c.data.source = "jsonl"
    c.data.path = "REQUIRED:/path/to/math-prompts.jsonl"
    c.data.eval_path = "REQUIRED:/path/to/aime24.jsonl"  # 30 problems, numeric answers
    c.data.tokenizer = "REQUIRED:/path/to/Qwen3-30B-A3B-Base"
    c.data.eos_token = "<|im_end|>"  # chat turns end here (the base config's EOS is <|endoftext|>)
    c.data.chat_template = True
    c.data.max_prompt_len = 2048
    c.data.max_new_tokens = 32768
    c.sft.steps = 0

    c.rollout.dtype = "bfloat16"
    c.rollout.group_size = 16
    c.rollout.prompts_per_step = 256
    c.rollout.temperature = 1.0  # full-vocabulary support (Lemma 3.1; Appendix E.5)
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0  # 0 disables top-k (the paper's -1)

    c.loss.eps_low = 0.2
    c.loss.eps_high = 0.2
    c.loss.alpha = 0.9  # SAT reference quantile, Hill kernel exponent 2
    c.loss.hill_exponent = 2.0
    c.loss.kl_coef = 1e-3  # low-variance KL (k3)
    c.loss.advantage = "grpo"

    c.lag_mode = "broadcast"
    c.lag = 1  # the paper's grid is {1, 8}
    c.num_steps = 544

    c.optim.learning_rate = 1e-6  # constant, no warm-up or decay
    c.optim.b1 = 0.9
    c.optim.b2 = 0.98

    c.eval.every = 5
    c.eval.num_prompts = 30  # AIME24 has 30 problems; 16 samples each in the paper
    c.checkpoint.every = 5
    return c
