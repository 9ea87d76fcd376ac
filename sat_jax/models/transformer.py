"""The decoder-only MoE transformer (Qwen3-MoE shape) in Flax NNX, with routing capture and replay.

Layout conventions used by the model, the sampler and ``token_logprobs``:

* ``input_mask`` [B, T] marks real tokens; padding may sit anywhere (the sampler left-pads prompts
  and right-pads finished responses). Rotary positions are ``cumsum(input_mask) − 1`` clipped at 0,
  so a left-padded prompt gets the same positions as an unpadded one.
* Routing arrays are ``[num_moe_layers, B, T, k]`` int32 over the tokens *fed* to the model, in
  block order of ``config.moe_layer_ids``.
* Blocks are stacked: the MoE blocks' parameters live in ``moe_layers`` with a leading
  ``[num_moe_layers]`` axis, the dense blocks' (``mlp_only_layers``) in ``dense_layers``
  (``[len(mlp_only_layers)]``). The forward pass walks ``config.layer_runs`` (maximal runs of
  one kind in block order) and ``jax.lax.scan``s each run with one compiled block body, so
  compile time does not grow with depth (a uniform model is one scan). The KV cache is one
  ``LayerCache`` stacked over all blocks in block order.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from sat_jax import _checks
from sat_jax.models import sharding as _sharding
from sat_jax.models.config import ModelConfig
from sat_jax.models.layers import (
    MLP,
    Attention,
    Dense,
    LayerCache,
    MoE,
    RMSNorm,
    load_balancing_loss,
    rotary_tables,
)

_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _top_k_by_argmax(z: jax.Array, k: int) -> jax.Array:
    """Indices [..., k] int32 of the k largest entries of z's last axis, largest first (ties:
    the lower index first, as ``jax.lax.top_k``)."""
    picked = []
    for _ in range(k):
        i = jnp.argmax(z, axis=-1)
        picked.append(i)
        z = jnp.where(jax.nn.one_hot(i, z.shape[-1], dtype=bool), -jnp.inf, z)
    return jnp.stack(picked, axis=-1).astype(jnp.int32)


class ForwardOutput(NamedTuple):
    """What one forward pass returns.

    Attributes:
      logits: [B, T − logits_from, V] float32; None with ``return_hidden=True``.
      routing: [num_moe_layers, B, T, k] int32, the expert indices each MoE layer used (the replayed
        ones when ``routing`` was passed).
      load_balancing_loss: scalar float32, Switch loss averaged over MoE layers (fresh top-k), over
        tokens with ``input_mask``; unscaled by ``router_aux_loss_coef``.
      cache: the stacked ``LayerCache`` ([L, B, S, kv_heads, head_dim]) when a cache was passed,
        else None.
      hidden: with ``return_hidden=True``, the final-RMSNorm'd hidden states
        [B, T − logits_from, d] in the compute dtype (logits = hidden · ``lm_head_weight()``);
        else None.
      router_top_k: [num_moe_layers, B, T, k] int32, the top-k of each MoE layer's own router
        logits, whether or not ``routing`` was replayed (equal to ``routing`` without replay
        and without router noise): what ``moe.routing_flips`` compares with a recorded routing.
    """

    logits: jax.Array | None
    routing: jax.Array
    load_balancing_loss: jax.Array
    cache: LayerCache | None
    hidden: jax.Array | None = None
    router_top_k: jax.Array | None = None


def positions_from_mask(input_mask: jax.Array) -> jax.Array:
    """Rotary positions [B, T] int32: index among real tokens, cumsum(mask) − 1, clipped at 0."""
    return jnp.maximum(jnp.cumsum(input_mask.astype(jnp.int32), axis=-1) - 1, 0)


def _check_shared_prefix(shared_prefix, b: int, t: int) -> tuple[int, int] | None:
    if shared_prefix is None:
        return None
    ok = (
        isinstance(shared_prefix, tuple)
        and len(shared_prefix) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in shared_prefix)
    )
    if not ok:
        raise ValueError(
            f"shared_prefix must be None or a (group_size, prefix_len) tuple of "
            f"Python ints, got {shared_prefix!r}"
        )
    g, p = shared_prefix
    if g < 1 or b % g:
        raise ValueError(
            f"shared_prefix group_size must be a positive divisor of the batch "
            f"(tokens.shape[0] = {b}), got {g}"
        )
    if not 0 <= p <= t:
        raise ValueError(
            f"shared_prefix prefix_len must lie in [0, {t}] (tokens.shape[1]), got {p}"
        )
    return None if g == 1 or p == 0 else (g, p)


def unique_rows(a: jax.Array, shared_prefix: tuple[int, int]) -> jax.Array:
    """[B, T, ...] → [B/G, P + G·(T − P), ...]: per group of G rows, its shared first P positions
    once (those of the group's first row), then the G rows' own remaining positions."""
    g, p = shared_prefix
    b, t = a.shape[:2]
    grouped = a.reshape((b // g, g, t) + a.shape[2:])
    rest = grouped[:, :, p:].reshape((b // g, g * (t - p)) + a.shape[2:])
    return jnp.concatenate([grouped[:, 0, :p], rest], axis=1)


def expand_rows(a: jax.Array, shared_prefix: tuple[int, int], t: int) -> jax.Array:
    """The inverse layout of ``unique_rows``: [B/G, P + G·(T − P), ...] → [B, T, ...], the
    shared positions copied to every row of the group (their cotangents sum back)."""
    g, p = shared_prefix
    n = a.shape[0]
    tail = a.shape[2:]
    prefix = jnp.broadcast_to(a[:, None, :p], (n, g, p) + tail)
    rest = a[:, p:].reshape((n, g, t - p) + tail)
    return jnp.concatenate([prefix, rest], axis=2).reshape((n * g, t) + tail)


class Block(nnx.Module):
    """Pre-norm block: x + Attn(RMSNorm(x)), then x + FFN(RMSNorm(x)); FFN is MoE or SwiGLU."""

    def __init__(self, cfg: ModelConfig, *, moe: bool, rngs: nnx.Rngs):
        pdt = cfg.param_dtype
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=pdt)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=pdt)
        if moe:
            self.mlp = MoE(cfg, rngs=rngs)
        else:
            self.mlp = MLP(
                cfg.hidden_size, cfg.intermediate_size, std=cfg.init_std, rngs=rngs, dtype=pdt
            )
        self.is_moe = moe

    def __call__(
        self, x, rope, kv_mask, cache, cache_index, layer, replay, shared_prefix=None, noise=None
    ):
        # Named scopes label the profile (op_name metadata); they do not change the program.
        with jax.named_scope("attention"):
            h, new_cache = self.self_attn(
                self.input_layernorm(x), rope, kv_mask, cache, cache_index, layer, shared_prefix
            )
        x = x + h
        with jax.named_scope("moe" if self.is_moe else "mlp"):
            hn = self.post_attention_layernorm(x)
            if self.is_moe:
                y, indices, z = self.mlp(hn, replay, noise)
            else:
                y, indices, z = self.mlp(hn), None, None
        return x + y, new_cache, indices, z


def _block_stack(cfg: ModelConfig, *, moe: bool, n: int, rngs: nnx.Rngs) -> Block:
    """``n`` blocks of one kind with their parameters stacked on a leading axis (nnx.vmap)."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(r):
        return Block(cfg, moe=moe, rngs=r)

    return make(rngs)


class Transformer(nnx.Module):
    """Decoder-only MoE transformer (embed → blocks → RMSNorm → LM head).

    Parameters are stored in ``config.param_dtype`` and cast to the compute dtype
    ``config.dtype`` at use; the compute dtype lives in the graphdef, so a bfloat16 engine and a
    float32 trainer share one parameter ``State`` but use different graphdefs (``graphdef_for``).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        cfg = config
        self.config = cfg
        self.embed_tokens = nnx.Param(
            (
                cfg.init_std
                * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32)
            ).astype(cfg.param_dtype)
        )
        n_moe, n_dense = cfg.num_moe_layers, len(cfg.dense_layer_ids)
        self.moe_layers = _block_stack(cfg, moe=True, n=n_moe, rngs=rngs) if n_moe else None
        self.dense_layers = _block_stack(cfg, moe=False, n=n_dense, rngs=rngs) if n_dense else None
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=cfg.param_dtype)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else Dense(
                cfg.hidden_size, cfg.vocab_size, std=cfg.init_std, rngs=rngs, dtype=cfg.param_dtype
            )
        )

    def lm_head_weight(self) -> jax.Array:
        """The [d, V] output projection (``lm_head.kernel``, or ``embed_tokens.T`` when tied), in
        the parameter dtype; logits = hidden · W after casting W to the compute dtype."""
        if self.lm_head is None:
            return self.embed_tokens[...].T
        return self.lm_head.kernel[...]

    def __call__(
        self,
        tokens: jax.Array,
        *,
        input_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
        routing: jax.Array | None = None,
        cache: LayerCache | None = None,
        cache_index: jax.Array | int = 0,
        kv_mask: jax.Array | None = None,
        logits_from: int = 0,
        return_hidden: bool = False,
        shared_prefix: tuple[int, int] | None = None,
        router_noise: tuple[jax.Array, float] | None = None,
    ) -> ForwardOutput:
        """Forward pass; capture routing always, replay it (R3, Eq. 40) when ``routing`` is given.

        Args:
          tokens: [B, T] int token ids in [0, vocab_size).
          input_mask: [B, T] bool, real tokens (default all). Masked tokens are never attended to.
          positions: [B, T] int rotary positions (default ``positions_from_mask(input_mask)``).
          routing: [num_moe_layers, B, T, k] int expert indices to replay instead of choosing.
          cache: stacked ``LayerCache`` ([L, B, S, kv_heads, head_dim], from ``init_cache``); the
            call writes its keys and values at slots [cache_index, cache_index + T) of every
            block's row and attends over all S slots.
          cache_index: first cache slot of this call (a traced scalar is fine).
          kv_mask: [B, S] bool, which cache slots hold real tokens (required with ``cache``; it must
            already mark this call's own slots); query t then sees the marked slots up to its
            own (``cache_index + t``). Or [B, T, S]: the slots each query sees, taken as given
            with no causal rule (its own slot always), for a cache whose slots are not in time
            order (the continuous engine's ring).
          logits_from: static; compute logits only for positions t ≥ logits_from (saves the LM head
            on prompts).
          return_hidden: static; return the final-normed hidden states in ``hidden`` instead of
            logits (``logits`` is None), for a caller that applies ``lm_head_weight()`` itself
            (chunked log-probs).
          shared_prefix: static ``(G, P)`` or None. Promises that the rows come in groups of G
            consecutive rows whose first P positions are identical (tokens, ``input_mask``,
            positions and replayed ``routing``), as the G samples of one prompt in a GRPO batch
            are. The blocks then run on each group's P prefix positions once: the residual
            stream is kept as [B/G, P + G·(T − P), d] (``unique_rows``), every per-token layer
            (norms, projections, router, experts) runs on those rows, and attention lets each
            row's own positions see the group's prefix keys (``layers.Attention``). Outputs
            are expanded back to [B, T]; they are the same function of the parameters, values
            and gradients (to float rounding), for ≈ (P + G·(T − P)) / (G·T) of the per-token
            work. The promise is not checked here (the trainer checks each batch on the host);
            rows that break it get their group's first row's prefix. Not with ``cache``.
          router_noise: None, or ``(key, std)`` with std > 0: every MoE layer that chooses its
            experts (no replay) takes the top-k of its router logits plus Gaussian noise of that
            std, drawn from ``fold_in(key, layer)`` (``MoE``); the gates keep the clean logits.
            A rollout engine's knob for routing mismatch without a change of precision.
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
            routing = routing.astype(jnp.int32)
        if cache is None:
            kv_mask = input_mask
        else:
            if not isinstance(cache, LayerCache) or cache.k.ndim != 5:
                raise ValueError(
                    "cache must be the stacked LayerCache of init_cache "
                    "([L, B, S, kv_heads, head_dim] arrays)"
                )
            _checks.check_shape(
                "cache.k", cache.k, (cfg.num_layers, b, None, cfg.num_kv_heads, cfg.head_dim)
            )
            _checks.check_shape("cache.v", cache.v, cache.k.shape)
            if kv_mask is None:
                raise ValueError("kv_mask is required with cache")
            slots = cache.k.shape[2]
            if jnp.ndim(kv_mask) == 3:  # each query's own visibility (a ring cache)
                _checks.check_shape("kv_mask", kv_mask, (b, t, slots))
            else:
                _checks.check_shape("kv_mask", kv_mask, (b, slots))
            kv_mask = kv_mask.astype(jnp.bool_)
        if not 0 <= logits_from < t:
            raise ValueError(f"logits_from must lie in [0, {t}), got {logits_from}")
        shared_prefix = _check_shared_prefix(shared_prefix, b, t)
        if shared_prefix is not None and cache is not None:
            raise ValueError("shared_prefix is for training passes, not with cache")

        act = ("batch", None, None)
        token_weight = input_mask
        if shared_prefix is not None:
            # The shared-prefix layout (``unique_rows``); the load-balancing loss weighs each
            # prefix position by G, as the G rows it stands for.
            tokens, positions, kv_mask, input_mask = (
                unique_rows(a, shared_prefix) for a in (tokens, positions, kv_mask, input_mask)
            )
            g, p = shared_prefix
            prefix_weight = jnp.where(jnp.arange(input_mask.shape[1]) < p, g, 1)
            token_weight = input_mask * prefix_weight[None]
            if routing is not None:  # [L, B, T, k] → [L, B/G, P + G(T − P), k]
                routing = jnp.moveaxis(
                    unique_rows(jnp.moveaxis(routing, 0, 2), shared_prefix), 2, 0
                )
        # FSDP: gather the table (a parameter-sized all-gather) and look up locally; left to
        # itself GSPMD would instead move token-sized activations and ids to the table's layout.
        table = _sharding.constrain(self.embed_tokens[...], ("vocab", None))
        x = _sharding.constrain(jnp.take(table, tokens, axis=0).astype(cfg.dtype), act)
        rope = rotary_tables(positions, cfg.head_dim, cfg.rope_theta)  # one for every block
        used, lb, top = [], [], []
        for moe, start, stop in cfg.layer_runs:
            ids = (cfg.moe_layer_ids if moe else cfg.dense_layer_ids)[start:stop]
            replay = None if (routing is None or not moe) else routing[start:stop]
            x, cache, idx, lbl, fresh = self._scan_run(
                self.moe_layers if moe else self.dense_layers,
                start,
                stop,
                ids,
                x,
                rope,
                kv_mask,
                cache,
                cache_index,
                replay,
                token_weight,
                shared_prefix,
                router_noise,
            )
            if moe:
                if shared_prefix is not None:  # [n, B/G, P + G(T − P), k] → [n, B, T, k]
                    idx, fresh = (
                        jnp.moveaxis(expand_rows(jnp.moveaxis(a, 0, 2), shared_prefix, t), 2, 0)
                        for a in (idx, fresh)
                    )
                used.append(idx)
                lb.append(lbl)
                top.append(fresh)
        if shared_prefix is not None:
            x = expand_rows(x, shared_prefix, t)
        h = _sharding.constrain(self.norm(x[:, logits_from:]), act)
        if return_hidden:
            logits, hidden = None, h
        else:
            w = _sharding.constrain(self.lm_head_weight(), (None, "vocab"))
            logits = jnp.dot(h, w.astype(h.dtype)).astype(jnp.float32)
            hidden = None
        if used:
            routing_out = jnp.concatenate(used, axis=0)
            top_k = jnp.concatenate(top, axis=0)
            lb_loss = jnp.mean(jnp.concatenate(lb, axis=0))
        else:
            routing_out = top_k = jnp.zeros((0, b, t, k), jnp.int32)
            lb_loss = jnp.zeros((), jnp.float32)
        return ForwardOutput(
            logits=logits,
            routing=routing_out,
            load_balancing_loss=lb_loss,
            cache=cache,
            hidden=hidden,
            router_top_k=top_k,
        )

    def _scan_run(
        self,
        stack,
        start,
        stop,
        ids,
        x,
        rope,
        kv_mask,
        cache,
        cache_index,
        replay,
        token_weight,
        shared_prefix,
        router_noise=None,
    ):
        """Blocks ``start:stop`` of ``stack`` (global indices ``ids``) as one ``lax.scan``."""
        cfg = self.config
        graphdef, state = nnx.split(stack)
        n = jax.tree.leaves(state)[0].shape[0]
        if (start, stop) != (0, n):
            state = jax.tree.map(lambda a: a[start:stop], state)
        k = cfg.num_experts_per_tok

        def body(carry, xs):
            x, c = carry
            layer_state, layer, rp = xs
            block = nnx.merge(graphdef, layer_state)
            noise = None
            if router_noise is not None:
                noise = (jax.random.fold_in(router_noise[0], layer), router_noise[1])
            x, c, idx, z = block(x, rope, kv_mask, c, cache_index, layer, rp, shared_prefix, noise)
            x = _sharding.constrain(x, ("batch", None, None))
            lbl = None if z is None else load_balancing_loss(z, k, token_weight)
            # The trainer's own top-k (for the routing flip rate) as k rounds of argmax: the same
            # set as lax.top_k, but reductions GSPMD keeps shard-local (its top_k gathers z).
            fresh = None if z is None else _top_k_by_argmax(z, k)
            return (x, c), (idx, lbl, fresh)

        if cache is None and cfg.remat != "none":
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
        layers = jnp.asarray(ids, jnp.int32)
        (x, cache), (idx, lbl, fresh) = jax.lax.scan(
            body, (x, cache), (state, layers, replay), unroll=min(cfg.scan_unroll, stop - start)
        )
        return x, cache, idx, lbl, fresh


def abstract_params(config: ModelConfig) -> nnx.State:
    """Parameter shapes and dtypes (``jax.ShapeDtypeStruct`` leaves) of ``Transformer(config)``,
    nothing allocated."""
    return nnx.state(
        nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(params=0))), nnx.Param
    )


def param_shardings(config: ModelConfig, mesh: jax.sharding.Mesh) -> nnx.State:
    """``NamedSharding`` of every parameter on ``mesh`` (tree shaped like the parameters), from
    ``sat_jax.models.sharding.LOGICAL_AXIS_RULES``.

    Raises:
      ValueError: the mesh does not divide a split dimension (``check_mesh``).
    """
    _sharding.check_mesh(config, mesh)
    specs = _sharding.sharding_rules(abstract_params(config), mesh=mesh)
    return _sharding.named_shardings(specs, mesh)


def _init_state(config: ModelConfig, seed) -> nnx.State:
    return nnx.state(Transformer(config, rngs=nnx.Rngs(params=seed)), nnx.Param)


def init_model(
    config: ModelConfig, seed: int | jax.Array = 0, mesh: jax.sharding.Mesh | None = None
) -> tuple[nnx.GraphDef, nnx.State]:
    """Build the model's parameters: ``(graphdef, params)``, params an ``nnx.State`` in
    ``config.param_dtype``.

    The initialiser is one jitted program; with ``mesh`` its outputs are placed with
    ``param_shardings(config, mesh)``, so every device materialises only its own shards and no
    full-size parameter ever exists on one device or on the host. The values do not depend on
    the mesh.
    """
    shardings = None if mesh is None else param_shardings(config, mesh)
    key = seed
    if not (isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key)):
        key = jax.random.key(seed)
    init = jax.jit(_init_state, static_argnums=0, out_shardings=shardings)
    return graphdef_for(config), init(config, key)


