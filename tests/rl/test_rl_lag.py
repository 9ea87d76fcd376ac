"""Lag bookkeeping (Section 4.4): the fixed and broadcast schedules, the versions each keeps, and
the per-token lag statistics with their PQS/IQS split (Eq. 25), hand-checked."""

import numpy as np
import pytest

from sat_jax.rl import LagSchedule, lag_stats


def test_fixed_lag_versions():
    s = LagSchedule("fixed", 3)
    assert [s.version_for(j) for j in range(7)] == [0, 0, 0, 0, 1, 2, 3]
    assert [s.version_for(j) for j in range(4)] == [0, 0, 0, 0]
    assert LagSchedule("fixed", 0).version_for(5) == 5  # on-policy
    assert s.needed_after(5) == {3, 4, 5, 6}


def test_broadcast_versions():
    # Weights reach the engine every n = 4 steps; batch j comes from the newest broadcast < j.
    s = LagSchedule("broadcast", 4)
    assert [s.version_for(j) for j in range(11)] == [0, 0, 0, 0, 0, 4, 4, 4, 4, 8, 8]
    lags = [j - s.version_for(j) for j in range(1, 11)]
    assert lags == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    one = LagSchedule("broadcast", 1)  # the usual one-step-off-policy pipeline
    assert [one.version_for(j) for j in range(5)] == [0, 0, 1, 2, 3]
    assert s.needed_after(6) == {4, 8}


@pytest.mark.parametrize(
    "mode,lag,error",
    [
        ("fixed", -1, ValueError),
        ("broadcast", 0, ValueError),
        ("sync", 1, ValueError),
        ("fixed", 1.5, TypeError),
    ],
)
def test_bad_schedules(mode, lag, error):
    with pytest.raises(error):
        LagSchedule(mode, lag)


def test_stream_has_no_schedule():
    with pytest.raises(ValueError, match="stream"):
        LagSchedule("stream", 2).version_for(3)


def test_lag_stats_split():
    # Response 0: tokens by versions 3, 3, 4 (a swap mid-decode), trained at step 6.
    # Response 1: all version 5, one padding slot.
    versions = np.array([[3, 3, 4], [5, 5, -1]])
    mask = np.array([[1, 1, 1], [1, 1, 0]], bool)
    s = lag_stats(versions, mask, step=6)
    lags = [3, 3, 2, 1, 1]
    assert s["lag/mean"] == pytest.approx(np.mean(lags))
    assert s["lag/max"] == 3 and s["lag/min"] == 1
    # N_PQS: v_last − v = [1, 1, 0, 0, 0]; N_IQS: step − v_last = [2, 2, 2, 1, 1]
    assert s["lag/pqs_mean"] == pytest.approx(2 / 5)
    assert s["lag/iqs_mean"] == pytest.approx(8 / 5)
    assert s["lag/pqs_mean"] + s["lag/iqs_mean"] == pytest.approx(s["lag/mean"])
    assert lag_stats(versions, np.zeros_like(mask), 6)["lag/mean"] == 0.0


def test_capacity_is_what_the_schedule_ever_needs():
    assert LagSchedule("fixed", 3).capacity == 4
    assert LagSchedule("fixed", 0).capacity == 1
    assert LagSchedule("broadcast", 8).capacity == 2
    for schedule in (LagSchedule("fixed", 3), LagSchedule("broadcast", 4)):
        for step in range(30):
            held = {v for v in schedule.needed_after(step) if v <= step + 1} | {step + 1}
            assert len(held) <= schedule.capacity, (schedule, step, held)
