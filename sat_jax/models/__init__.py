"""Flax NNX MoE decoder (Qwen3-MoE shape) with stacked, scanned blocks, routing capture and replay
(R3, Eq. 40), the trainer-side log-prob path with support replay (Eq. 50), Hugging Face checkpoint
loading/saving and the logical-axis sharding table."""

from sat_jax.models.attention import attend, attend_reference
from sat_jax.models.config import ModelConfig
from sat_jax.models.hf import hf_tensor_shapes
from sat_jax.models.hf_config import config_from_hf, config_to_hf
from sat_jax.models.hf_load import load_hf
from sat_jax.models.hf_save import save_hf
from sat_jax.models.layers import (
    LayerCache,
    RMSNorm,
    apply_rotary,
    load_balancing_loss,
    rotary,
    rotary_tables,
    routing_gates,
    select_experts,
)
from sat_jax.models.logprobs import (
    apply_support_cutoff,
    chunked_logprobs,
    scale_logits,
    token_logprobs,
)
from sat_jax.models.moe import noisy_logits, routing_flips
from sat_jax.models.sharding import (
    BATCH_AXES,
    LOGICAL_AXIS_RULES,
    batch_spec,
    cache_spec,
    check_mesh,
    logical_axes,
    param_path,
    sharding_rules,
)
from sat_jax.models.transformer import (
    ForwardOutput,
    Transformer,
    abstract_params,
    graphdef_for,
    init_cache,
    init_model,
    param_count,
    param_shardings,
    positions_from_mask,
)

__all__ = [
    "BATCH_AXES",
    "ForwardOutput",
    "LOGICAL_AXIS_RULES",
    "LayerCache",
    "ModelConfig",
    "RMSNorm",
    "Transformer",
    "abstract_params",
    "apply_support_cutoff",
    "attend",
    "attend_reference",
    "batch_spec",
    "cache_spec",
    "check_mesh",
    "chunked_logprobs",
    "config_from_hf",
    "config_to_hf",
    "graphdef_for",
    "hf_tensor_shapes",
    "init_cache",
    "init_model",
    "load_balancing_loss",
    "load_hf",
    "logical_axes",
    "noisy_logits",
    "param_count",
    "param_path",
    "param_shardings",
    "positions_from_mask",
    "apply_rotary",
    "rotary",
    "rotary_tables",
    "routing_flips",
    "routing_gates",
    "save_hf",
    "scale_logits",
    "select_experts",
    "sharding_rules",
    "token_logprobs",
]
