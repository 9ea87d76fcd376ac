"""d̄_π by the staleness of the tokens (``mismatch/lag_le2``, ``lag_ge8`` and their shares): hand
values, empty buckets, and the same numbers from 8 shards as from one."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sat_jax import parallel
from sat_jax.rl import trainer


def _batch():
    # 8 rows of 3 tokens; lags per row 1, 2, 3, 8, 9, 0, 16, 5; the last token of rows 1 and 4
    # is padding (its huge log-ratio must not count).
    lag = np.repeat(np.array([1, 2, 3, 8, 9, 0, 16, 5], np.int32)[:, None], 3, axis=1)
    mask = np.ones((8, 3), bool)
    mask[1, 2] = mask[4, 2] = False
    logp = np.zeros((8, 3), np.float32)
    behavior = (
        np.tile(np.array([[0.1, -0.2, 0.3]], np.float32), (8, 1))
        * np.arange(1, 9, dtype=np.float32)[:, None]
    )
    behavior[1, 2] = behavior[4, 2] = 1e6
    return logp, behavior, mask, lag


def test_hand_values_and_shares():
    logp, behavior, mask, lag = _batch()
    out = trainer._mismatch_by_lag(logp, behavior, mask, lag, None)
    a = np.abs(behavior)
    # lag <= 2: rows 0 (3 tokens), 1 (2 tokens), 5 (3 tokens)
    le2 = np.concatenate([a[0], a[1, :2], a[5]])
    # lag >= 8: rows 3 (3), 4 (2), 6 (3)
    ge8 = np.concatenate([a[3], a[4, :2], a[6]])
    chex.assert_trees_all_close(
        {k: float(v) for k, v in out.items()},
        {
            "mismatch/lag_le2": float(le2.mean()),
            "mismatch/lag_le2_share": 8 / 22,
            "mismatch/lag_ge8": float(ge8.mean()),
            "mismatch/lag_ge8_share": 8 / 22,
        },
        rtol=1e-6,
    )


def test_an_empty_bucket_reads_zero_with_zero_share():
    logp, behavior, mask, _ = _batch()
    out = trainer._mismatch_by_lag(logp, behavior, mask, np.full((8, 3), 4, np.int32), None)
    assert {k: float(v) for k, v in out.items()} == {
        "mismatch/lag_le2": 0.0,
        "mismatch/lag_le2_share": 0.0,
        "mismatch/lag_ge8": 0.0,
        "mismatch/lag_ge8_share": 0.0,
    }


def test_sharded_over_eight_devices_equals_one():
    logp, behavior, mask, lag = _batch()
    mesh = parallel.make_mesh(8, jax.devices()[:8])
    fn = jax.shard_map(
        lambda *a: trainer._mismatch_by_lag(*a, "data"),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P(),
    )
    sharded = jax.jit(fn)(jnp.asarray(logp), jnp.asarray(behavior), jnp.asarray(mask), lag)
    chex.assert_trees_all_close(
        sharded, trainer._mismatch_by_lag(logp, behavior, mask, lag, None), rtol=1e-6
    )
