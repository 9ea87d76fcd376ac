"""M2PO: the token ratio unclipped, the tokens of largest (log r)² masked until the batch's second
moment is <= loss.tau (sat_jax.losses.m2po; arXiv 2510.01161).

Every config takes overrides, e.g. --config.lag=1 --config.seed=2.
"""

from sat_jax.study.grid import method_config


def get_config():
    return method_config("m2po")
