"""Masked grouped-query attention whose backward keeps O(t) statistics instead of [t, s] weights.

For each query i of a head, with scale σ = 1/√D and the visible keys of ``allowed``,

    s_ij = σ · q_i·k_j  (j visible; a large negative number otherwise),   ℓ_i = log Σ_j exp s_ij,
    p_ij = exp(s_ij − ℓ_i),   o_i = Σ_j p_ij v_j.

Autodiff of that program stores the weights p [B, H, t, s] of every layer for the backward pass,
and a sequence of 4,096 tokens makes them 64 MiB per head and sequence. ``attend`` is a custom
VJP that stores only q, k, v, o and ℓ (the statistics of FlashAttention, Dao et al. 2022) and
recomputes p in the backward pass, where, with δ_i = Σ_d dO_id · o_id,

    dv_j = Σ_i p_ij dO_i,   ds_ij = p_ij (dO_i·v_j − δ_i),
    dq_i = σ Σ_j ds_ij k_j,   dk_j = σ Σ_i ds_ij q_i.

δ is a width-D reduction where autodiff of the softmax reduces over the s keys of every row.
With ``chunk`` > 0 the queries are taken ``chunk`` at a time (a ``lax.map`` forward, a
``lax.scan`` backward that sums dk and dv over the chunks in float32), so no more than
[B, H, chunk, s] scores are live at once. Each chunk sees all its keys, so the softmax is exact
per chunk and the result equals the unchunked one up to float rounding. Scores, softmax and
ℓ are float32 whatever the inputs' dtype; the weights are cast to it before multiplying v, as in
the plain program, so the forward values are that program's.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

#: The score of a key a query may not see; finite, so that a row never becomes NaN.
MASKED = float(jnp.finfo(jnp.float32).min)


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, *, chunk: int = 0
) -> jax.Array:
    """softmax(q·kᵀ/√D, masked to ``allowed``)·v for grouped queries.

    Args:
      q: [B, t, kv, g, D] queries (g query heads share each of the kv key/value heads).
      k: [B, s, kv, D] keys.
      v: [B, s, kv, D] values.
      allowed: [B, t, s] bool, which keys each query sees; every row should allow at least one
        key (a row that allows none averages all values uniformly, as the plain program does).
      chunk: queries per chunk; 0 (or ≥ t) takes them all at once. t need not be a multiple:
        the last chunk is padded and its padding dropped.
    Returns:
      [B, t, kv, g, D] in q's dtype.
    """
    if q.ndim != 5 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(
            f"attend: q must be [B, t, kv, g, D] and k, v [B, s, kv, D], got "
            f"q {q.shape}, k {k.shape}, v {v.shape}"
        )
    b, t, hk, _, d = q.shape
    if k.shape[0] != b or k.shape[2:] != (hk, d) or allowed.shape != (b, t, k.shape[1]):
        raise ValueError(
            f"attend: shapes disagree: q {q.shape}, k {k.shape}, allowed "
            f"{allowed.shape} (want allowed [B, t, s] = {(b, t, k.shape[1])})"
        )
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ValueError(f"attend: chunk must be a non-negative int, got {chunk!r}")
    if chunk == 0 or chunk >= t:
        return _attention(q, k, v, allowed, 1)
    pad = -t % chunk
    if pad:
        q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
        allowed = jnp.pad(allowed, ((0, 0), (0, pad), (0, 0)))
    return _attention(q, k, v, allowed, (t + pad) // chunk)[:, :t]


def attend_reference(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """The same values by the plain program that autodiff differentiates, keeping the weights:
    what runs undifferentiated (the sampler), and the reference of tests and of
    ``benchmarks/scale.py``'s memory comparison."""
    s = jnp.einsum("btkgd,bskd->bkgts", q, k).astype(jnp.float32)
    s = jnp.where(allowed[:, None, None], s * (1.0 / float(q.shape[-1]) ** 0.5), MASKED)
    return jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, axis=-1).astype(q.dtype), v)


# The differentiated program works head-major with each kv head's g·t queries as one axis m:
# q [B, kv, m, D] against k, v [B, kv, s, D], so that every product (and its transpose in the
# backward) is a plain batched matmul over B·kv; contracting the separate g and t axes of the
# [B, t, kv, g, D] layout instead makes XLA:CPU copy operands inside each product.


def _queries(x):  # [B, t, kv, g, D] → [B, kv, g·t, D]
    b, t, hk, g, d = x.shape
    return x.transpose(0, 2, 3, 1, 4).reshape(b, hk, g * t, d)


