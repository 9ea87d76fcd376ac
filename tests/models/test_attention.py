"""``sat_jax.models.attention.attend``: hand-computed values and gradients, equality with plain
autodiff of the softmax program for every chunking (values, gradients, bf16), what the backward
keeps, the chunked program's smaller scores, the model with chunked attention, bad input."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sat_jax.models import ModelConfig, init_model, token_logprobs
from sat_jax.models.attention import attend, attend_reference

B, T, S, KV, G, D = 2, 7, 7, 2, 2, 4


def _plain(q, k, v, allowed):
    """The program autodiff differentiates, written out: scores, masked softmax, weights · v."""
    s = jnp.einsum("btkgd,bskd->bkgts", q, k).astype(jnp.float32) / q.shape[-1] ** 0.5
    s = jnp.where(allowed[:, None, None], s, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, axis=-1).astype(q.dtype), v)


def test_reference_is_the_plain_program(inputs):
    q, k, v, allowed, _ = inputs
    chex.assert_trees_all_equal(attend_reference(q, k, v, allowed), _plain(q, k, v, allowed))


@pytest.fixture(scope="module")
def inputs():
    r = np.random.default_rng(0)
    q = jnp.asarray(r.normal(size=(B, T, KV, G, D)), jnp.float32)
    k = jnp.asarray(r.normal(size=(B, S, KV, D)), jnp.float32)
    v = jnp.asarray(r.normal(size=(B, S, KV, D)), jnp.float32)
    allowed = jnp.asarray(r.random((B, T, S)) < 0.5) | jnp.eye(T, S, dtype=bool)[None]
    allowed = allowed.at[0, 3].set(False).at[0, 3, 3].set(True)  # a row that sees one key
    cotangent = jnp.asarray(r.normal(size=(B, T, KV, G, D)), jnp.float32)
    return q, k, v, allowed, cotangent


@pytest.mark.parametrize("chunk", [0, 2])
def test_zero_queries_average_the_visible_values_by_hand(chunk):
    # q = 0: every visible score is 0, so o_i is the mean of the visible v_j, and
    # ∂(Σ_i c_i·o_i)/∂v_j = Σ_{i sees j} c_i / n_i (n_i keys visible to i).
    v = jnp.asarray([[1.0, 10.0], [3.0, 20.0], [8.0, 60.0]]).reshape(1, 3, 1, 2)
    k = jnp.ones((1, 3, 1, 2))
    q = jnp.zeros((1, 3, 1, 1, 2))
    allowed = jnp.asarray([[[True, False, False], [True, True, False], [True, False, True]]])
    out = attend(q, k, v, allowed, chunk=chunk)[0, :, 0, 0]
    np.testing.assert_allclose(out, [[1.0, 10.0], [2.0, 15.0], [4.5, 35.0]], rtol=1e-6)
    c = jnp.asarray([1.0, 2.0, 4.0])[None, :, None, None, None] * jnp.ones((1, 3, 1, 1, 2))
    dv = jax.grad(lambda v: jnp.sum(attend(q, k, v, allowed, chunk=chunk) * c))(v)
    np.testing.assert_allclose(dv[0, :, 0, 0], [1 + 2 / 2 + 4 / 2, 2 / 2, 4 / 2], rtol=1e-6)


@pytest.mark.parametrize("chunk", [0, 1, 3, 4, T, 10])
def test_equals_plain_autodiff(inputs, chunk):
    q, k, v, allowed, ct = inputs
    chex.assert_trees_all_close(
        attend(q, k, v, allowed, chunk=chunk), _plain(q, k, v, allowed), rtol=1e-5, atol=1e-6
    )

    def grads(f):
        return jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * ct), argnums=(0, 1, 2))(q, k, v)

    got = grads(lambda q, k, v: attend(q, k, v, allowed, chunk=chunk))
    want = grads(lambda q, k, v: _plain(q, k, v, allowed))
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)  # (dq, dk, dv)


@pytest.mark.parametrize("chunk", [0, 3])
def test_bfloat16_close_to_plain(inputs, chunk):
    q, k, v, allowed, ct = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in inputs)
    out = attend(q, k, v, allowed, chunk=chunk)
    chex.assert_type(out, jnp.bfloat16)
    chex.assert_trees_all_close(
        np.asarray(out, np.float32),
        np.asarray(_plain(q, k, v, allowed), np.float32),
        rtol=1e-7,
        atol=2e-2,
    )
    dq, dk, dv = jax.grad(
        lambda q, k, v: jnp.sum((attend(q, k, v, allowed, chunk=chunk) * ct).astype(jnp.float32)),
        (0, 1, 2),
    )(q, k, v)
    chex.assert_type([dq, dk, dv], jnp.bfloat16)
    wq, wk, wv = jax.grad(
        lambda q, k, v: jnp.sum((_plain(q, k, v, allowed) * ct).astype(jnp.float32)), (0, 1, 2)
    )(q, k, v)
    for a, b in ((dq, wq), (dk, wk), (dv, wv)):
        chex.assert_trees_all_close(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-7, atol=6e-2
        )


def test_backward_keeps_no_score_sized_array(inputs):
    # What the VJP closes over: q, k, v, the mask, the output and ℓ [B, kv, g·t, 1]; not the
    # [B, kv, g, t, s] weights that autodiff of the softmax keeps.
    q, k, v, allowed, _ = inputs
    _, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, allowed), q, k, v)
    floats = sorted(a.shape for a in jax.tree.leaves(vjp) if jnp.issubdtype(a.dtype, jnp.floating))
    assert floats == sorted([q.shape, k.shape, v.shape, q.shape, (B, KV, G * T, 1)])
    _, plain_vjp = jax.vjp(lambda q, k, v: _plain(q, k, v, allowed), q, k, v)
    assert (B, KV, G, T, S) in {a.shape for a in jax.tree.leaves(plain_vjp)}  # the contrast


def test_chunks_bound_the_live_scores():
    # XLA's buffer assignment of forward + backward: chunks of 16 queries out of 256 need far
    # less scratch than all 256 at once (the [1, 2, 2, 256, 256] float32 scores are 1 MiB).
    t = 256
    q = jax.ShapeDtypeStruct((1, t, 2, 2, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, 2, 8), jnp.float32)
    allowed = jax.ShapeDtypeStruct((1, t, t), jnp.bool_)

    def temp(chunk):
        f = jax.grad(lambda q, k, v, a: jnp.sum(attend(q, k, v, a, chunk=chunk)), (0, 1, 2))
        return jax.jit(f).lower(q, kv, kv, allowed).compile().memory_analysis().temp_size_in_bytes

    whole, chunked = temp(0), temp(16)
    assert whole >= 2**20
    assert chunked < whole / 4, (chunked, whole)


def test_model_with_chunked_attention_equals_whole():
    # Two blocks; a 13-token batch in chunks of 4 (the last one padded); prompt start 5.
    cfg = ModelConfig.tiny(num_layers=2)
    graphdef, params = init_model(cfg, seed=1)
    chunked_def, _ = init_model(cfg.replace(attention_chunk=4), seed=1)
    r = np.random.default_rng(1)
    tokens = jnp.asarray(r.integers(2, cfg.vocab_size, (2, 13)), jnp.int32)
    mask = jnp.ones((2, 13), bool).at[1, :2].set(False)

    def run(g):
        def loss(p):
            logp, _, _ = token_logprobs(g, p, tokens, input_mask=mask, response_start=5)
            return jnp.sum(logp), logp

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (_, want), want_g = run(graphdef)
    (_, got), got_g = run(chunked_def)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(got_g, want_g, rtol=1e-4, atol=1e-6)


def test_bad_input_is_named():
    q, kv = jnp.zeros((1, 3, 1, 1, 2)), jnp.zeros((1, 3, 1, 2))
    allowed = jnp.ones((1, 3, 3), bool)
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="chunk"):
            attend(q, kv, kv, allowed, chunk=bad)
    with pytest.raises(ValueError, match="allowed"):
        attend(q, kv, kv, allowed[:, :2])
    with pytest.raises(ValueError, match="q must be"):
        attend(q[0], kv, kv, allowed)
    for bad in (-4, False, 1.5):
        with pytest.raises(ValueError, match="attention_chunk"):
            ModelConfig(attention_chunk=bad)
