"""M2PO's mask on the GSPO sequence ratio, with GSPO's clip at loss.eps_low/eps_high
(sat_jax.losses.m2po_gspo).

Every config takes overrides, e.g. --config.lag=1 --config.seed=2.
"""

from sat_jax.study.grid import method_config


def get_config():
    return method_config("m2po_gspo")
