"""Model configuration: a frozen, hashable dataclass shaped like Hugging Face's Qwen3-MoE config.

Field names follow ``transformers.Qwen3MoeConfig`` where one exists (``hidden_size``,
``num_experts_per_tok``, ``norm_topk_prob`` ...) so that a later weight loader can map a real
checkpoint's ``config.json`` onto it field by field. The dataclass is hashable because it is stored
on the NNX modules and therefore becomes part of the (static) graphdef.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes and options of the decoder-only MoE transformer.

    Attributes:
      vocab_size: number of token ids; ids must lie in ``[0, vocab_size)``.
      hidden_size: model width d.
      num_layers: decoder blocks.
      num_heads: query heads H.
      num_kv_heads: key/value heads (grouped-query attention); must divide ``num_heads``.
      head_dim: per-head width (even, for rotary embeddings).
      num_experts: routed experts E per MoE layer.
      num_experts_per_tok: k, experts chosen per token (top-k of the router logits).
      moe_intermediate_size: hidden width of each routed expert's SwiGLU.
      norm_topk_prob: renormalise the top-k gate weights to sum to 1 (Qwen3-MoE default True).
      shared_expert_intermediate_size: width of an always-on dense SwiGLU added to the MoE output
        with a sigmoid gate (Qwen2-MoE style); 0 disables it (Qwen3-MoE has none).
      mlp_only_layers: indices of blocks that use a dense SwiGLU instead of an MoE layer (as in
        Qwen3-MoE's ``mlp_only_layers``); routing arrays only cover the MoE blocks.
      intermediate_size: width of the dense SwiGLU in ``mlp_only_layers`` blocks.
      rope_theta: rotary base.
      rms_norm_eps: epsilon of every RMSNorm.
      tie_embeddings: use the embedding matrix as the output projection.
      router_aux_loss_coef: coefficient of the Switch load-balancing loss (default 0, as in the
        paper's R3 runs); ``token_logprobs`` reports ``coef * loss`` as ``aux["aux_loss"]``.
      dtype: compute dtype (activations and matmul inputs). Parameters are always float32.
      remat: wrap each block in ``nnx.remat`` (``jax.checkpoint``) so long sequences fit in
        training.
      init_std: standard deviation of the normal initialiser of embeddings and projections.
    """

    vocab_size: int = 128
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    num_experts: int = 32
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 32
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    router_aux_loss_coef: float = 0.0
    dtype: Any = jnp.float32
    remat: bool = False
    init_std: float = 0.02

    def __post_init__(self):
        # Normalise to a numpy dtype so that jnp.float32 and "float32" compare (and hash) equal.
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        positive = (
            "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_kv_heads={self.num_kv_heads} must divide "
                f"num_heads={self.num_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for rotary, got {self.head_dim}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"num_experts={self.num_experts}"
            )
        if any(not 0 <= i < self.num_layers for i in self.mlp_only_layers):
            raise ValueError(
                f"ModelConfig.mlp_only_layers={self.mlp_only_layers} must index blocks in "
                f"[0, {self.num_layers})"
            )
        if self.dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                              jnp.dtype(jnp.float16)):
            raise ValueError(f"ModelConfig.dtype must be a float dtype, got {self.dtype}")

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Block indices that hold an MoE layer, in order (axis 0 of routing arrays)."""
        return tuple(i for i in range(self.num_layers) if i not in self.mlp_only_layers)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """≈1.8M parameters, vocab 128: the CPU preset for tests and small-scale studies.

        Many small experts (32, top-4) rather than a few wide ones: near-ties between the k-th and
        (k+1)-th router logit are then common enough that a bfloat16 engine flips routing on a
        few percent of token-layers, so routing mismatch (and R3) is measurable at this scale.
        """
        return cls(**overrides)