def _keys(x):  # [B, s, kv, D] → [B, kv, s, D], and back
    return x.transpose(0, 2, 1, 3)


def _tokens(xm, like):  # [B, kv, g·t, D] → like's [B, t, kv, g, D]
    b, t, hk, g, d = like.shape
    return xm.reshape(b, hk, g, t, d).transpose(0, 3, 1, 2, 4)


def _scores(qm, km, allowed, g):
    """Masked float32 scores [B, kv, g·t, s] of one chunk."""
    b, t, s_len = allowed.shape
    s = jnp.einsum("bkmd,bksd->bkms", qm, km).astype(jnp.float32)
    mask = jnp.broadcast_to(allowed[:, None, None], (b, 1, g, t, s_len)).reshape(b, 1, g * t, s_len)
    return jnp.where(mask, s * (1.0 / float(qm.shape[-1]) ** 0.5), MASKED)


def _chunk_fwd(q, km, vm, allowed):
    """Output and ℓ of one chunk of queries q [B, c, kv, g, D]; km, vm head-major [B, kv, s, D]
    (transposed once by the caller, not in every chunk)."""
    qm = _queries(q)
    s = _scores(qm, km, allowed, q.shape[3])
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.exp(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    out = jnp.einsum("bkms,bksd->bkmd", (e / total).astype(q.dtype), vm)
    return _tokens(out, q), m + jnp.log(total)  # ℓ [B, kv, g·t, 1]


def _chunk_bwd(q, km, vm, allowed, out, lse, dout):
    """(dq, dk, dv) of one chunk; dk and dv head-major [B, kv, s, D] in float32 (they are
    summed over chunks)."""
    qm, dom, om = _queries(q), _queries(dout), _queries(out)
    p = jnp.exp(_scores(qm, km, allowed, q.shape[3]) - lse)
    dv = jnp.einsum("bkms,bkmd->bksd", p.astype(vm.dtype), dom, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bkmd,bksd->bkms", dom, vm).astype(jnp.float32)
    delta = jnp.sum(dom.astype(jnp.float32) * om.astype(jnp.float32), axis=-1, keepdims=True)
    ds = (p * (dp - delta) * (1.0 / float(q.shape[-1]) ** 0.5)).astype(q.dtype)
    dq = _tokens(jnp.einsum("bkms,bksd->bkmd", ds, km), q)
    dk = jnp.einsum("bkms,bkmd->bksd", ds, qm, preferred_element_type=jnp.float32)
    return dq, dk, dv


def _chunks(x, n):
    """[B, n·c, ...] → [n, B, c, ...]."""
    return jnp.moveaxis(x.reshape((x.shape[0], n, x.shape[1] // n) + x.shape[2:]), 1, 0)


def _unchunk(x):
    """[n, B, c, ...] → [B, n·c, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, allowed, n):
    if n == 1:  # what runs undifferentiated (the sampler): the plain program
        return attend_reference(q, k, v, allowed)
    return _attention_fwd(q, k, v, allowed, n)[0]


def _attention_fwd(q, k, v, allowed, n):
    km, vm = _keys(k), _keys(v)
    if n == 1:
        out, lse = _chunk_fwd(q, km, vm, allowed)
    else:
        out, lse = jax.lax.map(
            lambda qa: _chunk_fwd(qa[0], km, vm, qa[1]), (_chunks(q, n), _chunks(allowed, n))
        )
        out = _unchunk(out)
    return out, (q, k, v, allowed, out, lse)


def _attention_bwd(n, res, dout):
    q, k, v, allowed, out, lse = res
    km, vm = _keys(k), _keys(v)
    if n == 1:
        dq, dk, dv = _chunk_bwd(q, km, vm, allowed, out, lse, dout)
    else:

        def step(carry, xs):
            dq, dk, dv = _chunk_bwd(xs[0], km, vm, xs[1], xs[2], xs[3], xs[4])
            return (carry[0] + dk, carry[1] + dv), dq

        zeros = jnp.zeros_like(km, jnp.float32)  # keeps k's varying axes under shard_map
        (dk, dv), dq = jax.lax.scan(
            step,
            (zeros, zeros),
            (_chunks(q, n), _chunks(allowed, n), _chunks(out, n), lse, _chunks(dout, n)),
        )
        dq = _unchunk(dq)
    return dq, _keys(dk).astype(k.dtype), _keys(dv).astype(v.dtype), None


_attention.defvjp(_attention_fwd, _attention_bwd)
