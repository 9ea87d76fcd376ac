"""Hand-checked unit tests of the model pieces: RMSNorm, rotary, router gates (R3), Switch loss."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sat_jax.models import ModelConfig, RMSNorm, load_balancing_loss, rotary, routing_gates
from sat_jax.models.layers import select_experts


def test_rmsnorm_hand_example():
    norm = RMSNorm(2, eps=0.0)
    norm.weight[...] = jnp.array([1.0, 2.0])
    y = norm(jnp.array([[3.0, 4.0]]))
    rms = math.sqrt((9 + 16) / 2)
    np.testing.assert_allclose(y, [[3 / rms, 2 * 4 / rms]], rtol=1e-6)


def test_rmsnorm_keeps_dtype_and_normalises_in_float32():
    norm = RMSNorm(4, eps=1e-6)
    x = jnp.array([[1.0, -2.0, 3.0, -4.0]], jnp.bfloat16)
    y = norm(x)
    chex.assert_type(y, jnp.bfloat16)
    chex.assert_trees_all_close(jnp.mean(jnp.square(y.astype(jnp.float32))), 1.0, rtol=1e-2)


def test_rotary_hand_example_and_identity_at_zero():
    x = jnp.array([1.0, 0.0]).reshape(1, 1, 1, 2)
    # D = 2: one frequency, ω = 1, so position 1 rotates by one radian.
    y = rotary(x, jnp.array([[1]]), theta=10000.0)
    np.testing.assert_allclose(y.reshape(2), [math.cos(1.0), math.sin(1.0)], rtol=1e-6)
    z = jax.random.normal(jax.random.key(0), (1, 1, 2, 8))
    chex.assert_trees_all_close(rotary(z, jnp.array([[0]]), 10000.0), z, rtol=1e-6)


def test_rotary_relative_position_invariance():
    kq, kk = jax.random.split(jax.random.key(1))
    q = jax.random.normal(kq, (1, 1, 1, 16))
    k = jax.random.normal(kk, (1, 1, 1, 16))

    def score(m, n):
        return jnp.sum(rotary(q, jnp.array([[m]]), 100.0) * rotary(k, jnp.array([[n]]), 100.0))

    base = score(5, 2)
    for shift in (1, 7, 40):
        chex.assert_trees_all_close(score(5 + shift, 2 + shift), base, rtol=1e-4, atol=1e-5)
    assert abs(float(score(6, 2) - base)) > 1e-3  # and it does depend on the offset


def test_replay_gates_hand_example():
    z = jnp.array([1.0, 2.0, 0.0, 3.0])
    idx = jnp.array([3, 1])
    # Eq. 40: softmax of z restricted to I = {1, 3}.
    e2, e3 = math.exp(2.0), math.exp(3.0)
    np.testing.assert_allclose(
        routing_gates(z, idx, norm_topk_prob=True),
        [0, e2 / (e2 + e3), 0, e3 / (e2 + e3)],
        rtol=1e-6,
    )
    # Without renormalisation (Qwen3 norm_topk_prob=False): full-softmax probabilities on I.
    total = math.exp(1.0) + e2 + 1.0 + e3
    np.testing.assert_allclose(
        routing_gates(z, idx, norm_topk_prob=False), [0, e2 / total, 0, e3 / total], rtol=1e-6
    )


def test_replaying_the_fresh_choice_reproduces_the_fresh_gates_exactly():
    z = jax.random.normal(jax.random.key(2), (3, 5, 8))
    idx = select_experts(z, 2)
    chosen = jnp.sum(jax.nn.one_hot(idx, 8), axis=-2)
    probs = jax.nn.softmax(z, axis=-1)
    renorm = probs * chosen / jnp.sum(probs * chosen, axis=-1, keepdims=True)
    chex.assert_trees_all_close(
        routing_gates(z, idx, norm_topk_prob=True), renorm, rtol=1e-7, atol=1e-6
    )


def test_replayed_gates_pass_gradients_to_router_logits():
    z = jnp.array([0.3, -0.2, 0.9, 0.1])
    idx = jnp.array([0, 1])  # not the fresh top-2: replay overrides the choice
    w = jnp.array([1.0, 2.0, 3.0, 4.0])
    grad = jax.grad(lambda z_: jnp.sum(routing_gates(z_, idx, norm_topk_prob=True) * w))(z)
    assert float(jnp.abs(grad[0])) > 0 and float(jnp.abs(grad[1])) > 0
    # Experts outside I get no gate and no gradient.
    chex.assert_trees_all_close(grad[2:], 0.0, rtol=1e-7)


def test_load_balancing_loss_hand_example():
    # E = 2, k = 1, two tokens routed one to each expert: f = P = (1/2, 1/2), L = 2 · 1/2 = 1.
    z = jnp.array([[[1.0, 0.0], [0.0, 1.0]]])
    loss = load_balancing_loss(z, 1, jnp.ones((1, 2), bool))
    chex.assert_trees_all_close(loss, 1.0, rtol=1e-6)
    # Masking out the second token: f = (1, 0), P = softmax([1, 0]) → L = 2 · σ(1).
    loss = load_balancing_loss(z, 1, jnp.array([[True, False]]))
    chex.assert_trees_all_close(loss, 2 * jax.nn.sigmoid(1.0), rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"num_heads": 4, "num_kv_heads": 3}, "num_kv_heads"),
        ({"num_experts": 2, "num_experts_per_tok": 3}, "num_experts_per_tok"),
        ({"head_dim": 5}, "head_dim"),
        ({"mlp_only_layers": (9,)}, "mlp_only_layers"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_config_rejects_inconsistent_sizes(kwargs, word):
    with pytest.raises(ValueError, match=word):
        ModelConfig.tiny(**kwargs)


def test_config_is_hashable_and_dtype_normalised():
    a = ModelConfig.tiny(dtype=jnp.bfloat16)
    b = ModelConfig.tiny(dtype="bfloat16")
    assert a == b and hash(a) == hash(b)
    assert ModelConfig.tiny().num_moe_layers == 4
    assert ModelConfig.tiny(mlp_only_layers=(0,)).moe_layer_ids == (1, 2, 3)
