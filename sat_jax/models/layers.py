"""Building blocks of the MoE decoder: RMSNorm, rotary embeddings, GQA attention with q/k norm and a
KV cache, the top-k softmax router with capture and replay (R3, Eq. 40), and the MoE feed-forward.

Parameters are stored in ``config.param_dtype`` (float32 by default, the master copy); every block
casts them to the compute dtype at use, so one parameter tree serves a float32 trainer and a
bfloat16 sampler (the paper's engine mismatch, Section 4.4).
Norms, softmaxes and rotary angles are computed in float32 whatever the compute dtype, as in
Hugging Face's Qwen3-MoE.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sat_jax.models.attention import attend
from sat_jax.models.config import ModelConfig
from sat_jax.models.moe import expert_ffn, noisy_logits
from sat_jax.models.sharding import BATCH_AXES


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype=jnp.float32) -> nnx.Param:
    # Drawn in float32 whatever the storage dtype, so a bf16 copy rounds the same draw.
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


class Dense(nnx.Module):
    """y = x · W (no bias, as every projection of Qwen3-MoE). ``kernel`` is [in, out]."""

    def __init__(self, din: int, dout: int, *, std: float, rngs: nnx.Rngs, dtype=jnp.float32):
        self.kernel = _normal(rngs, (din, dout), std, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.dot(x, self.kernel[...].astype(x.dtype))


class RMSNorm(nnx.Module):
    """RMSNorm (Zhang & Sennrich 2019): y = x / sqrt(mean(x²) + eps) · w, statistics in float32."""

    def __init__(self, dim: int, *, eps: float, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        w = self.weight[...].astype(jnp.float32).reshape((1,) * (y.ndim - 1) + (-1,))
        return (y * w).astype(x.dtype)


def rotary_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos(pω) and sin(pω) [B, T, D/2] float32 for rotary positions p [B, T] and ω_i = θ^(−2i/D).

    The model computes them once per forward pass for all heads and blocks (``apply_rotary``).
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq[None, None, :]  # [B, T, D/2]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``rotary`` from precomputed ``rotary_tables``: x [B, T, heads, D], cos/sin [B, T, D/2]."""
    d = x.shape[-1]
    cos = cos[:, :, None, None, :]  # [B, T, 1, 1, D/2]
    sin = sin[:, :, None, None, :]
    # Halves on an axis of 2, [x₁, x₂], and their swap [x₂, x₁] (a reverse, which fuses): the
    # rotation is then one elementwise pass, x·cos + swap(x)·(∓sin), with no slices or concat
    # (whose transposes, pads and adds, cost XLA:CPU separate passes in the backward).
    x32 = x.astype(jnp.float32).reshape(x.shape[:-1] + (2, d // 2))
    signed_sin = sin * jnp.array([-1.0, 1.0], jnp.float32).reshape(1, 1, 1, 2, 1)
    out = x32 * cos + x32[..., ::-1, :] * signed_sin
    return out.reshape(x.shape).astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (Su et al. 2021), Hugging Face "rotate-half" layout.

    For head width D and frequencies ω_i = θ^(−2i/D), i < D/2, with x = [x₁, x₂] split in halves:
    rope(x, p) = [x₁·cos(pω) − x₂·sin(pω), x₂·cos(pω) + x₁·sin(pω)]. Then
    rope(q, m)·rope(k, n) depends on m − n only.

    Args:
      x: [B, T, heads, D].
      positions: [B, T] integer positions.
      theta: rotary base.
    """
    return apply_rotary(x, *rotary_tables(positions, x.shape[-1], theta))


class LayerCache(NamedTuple):
    """Keys and values of every attention layer, stacked: [L, B, S, kv_heads, head_dim] each
    (axis 0 = block index, slot = index on axis 2). ``init_cache`` builds one."""

    k: jax.Array
    v: jax.Array


class Attention(nnx.Module):
    """Grouped-query attention with per-head RMSNorm on q and k (Qwen3) and rotary embeddings.

    Slots: query t of a call sits at slot ``cache_index + t``; key slot j is visible to it when
    j ≤ slot and ``kv_mask[b, j]``, or j is the query's own slot (so a padding query never has an
    empty row); a [B, T, S] ``kv_mask`` gives each query's visible slots directly. Without a
    cache, the keys are the call's own tokens and ``cache_index`` is 0.

    ``rope`` is the (cos, sin) pair of ``rotary_tables`` for the call's positions.
    ``shared_prefix`` = (G, P): x is in ``Transformer``'s shared-prefix layout (no cache), and
    each query attends to the keys it would see in the plain layout
    (``_shared_prefix_attention``).
    ``config.attention_chunk`` > 0 takes the queries that many at a time
    (``sat_jax.models.attention.attend``: same values, scratch linear in t).

    The cache is the stacked one of all blocks ([L, B, S, kv_heads, head_dim]); this block
    writes its new keys and values into row ``layer`` in place (one dynamic-update-slice of the
    call's T slots, not a copy of the layer) and attends over that row.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, hk, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pdt = cfg.param_dtype
        self.q_proj = Dense(d, h * hd, std=cfg.init_std, rngs=rngs, dtype=pdt)
        self.k_proj = Dense(d, hk * hd, std=cfg.init_std, rngs=rngs, dtype=pdt)
        self.v_proj = Dense(d, hk * hd, std=cfg.init_std, rngs=rngs, dtype=pdt)
        self.o_proj = Dense(h * hd, d, std=cfg.init_std, rngs=rngs, dtype=pdt)
        self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=pdt)
        self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, dtype=pdt)
        self.num_heads, self.num_kv_heads, self.head_dim = h, hk, hd
        self.chunk = cfg.attention_chunk

    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        kv_mask: jax.Array,
        cache: LayerCache | None,
        cache_index: jax.Array | int,
        layer: jax.Array | int = 0,
        shared_prefix: tuple[int, int] | None = None,
    ) -> tuple[jax.Array, LayerCache | None]:
        b, t, _ = x.shape
        hk, g, hd = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        q = self.q_norm(self.q_proj(x).reshape(b, t, hk * g, hd))
        k = self.k_norm(self.k_proj(x).reshape(b, t, hk, hd))
        v = self.v_proj(x).reshape(b, t, hk, hd)
        q = apply_rotary(q, *rope).reshape(b, t, hk, g, hd)
        k = apply_rotary(k, *rope)
        if shared_prefix is not None:
            out = _shared_prefix_attention(q, k, v, kv_mask, shared_prefix, self.chunk)
            return self.o_proj(out.reshape(b, t, hk * g * hd)), None
        if cache is not None:
            zero = jnp.zeros((), jnp.int32)
            start = (
                jnp.asarray(layer, jnp.int32),
                zero,
                jnp.asarray(cache_index, jnp.int32),
                zero,
                zero,
            )
            k_full = jax.lax.dynamic_update_slice(cache.k, k[None].astype(cache.k.dtype), start)
            v_full = jax.lax.dynamic_update_slice(cache.v, v[None].astype(cache.v.dtype), start)
            new_cache = LayerCache(k_full, v_full)
            k_all = jax.lax.dynamic_index_in_dim(k_full, layer, 0, keepdims=False)
            v_all = jax.lax.dynamic_index_in_dim(v_full, layer, 0, keepdims=False)
            k_all, v_all = k_all.astype(x.dtype), v_all.astype(x.dtype)
        else:
            k_all, v_all, new_cache = k, v, None
        allowed = _causal_allowed(t, k_all.shape[1], kv_mask, cache_index)
        out = attend(q, k_all, v_all, allowed, chunk=self.chunk)
        return self.o_proj(out.reshape(b, t, hk * g * hd)), new_cache