def graphdef_for(config: ModelConfig) -> nnx.GraphDef:
    """Graphdef of ``Transformer(config)`` without allocating parameters (abstract init).

    Use it to run one parameter ``State`` under another compute dtype, e.g. a bfloat16 engine:
    ``nnx.merge(graphdef_for(cfg.replace(dtype=jnp.bfloat16)), params)``.
    """
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(params=0)))
    return nnx.graphdef(abstract)


def init_cache(
    config: ModelConfig, batch: int, length: int, dtype=None, mesh: jax.sharding.Mesh | None = None
) -> LayerCache:
    """Zero KV cache, stacked over blocks: k and v of
    [num_layers, batch, length, num_kv_heads, head_dim] in ``dtype`` (default ``config.dtype``).

    With ``mesh`` it is created sharded (``sharding.cache_spec``: batch over (data, fsdp), KV
    heads over tensor); ``batch`` and ``num_kv_heads`` must then divide those axes.
    """
    dt = config.dtype if dtype is None else dtype
    shape = (config.num_layers, batch, length, config.num_kv_heads, config.head_dim)
    if mesh is None:
        return LayerCache(jnp.zeros(shape, dt), jnp.zeros(shape, dt))
    _sharding.check_mesh(config, mesh, batch=batch)
    sharding = NamedSharding(mesh, _sharding.cache_spec(mesh))
    zeros = jax.jit(lambda: jnp.zeros(shape, dt), out_shardings=sharding)
    return LayerCache(zeros(), zeros())


def param_count(params: nnx.State) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
