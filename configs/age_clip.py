"""The age-aware clip: PPO's radii eps / (1 + loss.kappa * (d - 1)) by each token's exact version
lag d (sat_jax.losses.age_clip).

Every config takes overrides, e.g. --config.lag=1 --config.seed=2.
"""

from sat_jax.study.grid import method_config


def get_config():
    return method_config("age_clip")
