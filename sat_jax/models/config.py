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

from sat_jax.models.moe import IMPLS as MOE_PATHS

#: Accepted ``ModelConfig.remat`` policies (see ``sat_jax.models.transformer``).
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
#: Accepted ``ModelConfig.moe_impl`` values (``sat_jax.models.moe``).
MOE_IMPLS = MOE_PATHS


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
      dtype: compute dtype (activations and matmul inputs); parameters are cast to it at use.
      param_dtype: dtype of the master parameters (and so of gradients and, with optax's Adam,
        of the optimizer moments); float32 by default, as mixed-precision training keeps them.
      remat: rematerialisation policy of the scanned block body in training (no cache):
        ``"none"``, ``"full"`` (save nothing, recompute the block), ``"dots_saveable"`` (keep
        matmul outputs) or ``"dots_with_no_batch_dims_saveable"``; ``True`` / ``False`` are
        accepted as ``"full"`` / ``"none"``.
      scan_unroll: blocks per iteration of the ``lax.scan`` over a run of stacked blocks (as
        ``lax.scan``'s ``unroll``; clipped to the run's length). 1 compiles one block body; k
        compiles k copies (compile time grows with k, not with depth) and removes the loop's
        per-iteration costs: on XLA:CPU the stacked residuals of the backward pass (zero-filled,
        dynamically updated and sliced per layer). A 2-block model with ``scan_unroll=2`` runs
        straight-line code (``benchmarks/logprobs.py`` compares the two).
      moe_impl: the routed experts' computation (``sat_jax.models.moe.expert_ffn``'s ``impl``):
        ``"dense"`` (the reference: every expert for every token), ``"ragged"`` (dropless
        dispatch with ``jax.lax.ragged_dot``, for TPU/GPU), ``"blocked"`` (dropless dispatch in
        expert-pure blocks, the fast path on CPU) or ``"auto"`` (the fastest on the backend).
      attention_chunk: queries per chunk of the attention (``sat_jax.models.attention``): 0
        takes all of a call's queries at once; c > 0 scans over chunks of c, so at most
        [B, heads, c, keys] float32 scores are live at once instead of [B, heads, t, keys]
        (a 4,096-token sequence's are 64 MiB per head). Equal values either way.
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
    param_dtype: Any = jnp.float32
    remat: str | bool = "none"
    init_std: float = 0.02
    moe_impl: str = "auto"
    scan_unroll: int = 1
    attention_chunk: int = 0

    def __post_init__(self):
        # Normalise to a numpy dtype so that jnp.float32 and "float32" compare (and hash) equal.
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))
        remat = self.remat
        if isinstance(remat, bool):  # the old boolean option
            remat = "full" if remat else "none"
        if remat not in REMAT_POLICIES:
            raise ValueError(
                f"ModelConfig.remat must be one of {REMAT_POLICIES} or a bool, got {self.remat!r}"
            )
        object.__setattr__(self, "remat", remat)
        if (
            isinstance(self.scan_unroll, bool)
            or not isinstance(self.scan_unroll, int)
            or self.scan_unroll < 1
        ):
            raise ValueError(
                f"ModelConfig.scan_unroll must be a positive int, got {self.scan_unroll!r}"
            )
        if (
            isinstance(self.attention_chunk, bool)
            or not isinstance(self.attention_chunk, int)
            or self.attention_chunk < 0
        ):
            raise ValueError(
                f"ModelConfig.attention_chunk must be a non-negative int, "
                f"got {self.attention_chunk!r}"
            )
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(
                f"ModelConfig.moe_impl must be one of {MOE_IMPLS}, got {self.moe_impl!r}"
            )
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        positive = (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
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
        floats = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in floats:
                raise ValueError(
                    f"ModelConfig.{name} must be a float dtype, got {getattr(self, name)}"
                )

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Block indices that hold an MoE layer, in order (axis 0 of routing arrays)."""
        return tuple(i for i in range(self.num_layers) if i not in self.mlp_only_layers)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def dense_layer_ids(self) -> tuple[int, ...]:
        """Block indices that hold a dense SwiGLU (``mlp_only_layers``, sorted)."""
        return tuple(i for i in range(self.num_layers) if i in self.mlp_only_layers)

    @property
    def layer_runs(self) -> tuple[tuple[bool, int, int], ...]:
        """Maximal runs of consecutive blocks of one kind: ``(is_moe, start, stop)`` where
        ``start:stop`` indexes that kind's stack (``moe_layer_ids`` or ``dense_layer_ids``).
        The forward pass scans each run with one compiled block body."""
        runs: list[list] = []
        counts = {True: 0, False: 0}
        for i in range(self.num_layers):
            moe = i not in self.mlp_only_layers
            if runs and runs[-1][0] == moe:
                runs[-1][2] += 1
            else:
                runs.append([moe, counts[moe], counts[moe] + 1])
            counts[moe] += 1
        return tuple((m, a, b) for m, a, b in runs)

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
