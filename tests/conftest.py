"""Test-wide setup: eight fake CPU devices and strict numpy rank promotion.

XLA_FLAGS must be set before JAX initialises its backends, so this runs at import time of the
conftest, which pytest loads before any test module.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
