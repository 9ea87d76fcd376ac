"""The staleness testbed's base run (``sat_jax.config.presets.stale_base``): long multiplication
with its working, a 4-block MoE of 64 experts, a weak warm-up, GRPO at lag 1."""

from sat_jax.config.presets import stale_base as get_config  # noqa: F401
