"""The age-aware clip on the GSPO sequence ratio, a response's age the mean of its tokens' lags
(sat_jax.losses.age_clip_gspo).

Every config takes overrides, e.g. --config.lag=1 --config.seed=2.
"""

from sat_jax.study.grid import method_config


def get_config():
    return method_config("age_clip_gspo")
