"""SAT-GRPO w/ R3 (paper Table 1 grid).

Every config takes overrides, e.g. --config.lag=1 --config.seed=2.
"""

from sat_jax.config import method_config


def get_config():
    return method_config("sat_grpo_r3", "sat", r3=True, correction="none")
