"""BAPO's bounds on the GSPO sequence ratio (sat_jax.losses.bapo_gspo).

Every config takes overrides, e.g. --config.lag=1 --config.seed=2.
"""

from sat_jax.study.grid import method_config


def get_config():
    return method_config("bapo_gspo")
