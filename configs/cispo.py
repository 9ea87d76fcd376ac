"""CISPO: REINFORCE weighted by the clipped, detached importance ratio, [0, 5]
(sat_jax.losses.cispo; arXiv 2506.13585).

Every config takes overrides, e.g. --config.lag=1 --config.seed=2.
"""

from sat_jax.study.grid import method_config


def get_config():
    return method_config("cispo")
