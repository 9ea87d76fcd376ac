"""Decoupled PPO with A-3PO's proximal policy from each token's exact staleness
(sat_jax.losses.decoupled_ppo; arXiv 2505.24298, 2512.06547).

Every config takes overrides, e.g. --config.lag=1 --config.seed=2.
"""

from sat_jax.study.grid import method_config


def get_config():
    return method_config("decoupled_ppo")
