"""SAT-GSPO w/ R3 (the built-in default) (paper Table 1 grid).

Every config takes overrides, e.g. --config.lag=1 --config.seed=2.
"""

from sat_jax.config import method_config


def get_config():
    return method_config("sat_gspo_r3", "sat_gspo", r3=True, correction="none")
