"""One checking helper serves the library: the same fault reads the same and raises the same type
whether a loss or a model finds it."""

import jax.numpy as jnp
import pytest

from sat_jax import losses
from sat_jax.models.logprobs import chunked_logprobs
from sat_jax.models.moe import expert_ffn, routing_flips

B, T, D, V = 2, 3, 4, 5


def _loss(**change):
    args = dict(
        logp=jnp.zeros((B, T)),
        behavior_logp=jnp.zeros((B, T)),
        advantages=jnp.ones((B,)),
        mask=jnp.ones((B, T), bool),
    )
    return losses.ppo(**{**args, **change})


def _logprobs(**change):
    args = dict(
        hidden=jnp.zeros((B, T, D)),
        head_weight=jnp.zeros((D, V)),
        targets=jnp.zeros((B, T), jnp.int32),
    )
    return chunked_logprobs(**{**args, **change}, chunk_size=4)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: _loss(behavior_logp=jnp.zeros((B, T + 1))),
            ValueError,
            "`behavior_logp` must have shape (2, 3), got (2, 4).",
        ),
        (
            lambda: _logprobs(targets=jnp.zeros((B, T + 1), jnp.int32)),
            ValueError,
            "`targets` must have shape (2, 3), got (2, 4).",
        ),
        (
            lambda: _loss(logp=jnp.zeros((B,))),
            ValueError,
            "`logp` must have rank 2, got shape (2,).",
        ),
        (
            lambda: _logprobs(hidden=jnp.zeros((B, D))),
            ValueError,
            "`hidden` must have rank 3, got shape (2, 4).",
        ),
        (
            lambda: _loss(logp=jnp.zeros((B, T), jnp.int32)),
            TypeError,
            "`logp` must have a floating dtype, got int32.",
        ),
        (
            lambda: expert_ffn(
                jnp.zeros((B, D), jnp.int32),
                jnp.zeros((B, 1), jnp.int32),
                jnp.ones((B, 1)),
                jnp.zeros((1, D, 3)),
                jnp.zeros((1, D, 3)),
                jnp.zeros((1, 3, D)),
            ),
            TypeError,
            "`x` must have a floating dtype, got int32.",
        ),
        (
            lambda: routing_flips(jnp.zeros((B, 2)), jnp.zeros((B, 2))),
            TypeError,
            "`chosen` must have an integer dtype, got float32.",
        ),
        (
            lambda: _logprobs(targets=jnp.full((B, T), V, jnp.int32)),
            ValueError,
            "`targets` holds token ids outside [0, 5): min 5, max 5.",
        ),
    ],
)
def test_a_fault_reads_the_same_in_every_layer(call, error, message):
    with pytest.raises(error) as info:
        call()
    assert str(info.value) == message
