"""Run configuration: the built-in defaults (``defaults.py``, the file ``sat-jax train`` runs when
no ``--config`` is given) and their validation (``validation.py``), which turns a config into
checked, plain arguments before any compute.

The validation names are imported on first use, so that reading the defaults (``configs/*.py``,
``sat-jax --help``) does not import JAX.
"""

from sat_jax.config.defaults import get_config, method_config

_VALIDATION = (
    "RESUMABLE",
    "ConfigError",
    "changed_fields",
    "loss_kwargs",
    "loss_spec",
    "plain",
    "validate",
)

__all__ = ["get_config", "method_config", *_VALIDATION]


def __getattr__(name):
    if name in _VALIDATION:
        from sat_jax.config import validation

        return getattr(validation, name)
    raise AttributeError(f"module 'sat_jax.config' has no attribute {name!r}")
