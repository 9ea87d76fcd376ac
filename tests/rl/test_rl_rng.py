"""Named random streams (``sat_jax.rl.rng``): which keys agree, which differ, and bad names."""

import jax
import jax.numpy as jnp
import pytest

from sat_jax.rl import rng


def test_random_streams_are_named_and_keep_the_rollout_root():
    k = jax.random.key(7)
    same = jax.random.fold_in(jax.random.fold_in(k, 3), 1)
    assert jnp.array_equal(
        jax.random.key_data(rng.key(7, "rollout", 3, 1)), jax.random.key_data(same)
    )
    eval_key = jax.random.key_data(rng.key(7, "eval", 3))
    assert jnp.array_equal(eval_key, jax.random.key_data(rng.key(7, "eval", 3)))
    assert not jnp.array_equal(eval_key, jax.random.key_data(rng.key(7, "stream", 3)))
    assert not jnp.array_equal(eval_key, jax.random.key_data(rng.key(7, "rollout", 3)))
    assert rng.stream_id("eval") >= 2**31  # above every step index
    with pytest.raises(ValueError, match="indices"):
        rng.key(7, "eval", -1)
    with pytest.raises(ValueError, match="name"):
        rng.key(7, "")
