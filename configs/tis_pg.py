"""TIS-PG: truncated-importance-sampling policy gradient, no clip (without routing replay): the
staleness study's collapse-prone arm (sat_jax.losses.tis_pg, cap loss.tis_pg_cap).

Every config takes overrides, e.g. --config.lag=1 --config.seed=2.
"""

from sat_jax.config import method_config


def get_config():
    return method_config("tis_pg", "tis_pg", r3=False, correction="none")
