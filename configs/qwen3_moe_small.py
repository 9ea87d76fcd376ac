"""A small Qwen3-MoE for CPU / single-host studies on the built-in tasks (char tokenizer).

The shape of Qwen3-MoE (GQA with q/k norm, top-k softmax router with ``norm_topk_prob``, RoPE base
1e6, untied embeddings), scaled down to ≈1.8M parameters: 4 blocks of width 128 with 32 small
experts, top-4. Many small experts make near-ties between the k-th and (k+1)-th router logit common
enough that a bfloat16 engine flips routing on a few percent of token-layers, so the routing
mismatch that R3 removes is measurable (see ``ModelConfig.tiny``).

It is the built-in default run (``sat_jax/config/defaults.py``: SAT-GSPO w/ R3, 2-digit addition)
with this model, at broadcast lag 1; ``model`` holds ``ModelConfig`` fields, so it runs with
``sat-jax train --config configs/qwen3_moe_small.py``. The learning rate sits in the window where
lag 1 is stable and larger lags hurt at this scale (SPEC, "Small-scale studies on a CPU").
"""

from sat_jax.config import method_config


def get_config():
    c = method_config("qwen3_moe_small_sat_gspo_r3", "sat_gspo", r3=True)
    c.lag = 1
    m = c.model
    m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim = 128, 4, 4, 2, 32
    m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size = 32, 4, 32
    m.norm_topk_prob = True
    m.rope_theta = 1e6
    m.rms_norm_eps = 1e-6
    m.router_aux_loss_coef = 0.0
    return c