def _causal_allowed(t: int, s: int, kv_mask: jax.Array, offset=0) -> jax.Array:
    """[B, t, s] bool: query i (slot offset + i) sees key slot j ≤ its slot with kv_mask [B, s],
    and always its own slot (so a padding query never has an empty row). A kv_mask [B, t, s] is
    each query's visibility as given (slots not in time order): only its own slot is added."""
    q_slot = offset + jnp.arange(t)[:, None]  # [t, 1]
    k_slot = jnp.arange(s)[None, :]  # [1, s]
    own = (k_slot == q_slot)[None]
    if kv_mask.ndim == 3:
        return kv_mask | own
    return ((k_slot <= q_slot)[None] & kv_mask[:, None, :]) | own


def _shared_prefix_attention(q, k, v, kv_mask, shared_prefix, chunk=0):
    """Causal attention over the shared-prefix layout of ``Transformer`` (``unique_rows``): per
    group, its P prefix positions, then G rows of R = (t − P)/G own positions each.

    The prefix queries attend causally among the prefix (once per group). Row r's own queries
    attend to the group's prefix keys (under kv_mask) and causally to row r's own keys: the keys
    each query sees in the plain [B, T] layout, in the same slot order, so scores and softmax
    are the plain path's. Shapes: q [n, t, kv, g, D], k/v [n, t, kv, D], kv_mask [n, t].
    """
    grp, p = shared_prefix
    n, t = q.shape[:2]
    r = (t - p) // grp
    out_prefix = attend(
        q[:, :p], k[:, :p], v[:, :p], _causal_allowed(p, p, kv_mask[:, :p]), chunk=chunk
    )

    def rows(a):  # [n, t, ...] → the G rows' own positions [n·G, R, ...]
        return a[:, p:].reshape((n * grp, r) + a.shape[2:])

    def with_prefix(a):  # [n·G, P + R, ...]: the group's prefix, then the row's own positions
        prefix = jnp.broadcast_to(a[:, None, :p], (n, grp, p) + a.shape[2:])
        return jnp.concatenate([prefix.reshape((n * grp, p) + a.shape[2:]), rows(a)], axis=1)

    own = _causal_allowed(r, r, rows(kv_mask))
    prefix_mask = jnp.broadcast_to(kv_mask[:, None, None, :p], (n, grp, r, p)).reshape(
        n * grp, r, p
    )
    out_rows = attend(
        rows(q),
        with_prefix(k),
        with_prefix(v),
        jnp.concatenate([prefix_mask, own], axis=2),
        chunk=chunk,
    )
    return jnp.concatenate([out_prefix, out_rows.reshape((n, grp * r) + q.shape[2:])], axis=1)


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) · up(x))."""

    def __init__(self, d: int, f: int, *, std: float, rngs: nnx.Rngs, dtype=jnp.float32):
        self.gate_proj = Dense(d, f, std=std, rngs=rngs, dtype=dtype)
        self.up_proj = Dense(d, f, std=std, rngs=rngs, dtype=dtype)
        self.down_proj = Dense(f, d, std=std, rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def select_experts(router_logits: jax.Array, k: int) -> jax.Array:
    """Fresh routing decision: indices of the k largest router logits, int32 [..., k]."""
    return jax.lax.top_k(router_logits, k)[1].astype(jnp.int32)


def routing_gates(
    router_logits: jax.Array, indices: jax.Array, *, norm_topk_prob: bool
) -> jax.Array:
    """Gate weights [..., E] of the experts in ``indices`` from the current router logits z.

    With ``norm_topk_prob`` (Qwen3-MoE default) this is the replayed gate of Eq. 40:
        g_e = 1[e ∈ I] · exp(z_e) / Σ_{e' ∈ I} exp(z_e'),
    i.e. the softmax of z restricted to the set I. Without it, Qwen3 uses the full softmax
    probabilities at the chosen experts, g_e = 1[e ∈ I] · exp(z_e) / Σ_{e'} exp(z_e') (weights do
    not sum to 1), and replay keeps that: only the set I is replayed. Either way the gates are
    differentiable functions of the current z, so the router still receives gradients; with
    ``norm_topk_prob`` and k = 1 the gate is identically 1 and it does not.

    The same function serves fresh routing (I = top-k of z) and replay (I recorded at rollout), so
    replaying the indices a fresh pass chose reproduces its gates bit for bit.

    Args:
      router_logits: z, [..., E], any float dtype (computed in float32).
      indices: I, int [..., k].
      norm_topk_prob: renormalise over I (Eq. 40) or keep full-softmax weights.
    """
    z = router_logits.astype(jnp.float32)
    chosen = jnp.sum(jax.nn.one_hot(indices, z.shape[-1], dtype=jnp.bool_), axis=-2) > 0
    if norm_topk_prob:
        return jax.nn.softmax(jnp.where(chosen, z, -jnp.inf), axis=-1)
    return jnp.where(chosen, jax.nn.softmax(z, axis=-1), 0.0)


def load_balancing_loss(router_logits: jax.Array, k: int, token_mask: jax.Array) -> jax.Array:
    """Switch-Transformer load-balancing loss (Fedus et al. 2021) of one layer, fresh top-k.

    L = E · Σ_e f_e · P_e with f_e = share of (masked) token-slots whose fresh top-k holds e
    (Σ_e f_e = 1) and P_e = mean router probability of e over masked tokens. Uses the fresh top-k
    of the current logits even under replay (SPEC, R3).

    Args:
      router_logits: [B, T, E].
      k: experts per token.
      token_mask: [B, T] bool, tokens that count (or float weights: how many tokens each
        position stands for, as in the shared-prefix layout).
    """
    e = router_logits.shape[-1]
    z = router_logits.astype(jnp.float32)
    w = token_mask.astype(jnp.float32)[..., None]
    denom = jnp.maximum(jnp.sum(w), 1.0)
    fresh = jnp.sum(jax.nn.one_hot(select_experts(z, k), e, dtype=jnp.float32), axis=-2)
    f = jnp.sum(fresh * w, axis=(0, 1)) / (denom * k)
    p = jnp.sum(jax.nn.softmax(z, axis=-1) * w, axis=(0, 1)) / denom
    return e * jnp.sum(f * p)


class MoE(nnx.Module):
    """Mixture-of-experts SwiGLU feed-forward with a top-k softmax router (Qwen3-MoE).

    y = Σ_e g_e · Expert_e(x) (+ σ(w_s·x) · Shared(x) when a shared expert is configured), with g
    from ``routing_gates``. The router picks I (or replays it) and the gates g_I; the expert
    computation is ``sat_jax.models.moe.expert_ffn(x, I, g_I, ...)`` with ``impl = config.moe_impl``
    (dense reference or a dropless dispatching path), so every implementation sees identical
    routing and gates. Under a mesh with an ``expert`` axis of size > 1 (the trainer step traces
    with ``jax.sharding.use_abstract_mesh``), experts are computed where they live.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f, e, std = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.init_std
        pdt = cfg.param_dtype
        self.gate = Dense(d, e, std=std, rngs=rngs, dtype=pdt)  # the router, as in Hugging Face
        self.gate_proj = _normal(rngs, (e, d, f), std, pdt)
        self.up_proj = _normal(rngs, (e, d, f), std, pdt)
        self.down_proj = _normal(rngs, (e, f, d), std, pdt)
        if cfg.shared_expert_intermediate_size > 0:
            self.shared_expert = MLP(
                d, cfg.shared_expert_intermediate_size, std=std, rngs=rngs, dtype=pdt
            )
            self.shared_expert_gate = Dense(d, 1, std=std, rngs=rngs, dtype=pdt)
        else:
            self.shared_expert = None
            self.shared_expert_gate = None
        self.k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.impl = cfg.moe_impl

    def __call__(
        self, x: jax.Array, replay: jax.Array | None, noise: tuple | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Returns (output [B, T, d], indices used [B, T, k] int32, router logits [B, T, E] f32).

        ``noise``: None, or ``(key, std)``: a fresh choice takes the top-k of z + std·N(0, 1)
        (``moe.noisy_logits``) while the gates stay those of the clean z on the chosen set, so
        the noise changes which experts run and nothing else (a rollout engine's routing
        mismatch at unchanged precision). Ignored under replay.
        """
        dt = x.dtype
        # Router logits in the compute dtype, then float32: a bfloat16 engine routes on bf16 logits.
        with jax.named_scope("router"):
            z = self.gate(x).astype(jnp.float32)
            if replay is not None:
                indices = replay.astype(jnp.int32)
            elif noise is not None:
                indices = select_experts(noisy_logits(z, *noise), self.k)
            else:
                indices = select_experts(z, self.k)
            gates = routing_gates(z, indices, norm_topk_prob=self.norm_topk_prob)
            weights = jnp.take_along_axis(gates, indices, axis=-1)  # [B, T, k] float32
        b, t, d = x.shape
        n = b * t
        # Under the trainer's traced mesh, each device dispatches its own rows (batch axes) and
        # computes only its own experts (expert axis); plain calls (the sampler) run locally.
        mesh = jax.sharding.get_abstract_mesh()
        y = expert_ffn(
            x.reshape(n, d),
            indices.reshape(n, self.k),
            weights.reshape(n, self.k),
            self.gate_proj[...].astype(dt),
            self.up_proj[...].astype(dt),
            self.down_proj[...].astype(dt),
            impl=self.impl,
            mesh=None if mesh.empty else mesh,
            token_axes=BATCH_AXES,
        ).reshape(b, t, d)
        if self.shared_expert is not None:
            y = y + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y, indices, z
