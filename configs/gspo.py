"""GSPO (ε 0.2/0.2 as the SAT paper ran it) (paper Table 1 grid).

Every config takes overrides, e.g. --config.lag=1 --config.seed=2.
"""

from sat_jax.config import method_config


def get_config():
    return method_config("gspo", "gspo", r3=False, correction="none")
