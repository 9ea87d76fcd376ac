"""Flax NNX MoE decoder (Qwen3-MoE shape) with routing capture and replay (R3, Eq. 40), and the
trainer-side log-prob path with support replay (Eq. 50)."""

from sat_jax.models.config import ModelConfig
from sat_jax.models.layers import (
    LayerCache,
    RMSNorm,
    load_balancing_loss,
    rotary,
    routing_gates,
    select_experts,
)
from sat_jax.models.logprobs import apply_support_cutoff, scale_logits, token_logprobs
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
    "graphdef_for",
    "init_cache",
    "init_model",
    "load_balancing_loss",
    "param_count",
    "positions_from_mask",
    "rotary",
    "routing_gates",
    "scale_logits",
    "select_experts",
    "token_logprobs",
]
