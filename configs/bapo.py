"""BAPO: per-batch adaptive clip bounds until positive advantages reach loss.rho_target of the
gradient-carrying contributions (sat_jax.losses.bapo; arXiv 2510.18927).

Every config takes overrides, e.g. --config.lag=1 --config.seed=2.
"""

from sat_jax.study.grid import method_config


def get_config():
    return method_config("bapo")
