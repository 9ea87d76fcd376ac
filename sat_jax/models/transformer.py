"""The decoder-only MoE transformer (Qwen3-MoE shape) in Flax NNX, with routing capture and replay.

Layout conventions used by the model, the sampler and ``token_logprobs``:

* ``input_mask`` [B, T] marks real tokens; padding may sit anywhere (the sampler left-pads prompts
  and right-pads finished responses). Rotary positions are ``cumsum(input_mask) − 1`` clipped at 0,
  so a left-padded prompt gets the same positions as an unpadded one.
* Routing arrays are ``[num_moe_layers, B, T, k]`` int32 over the tokens *fed* to the model, in
  block order of ``config.moe_layer_ids``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sat_jax.models import _checks
from sat_jax.models.config import ModelConfig
from sat_jax.models.layers import (
    MLP,
    Attention,
    Dense,
    LayerCache,
    MoE,
    RMSNorm,
    load_balancing_loss,
)


class ForwardOutput(NamedTuple):
    """What one forward pass returns.

    Attributes:
      logits: [B, T − logits_from, V] float32; None with ``return_hidden=True``.
      routing: [num_moe_layers, B, T, k] int32, the expert indices each MoE layer used (the replayed
        ones when ``routing`` was passed).
      load_balancing_loss: scalar float32, Switch loss averaged over MoE layers (fresh top-k), over
        tokens with ``input_mask``; unscaled by ``router_aux_loss_coef``.
      cache: per-layer ``LayerCache`` tuple when a cache was passed, else None.
      hidden: [B, T − logits_from, d] final-RMSNorm'd hidden states in the compute dtype with
        ``return_hidden=True`` (the LM head is then skipped), else None.
    """

    logits: jax.Array | None
    routing: jax.Array
    load_balancing_loss: jax.Array
    cache: tuple[LayerCache, ...] | None
    hidden: jax.Array | None = None


def positions_from_mask(input_mask: jax.Array) -> jax.Array:
    """Rotary positions [B, T] int32: index among real tokens, cumsum(mask) − 1, clipped at 0."""
    return jnp.maximum(jnp.cumsum(input_mask.astype(jnp.int32), axis=-1) - 1, 0)


class Block(nnx.Module):
    """Pre-norm block: x + Attn(RMSNorm(x)), then x + FFN(RMSNorm(x)); FFN is MoE or SwiGLU."""

    def __init__(self, cfg: ModelConfig, *, moe: bool, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if moe:
            self.mlp = MoE(cfg, rngs=rngs)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, std=cfg.init_std, rngs=rngs)
        self.is_moe = moe

    def __call__(self, x, positions, kv_mask, cache, cache_index, replay):
        h, new_cache = self.self_attn(self.input_layernorm(x), positions, kv_mask, cache,
                                      cache_index)
        x = x + h
        hn = self.post_attention_layernorm(x)
        if self.is_moe:
            y, indices, z = self.mlp(hn, replay)
        else:
            y, indices, z = self.mlp(hn), None, None
        return x + y, new_cache, indices, z


class Transformer(nnx.Module):
    """Decoder-only MoE transformer (embed → blocks → RMSNorm → LM head), parameters float32.

    Compute dtype is ``config.dtype``; it lives in the graphdef, so a bfloat16 engine and a float32
    trainer share one parameter ``State`` but use different graphdefs (see ``graphdef_for``).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        cfg = config
        self.config = cfg
        self.embed_tokens = nnx.Param(
            cfg.init_std * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size))
        )
        moe_ids = set(cfg.moe_layer_ids)
        self.layers = nnx.List(
            [Block(cfg, moe=i in moe_ids, rngs=rngs) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = (
            None if cfg.tie_embeddings
            else Dense(cfg.hidden_size, cfg.vocab_size, std=cfg.init_std, rngs=rngs)
        )

    def __call__(
        self,
        tokens: jax.Array,
        *,
        input_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        routing: jax.Array | None = None,
        cache: tuple[LayerCache, ...] | None = None,
        cache_index: jax.Array | int = 0,
        kv_mask: jax.Array | None = None,
        logits_from: int = 0,
        return_hidden: bool = False,
    ) -> ForwardOutput:
        """Forward pass; capture routing always, replay it (R3, Eq. 40) when ``routing`` is given.

        Args:
          tokens: [B, T] int token ids in [0, vocab_size).
          input_mask: [B, T] bool, real tokens (default all). Masked tokens are never attended to.
          positions: [B, T] int rotary positions (default ``positions_from_mask(input_mask)``).
          routing: [num_moe_layers, B, T, k] int expert indices to replay instead of choosing.
          cache: per-layer ``LayerCache`` ([B, S, kv_heads, head_dim]); the call writes its keys and
            values at slots [cache_index, cache_index + T) and attends over all S slots.
          cache_index: first cache slot of this call (a traced scalar is fine).
          kv_mask: [B, S] bool, which cache slots hold real tokens (required with ``cache``; it must
            already mark this call's own slots).
          logits_from: static; compute logits only for positions t ≥ logits_from (saves the LM head
            on prompts).
          return_hidden: static; skip the LM head and return the normed hidden states instead
            (``logits`` None), for log-probs computed chunk by chunk (``chunked_logprobs``).
        Returns:
          ``ForwardOutput``.
        """
        cfg = self.config
        _checks.check_rank("tokens", tokens, 2)
        _checks.check_integer("tokens", tokens)
        b, t = tokens.shape
        if input_mask is None:
            input_mask = jnp.ones((b, t), jnp.bool_)
        _checks.check_shape("input_mask", input_mask, (b, t))
        input_mask = input_mask.astype(jnp.bool_)
        _checks.check_token_ids("tokens", tokens, cfg.vocab_size, where=input_mask)
        if positions is None:
            positions = positions_from_mask(input_mask)
        _checks.check_shape("positions", positions, (b, t))
        k = cfg.num_experts_per_tok
        if routing is not None:
            _checks.check_shape("routing", routing, (cfg.num_moe_layers, b, t, k))
            _checks.check_integer("routing", routing)
            _checks.check_token_ids("routing", routing, cfg.num_experts)
        if cache is None:
            kv_mask = input_mask
        else:
            if len(cache) != cfg.num_layers:
                raise ValueError(f"cache must hold {cfg.num_layers} layers, got {len(cache)}")
            if kv_mask is None:
                raise ValueError("kv_mask is required with cache")
            _checks.check_shape("kv_mask", kv_mask, (b, cache[0].k.shape[1]))
            kv_mask = kv_mask.astype(jnp.bool_)
        if not 0 <= logits_from < t:
            raise ValueError(f"logits_from must lie in [0, {t}), got {logits_from}")

        x = jnp.take(self.embed_tokens[...], tokens, axis=0).astype(cfg.dtype)
        new_cache, used, lb = [], [], []
        moe_i = 0
        for i, block in enumerate(self.layers):
            replay = None
            if block.is_moe and routing is not None:
                replay = routing[moe_i]
            layer_cache = None if cache is None else cache[i]
            if cfg.remat and cache is None:
                x, c, idx, z = nnx.remat(
                    lambda blk, x_, rp: blk(x_, positions, kv_mask, None, 0, rp)
                )(block, x, replay)
            else:
                x, c, idx, z = block(x, positions, kv_mask, layer_cache, cache_index, replay)
            new_cache.append(c)
            if block.is_moe:
                used.append(idx)
                lb.append(load_balancing_loss(z, k, input_mask))
                moe_i += 1
        h = self.norm(x[:, logits_from:])
        if return_hidden:
            logits = None
        elif self.lm_head is None:
            logits = jnp.dot(h, self.embed_tokens[...].astype(h.dtype).T)
        else:
            logits = self.lm_head(h)
        if used:
            routing_out = jnp.stack(used)
            lb_loss = jnp.mean(jnp.stack(lb))
        else:
            routing_out = jnp.zeros((0, b, t, k), jnp.int32)
            lb_loss = jnp.zeros((), jnp.float32)
        return ForwardOutput(
            logits=None if logits is None else logits.astype(jnp.float32),
            routing=routing_out,
            load_balancing_loss=lb_loss,
            cache=None if cache is None else tuple(new_cache),
            hidden=h if return_hidden else None,
        )

    def lm_head_weight(self) -> jax.Array:
        """The output projection W [d, V] float32: logits = h · W (``embed_tokens``ᵀ when tied)."""
        if self.lm_head is None:
            return self.embed_tokens[...].T
        return self.lm_head.kernel[...]


def init_model(config: ModelConfig, seed: int | jax.Array = 0) -> tuple[nnx.GraphDef, nnx.State]:
    """Build the model and split it: ``(graphdef, params)``, params a float32 ``nnx.State``."""
    model = Transformer(config, rngs=nnx.Rngs(params=seed))
    return nnx.split(model, nnx.Param)


def graphdef_for(config: ModelConfig) -> nnx.GraphDef:
    """Graphdef of ``Transformer(config)`` without allocating parameters (abstract init).

    Use it to run one parameter ``State`` under another compute dtype, e.g. a bfloat16 engine:
    ``nnx.merge(graphdef_for(cfg.replace(dtype=jnp.bfloat16)), params)``.
    """
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(params=0)))
    return nnx.graphdef(abstract)


def init_cache(config: ModelConfig, batch: int, length: int, dtype=None) -> tuple[LayerCache, ...]:
    """Zero KV cache: per layer k and v of [batch, length, num_kv_heads, head_dim] in ``dtype``
    (default ``config.dtype``)."""
    dt = config.dtype if dtype is None else dtype
    shape = (batch, length, config.num_kv_heads, config.head_dim)
    return tuple(
        LayerCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(config.num_layers)
    )


def param_count(params: nnx.State) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
