"""A small Qwen3-MoE for CPU / single-host studies on the built-in tasks (char tokenizer).

The shape of Qwen3-MoE (GQA with q/k norm, top-k softmax router with ``norm_topk_prob``, RoPE base
1e6, untied embeddings), scaled down to ≈1.8M parameters: 4 blocks of width 128 with 32 small
experts, top-4. Many small experts make near-ties between the k-th and (k+1)-th router logit common
enough that a bfloat16 engine flips routing on a few percent of token-layers, so the routing
mismatch that R3 removes is measurable (see ``ModelConfig.tiny``).

``model`` holds ``ModelConfig`` fields directly (``model.hf_path`` None); set ``model.hf_path`` to
a local Hugging Face directory to start from a real checkpoint of the family instead, whose
``config.json`` then fixes the shape. The learning rate sits in the window where lag 1 is stable
and larger lags hurt at this scale (SPEC, "Small-scale studies on a CPU").
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()
    c.name = "qwen3_moe_small_sat_gspo_r3"
    c.seed = 0

    c.model = config_dict.ConfigDict()
    c.model.hf_path = config_dict.placeholder(str)  # None: build from the fields below
    # ModelConfig fields (Qwen3-MoE names).
    c.model.vocab_size = 64  # CharTokenizer ids (52 used)
    c.model.hidden_size = 128
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 32
    c.model.num_experts = 32
    c.model.num_experts_per_tok = 4
    c.model.moe_intermediate_size = 32
    c.model.norm_topk_prob = True
    c.model.mlp_only_layers = ()
    c.model.rope_theta = 1e6
    c.model.rms_norm_eps = 1e-6
    c.model.tie_embeddings = False
    c.model.router_aux_loss_coef = 0.0
    c.model.dtype = "float32"  # trainer
    c.model.engine_dtype = "bfloat16"  # rollout engine: the paper's engine mismatch
    c.model.param_dtype = "float32"

    c.tokenizer = "char"
    c.task = "addition"

    c.objective = "sat_gspo"
    c.routing_replay = True
    c.eps_low = 0.2
    c.eps_high = 0.2
    c.alpha = 0.9
    c.kernel = "hill"
    c.hill_power = 2.0
    c.kl_coef = 0.0
    c.entropy_coef = 0.0
    c.advantage = "grpo"

    c.lag_mode = "broadcast"
    c.lag = 1

    c.group_size = 8
    c.prompts_per_step = 16
    c.num_steps = 200
    c.max_response_len = 16

    c.optimizer = "adam"
    c.learning_rate = 1e-4
    c.b1 = 0.9
    c.b2 = 0.98
    c.warmup_steps = 0

    c.temperature = 1.0
    c.top_p = 1.0
    c.top_k = 0

    c.eval_every = 10
    c.eval_samples = 4

    c.mesh_axes = ("data", "expert", "model")
    c.expert_parallel = 1
    c.model_parallel = 1
    return c
