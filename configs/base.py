"""The shared base of every method config: the built-in default run (SAT-GSPO w/ R3, lag 8)."""

from sat_jax.config import get_config  # noqa: F401
