"""SAPO: a sigmoid gate in place of the clip, sequence-mean of token-means as the paper
(sat_jax.losses.sapo; arXiv 2511.20347).

Every config takes overrides, e.g. --config.lag=1 --config.seed=2.
"""

from sat_jax.study.grid import method_config


def get_config():
    return method_config("sapo")
