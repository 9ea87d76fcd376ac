"""A run's d̄_π by staleness bucket in its summary (``lag_le2_t25``, ``lag_ge8_t25``): the mean
over the trailing steps whose batch held tokens of the bucket."""

import math

from sat_jax.study import stats


def test_bucket_means_skip_steps_without_the_bucket():
    records = []
    for step in range(8):  # trailing 25% of 8 steps: steps 6 and 7
        records.append(
            {
                "step": step,
                "loss/mismatch": 0.01,
                "mismatch/lag_le2": 0.1 * step,
                "mismatch/lag_le2_share": 0.5,
                # step 7's batch held no stale token: its 0 must not count
                "mismatch/lag_ge8": 0.0 if step == 7 else 1.0 + step,
                "mismatch/lag_ge8_share": 0.0 if step == 7 else 0.25,
            }
        )
    out = stats.summarize_run(records)
    assert math.isclose(out["lag_le2_t25"], (0.6 + 0.7) / 2)
    assert out["lag_ge8_t25"] == 7.0


def test_runs_without_buckets_read_nan():
    out = stats.summarize_run([{"step": 0, "loss/mismatch": 0.01}])
    assert math.isnan(out["lag_le2_t25"]) and math.isnan(out["lag_ge8_t25"])
