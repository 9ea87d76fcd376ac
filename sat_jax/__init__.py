"""sat_jax: Staleness-Adaptive Trust Region (SAT) and asynchronous RL for language models in JAX."""

from sat_jax import advantages, losses

__all__ = ["advantages", "losses"]
__version__ = "0.1.0"
