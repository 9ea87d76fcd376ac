"""Hugging Face ``config.json`` <-> ``ModelConfig`` (Qwen3-MoE and dense Qwen3).

The tensor side (safetensors reading and writing, the name/layout map) is ``sat_jax.models.hf``;
this module only maps configuration fields, so importing it needs neither safetensors nor the
model code.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from sat_jax.models.config import ModelConfig

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen3")
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _require(hf: Mapping[str, Any], key: str, *, alias: str | None = None) -> Any:
    if key in hf and hf[key] is not None:
        return hf[key]
    if alias is not None and alias in hf and hf[alias] is not None:
        return hf[alias]
    raise ValueError(f"config.json lacks the required field {key!r}")


def _int(hf: Mapping[str, Any], key: str, *, alias: str | None = None, required: bool = True):
    """Integer field ``key`` (None when absent and not ``required``), named when malformed."""
    value = _require(hf, key, alias=alias) if required else hf.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config.json field {key!r} must be an integer, got {value!r}")
    return value


def _float(hf: Mapping[str, Any], key: str, value: Any = None) -> float | None:
    """Number field ``key`` (or ``value`` read from it), finite, named when malformed."""
    value = hf.get(key) if value is None else value
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"config.json field {key!r} must be a finite number, got {value!r}")
    return float(value)


def _rope_theta(hf: Mapping[str, Any]) -> float:
    """rope_theta from either layout: top-level ``rope_theta`` + ``rope_scaling`` (transformers 4)
    or ``rope_parameters`` (transformers 5). Only the default (unscaled) rotary is supported."""
    theta = hf.get("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):
        rope = hf.get(key)
        if rope is None:
            continue
        if not isinstance(rope, Mapping):
            raise ValueError(f"config.json {key} must be an object, got {rope!r}")
        if "full_attention" in rope and isinstance(rope["full_attention"], Mapping):
            rope = rope["full_attention"]  # per-layer-type form; all layers are full attention
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in (None, "default"):
            raise ValueError(
                f"config.json {key} has rope_type {kind!r}; only the default rotary embedding is "
                "supported (no YaRN / linear / dynamic scaling)"
            )
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                f"config.json {key}.partial_rotary_factor={rope['partial_rotary_factor']} is not "
                "supported (rotary over the whole head only)"
            )
        theta = rope.get("rope_theta", theta)
    return 10000.0 if theta is None else _float(hf, "rope_theta", theta)


def config_from_hf(
    hf_config: Mapping[str, Any], *, dtype=jnp.float32, **overrides: Any
) -> ModelConfig:
    """``ModelConfig`` from a Hugging Face ``config.json`` dict of a Qwen3-MoE or dense Qwen3 model.

    ``decoder_sparse_step`` and ``mlp_only_layers`` become ``mlp_only_layers`` (a block is MoE iff
    it is not listed and ``(i + 1) % decoder_sparse_step == 0``, as in transformers). A dense Qwen3
    (or a Qwen3-MoE with ``num_experts = 0``) becomes a config whose every block is in
    ``mlp_only_layers``; its MoE sizes are then unused placeholders (1 expert, top-1, width 1).

    Args:
      hf_config: the parsed ``config.json``.
      dtype: compute dtype of the returned config (parameters' dtype is chosen when loading).
      **overrides: ``ModelConfig`` fields to set after the mapping, e.g. ``remat=True`` or
        ``router_aux_loss_coef=0.0`` (the checkpoint's value is kept otherwise; the paper's R3 runs
        use 0).
    Raises:
      ValueError: naming the field, for an unsupported ``model_type`` or option (sliding-window
        attention, attention biases, scaled rotary, an activation other than SiLU) or a missing
        required field.
    """
    if not isinstance(hf_config, Mapping):
        raise ValueError(f"config.json must hold a JSON object, got {type(hf_config).__name__}")
    hf = dict(hf_config)
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r} in config.json; sat_jax loads "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"config.json hidden_act={hf['hidden_act']!r} is not supported (silu only)"
        )
    if hf.get("attention_bias", False):
        raise ValueError(
            "config.json attention_bias=true is not supported (projections have no bias)"
        )
    if hf.get("use_sliding_window", False):
        raise ValueError(
            "config.json use_sliding_window=true is not supported (the model has full attention "
            "only)"
        )
    layer_types = hf.get("layer_types") or []
    bad = sorted({t for t in layer_types if t != "full_attention"})
    if bad:
        raise ValueError(f"config.json layer_types {bad} are not supported (full_attention only)")
    rope_theta = _rope_theta(hf)

    num_layers = _int(hf, "num_hidden_layers")
    hidden = _int(hf, "hidden_size")
    heads = _int(hf, "num_attention_heads")
    kv_heads = _int(hf, "num_key_value_heads", required=False) or heads
    # transformers' defaults when head_dim is absent: 128 for Qwen3Config, d / H for Qwen3-MoE.
    default_head_dim = 128 if model_type == "qwen3" else hidden // heads
    head_dim = _int(hf, "head_dim", required=False) or default_head_dim

    num_experts = 0
    if model_type == "qwen3_moe":
        num_experts = _int(hf, "num_experts", alias="num_local_experts")
    if num_experts > 0:
        step = _int(hf, "decoder_sparse_step", required=False) or 1
        listed = hf.get("mlp_only_layers") or []
        if not isinstance(listed, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in listed
        ):
            raise ValueError(
                f"config.json field 'mlp_only_layers' must be a list of layer indices, got "
                f"{listed!r}"
            )
        listed = set(listed)
        mlp_only = tuple(i for i in range(num_layers) if i in listed or (i + 1) % step != 0)
        moe = dict(
            num_experts=num_experts,
            num_experts_per_tok=_int(hf, "num_experts_per_tok"),
            moe_intermediate_size=_int(hf, "moe_intermediate_size"),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            router_aux_loss_coef=_float(hf, "router_aux_loss_coef") or 0.0,
        )
    else:
        mlp_only = tuple(range(num_layers))
        moe = dict(num_experts=1, num_experts_per_tok=1, moe_intermediate_size=1)
    intermediate = _int(hf, "intermediate_size", required=False)
    if mlp_only and not intermediate:
        raise ValueError("config.json lacks 'intermediate_size', needed by the dense blocks")
    fields = dict(
        vocab_size=_int(hf, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        mlp_only_layers=mlp_only,
        intermediate_size=intermediate or ModelConfig.intermediate_size,
        rope_theta=rope_theta,
        rms_norm_eps=_float(hf, "rms_norm_eps") or 1e-6,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        shared_expert_intermediate_size=0,
        dtype=dtype,
        **moe,
    )
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)})
    if unknown:
        raise ValueError(f"overrides {unknown} are not ModelConfig fields")
    fields.update(overrides)
    return ModelConfig(**fields)


def config_to_hf(
    config: ModelConfig,
    *,
    base: Mapping[str, Any] | None = None,
    torch_dtype: str = "float32",
) -> dict[str, Any]:
    """Hugging Face ``config.json`` dict for ``config`` (inverse of ``config_from_hf``).

    ``base`` (e.g. the original checkpoint's config.json) supplies the fields sat_jax does not model
    (token ids, ``max_position_embeddings`` ...); the architecture fields are overwritten. The
    ``model_type`` is ``base``'s when given, else ``qwen3_moe`` if the config has MoE blocks and
    ``qwen3`` if it has none.
    Raises:
      ValueError: when the config has no Qwen3 equivalent (a shared expert, or MoE blocks under
        ``model_type="qwen3"``).
    """
    if config.shared_expert_intermediate_size:
        raise ValueError(
            "config.shared_expert_intermediate_size > 0 has no Qwen3 / Qwen3-MoE equivalent"
        )
    hf = dict(base or {})
    model_type = hf.get("model_type") or ("qwen3_moe" if config.num_moe_layers else "qwen3")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"base model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    if model_type == "qwen3" and config.num_moe_layers:
        raise ValueError("model_type 'qwen3' cannot hold MoE blocks; use 'qwen3_moe'")
    for stale in ("num_local_experts", "rope_scaling", "layer_types", "dtype"):
        hf.pop(stale, None)
    hf.update(
        model_type=model_type,
        architectures=[ARCHITECTURES[model_type]],
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        hidden_act="silu",
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        rope_scaling=None,
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        torch_dtype=torch_dtype,
    )
    if "rope_parameters" in hf:  # transformers-5 layout in base: keep it consistent
        hf["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if model_type == "qwen3":
        hf["max_window_layers"] = config.num_layers
    elif config.num_moe_layers:
        hf.update(
            num_experts=config.num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=config.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=list(config.mlp_only_layers),
            router_aux_loss_coef=config.router_aux_loss_coef,
        )
    else:
        hf.update(num_experts=0, mlp_only_layers=list(range(config.num_layers)))
    return hf
