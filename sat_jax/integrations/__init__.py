"""sat_jax.integrations: sat_jax's objectives inside other RL frameworks.

Each submodule imports its framework and :mod:`sat_jax.losses` only (an import-linter contract in
pyproject.toml), so it can be installed and imported without the rest of sat_jax's training stack.
Import a submodule explicitly; this package imports none of them.
"""
