"""The staleness testbed's base run on digit sorting (``sat_jax.config.presets.stale_sort``):
``configs/stale_base.py`` with ``sort_digits``, whose response length is the list length."""

from sat_jax.config.presets import stale_sort as get_config  # noqa: F401
