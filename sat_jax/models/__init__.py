"""Flax NNX MoE decoder (Qwen3-MoE shape) with routing capture and replay (R3, Eq. 40), the
trainer-side log-prob path with support replay (Eq. 50), Hugging Face checkpoint loading/saving and
mesh sharding rules."""

from sat_jax.models.config import ModelConfig
from sat_jax.models.hf import (
    config_from_hf,
    config_to_hf,
    hf_tensor_shapes,
    load_hf,
    param_path,
    save_hf,
)
from sat_jax.models.layers import (
    LayerCache,
    RMSNorm,
    load_balancing_loss,
    rotary,
    routing_gates,
    select_experts,
)
from sat_jax.models.logprobs import (
    apply_support_cutoff,
    chunked_logprobs,
    scale_logits,
    token_logprobs,
)
from sat_jax.models.sharding import sharding_rules
from sat_jax.models.transformer import (
    ForwardOutput,
    Transformer,
    graphdef_for,
    init_cache,
    init_model,
    param_count,
    positions_from_mask,
)

__all__ = [
    "ForwardOutput",
    "LayerCache",
    "ModelConfig",
    "RMSNorm",
    "Transformer",
    "apply_support_cutoff",
    "chunked_logprobs",
    "config_from_hf",
    "config_to_hf",
    "graphdef_for",
    "hf_tensor_shapes",
    "init_cache",
    "init_model",
    "load_balancing_loss",
    "load_hf",
    "param_count",
    "param_path",
    "positions_from_mask",
    "rotary",
    "routing_gates",
    "save_hf",
    "scale_logits",
    "select_experts",
    "sharding_rules",
    "token_logprobs",
]
