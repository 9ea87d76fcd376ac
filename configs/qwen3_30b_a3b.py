"""The paper's main setting: SAT-GSPO with R3 on Qwen3-30B-A3B-Base (Section 5.1, Appendix F).

Usage: point ``model.hf_path`` (and ``tokenizer``) at a local copy of the checkpoint; nothing is
downloaded::

    --config=configs/qwen3_30b_a3b.py --config.model.hf_path=/data/Qwen3-30B-A3B-Base \\
        --config.lag=8

Values and where they come from (paper, Appendix F unless noted): group 16 × 256 prompts = 4096
responses per iteration, 544 rollout iterations; Adam β1 0.9, β2 0.98, constant learning rate 1e-6
without warm-up or decay; clip radii ε_low = ε_high = 0.2; SAT with the Hill kernel, exponent 2,
reference quantile α = 0.9; low-variance KL (k3) coefficient 1e-3, no entropy bonus; configured lag
n ∈ {1, 8} trainer steps per weight broadcast (``lag`` = 1 here); sampling at temperature 1.0,
top-p 1.0, top-k off (Section 5.1 says 0.95 in one sentence; Appendix F and E.5 say 1.0, used
here); 32k-token response limit; bf16 arithmetic in both engines with fp32 master weights; no
auxiliary routing loss; a chat template. AIME24 evaluation every 5 iterations, 16 samples each.

``model.hf_config`` is the checkpoint's published ``config.json`` (transformers 4.51 layout), so
shapes, parameter counts and sharding can be planned without the files
(``sat_jax.models.config_from_hf(dict(config.model.hf_config))``).
"""

from ml_collections import config_dict

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
    c = config_dict.ConfigDict()
    c.name = "qwen3_30b_a3b_sat_gspo_r3"
    c.seed = 0

    c.model = config_dict.ConfigDict()
    c.model.hf_path = config_dict.placeholder(str)  # required: local checkpoint directory
    c.model.hf_config = QWEN3_30B_A3B_CONFIG
    c.model.dtype = "bfloat16"  # trainer compute dtype (Megatron bf16, fp32 softmax)
    c.model.param_dtype = "float32"  # master weights
    c.model.engine_dtype = "bfloat16"  # rollout engine (SGLang bf16)
    c.model.router_aux_loss_coef = 0.0  # "no auxiliary routing loss"; overrides config.json
    c.model.remat = True

    c.tokenizer = config_dict.placeholder(str)  # tokenizer.json directory; usually = hf_path
    c.chat_template = "qwen"  # sat_jax.tokenizers.qwen_chat_prompt
    c.eos_token = "<|im_end|>"  # chat turns end here (the base config's EOS is <|endoftext|>)

    # Objective: SAT-GSPO (Eq. 20) with routing replay (R3, Eq. 40).
    c.objective = "sat_gspo"
    c.routing_replay = True
    c.eps_low = 0.2
    c.eps_high = 0.2
    c.alpha = 0.9  # SAT reference quantile
    c.kernel = "hill"
    c.hill_power = 2.0
    c.kl_coef = 1e-3  # low-variance KL (k3)
    c.entropy_coef = 0.0
    c.advantage = "grpo"

    # Asynchrony: configured lag n, weights broadcast to the engine every n trainer steps.
    c.lag_mode = "broadcast"
    c.lag = 1  # the paper's grid is {1, 8}

    # Batching.
    c.group_size = 16
    c.prompts_per_step = 256
    c.num_steps = 544
    c.max_response_len = 32768

    # Optimiser: Adam, constant learning rate.
    c.optimizer = "adam"
    c.learning_rate = 1e-6
    c.b1 = 0.9
    c.b2 = 0.98
    c.warmup_steps = 0

    # Sampling: full-vocabulary support (Lemma 3.1; Appendix E.5).
    c.temperature = 1.0
    c.top_p = 1.0
    c.top_k = 0  # 0 disables top-k (the paper's -1)

    # Evaluation: AIME24, 16 samples per problem, every 5 iterations.
    c.eval_every = 5
    c.eval_samples = 16

    # Mesh: (data, expert, model) axes, see docs/models.md. The paper ran EP=4 on 4 trainer GPUs.
    c.mesh_axes = ("data", "expert", "model")
    c.expert_parallel = 4
    c.model_parallel = 1
    return c
