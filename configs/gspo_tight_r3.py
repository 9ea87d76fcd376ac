"""GSPO with a uniformly tighter clip (with routing replay): the staleness study's matched-step
control, ε_low = ε_high = sat_jax.study.grid.TIGHT_EPS (0.1; the staleness
protocol runs its own calibrated ε, STALE_TIGHT_EPS of configs/studies/stale.py).

Every config takes overrides, e.g. --config.lag=1 --config.seed=2.
"""

from sat_jax.study.grid import method_config


def get_config():
    return method_config("gspo_tight_r3")
