"""A step's logged metrics combine all of its optimizer updates (minibatches × passes), not the
last one's: maxima by max, minima by min, everything else by the mean."""

import numpy as np
import pytest

from sat_jax.train.learner import combine_updates


def _update(clip, mism_max, c_min, p99, refused):
    return {
        "loss/clip_frac": np.float32(clip),
        "mismatch/max": np.float32(mism_max),
        "loss/sat/c_min": np.float32(c_min),
        "mismatch/p99": np.float32(p99),
        "optim/nonfinite": np.float32(refused),
    }


def test_two_updates_are_combined_by_kind():
    out = combine_updates([_update(0.1, 1.0, 0.5, 0.25, 0.0), _update(0.3, 3.0, 0.25, 0.75, 1.0)])
    assert out["loss/clip_frac"] == pytest.approx(0.2, abs=1e-7)
    assert out["mismatch/p99"] == 0.5
    assert out["mismatch/max"] == 3.0
    assert out["loss/sat/c_min"] == 0.25
    assert out["optim/nonfinite"] == 1.0
    assert out["optim/nonfinite_updates"] == 1.0
    assert all(isinstance(v, float) for v in out.values())


def test_one_update_is_logged_exactly():
    update = _update(0.1234567, 2.5, 0.125, 0.3, 0.0)
    out = combine_updates([update])
    assert out == {**{k: float(v) for k, v in update.items()}, "optim/nonfinite_updates": 0.0}


def test_refused_updates_are_counted():
    out = combine_updates([_update(0.1, 1.0, 1.0, 0.1, 1.0)] * 3)
    assert out["optim/nonfinite_updates"] == 3.0 and out["optim/nonfinite"] == 1.0


def test_a_step_without_updates_is_an_error():
    with pytest.raises(ValueError, match="at least one update"):
        combine_updates([])
