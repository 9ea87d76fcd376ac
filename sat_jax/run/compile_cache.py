"""JAX's persistent compilation cache for the command line's runs.

Every run of a study builds the same programs again (the same model, rollout engine, evaluation
and trainer step, other seeds and arms): with the cache on, the first run of a grid compiles them
and each later run, in the same process or a new one, loads them from disk. A loaded program is
the compiled executable itself, so a run's numbers do not change (``tests/run/test_compile_cache``
pins a run's metrics with a cold and a warm cache equal).

``sat-jax train``, ``eval`` and ``compare --grid`` call :func:`enable` with ``--compile_cache``
(default ``~/.cache/sat_jax/xla``; an empty value turns it off) before they compile anything. A
cache that the environment already configures (``JAX_COMPILATION_CACHE_DIR``, or
``jax.config.update`` in the calling program) is kept as it is. The cache is trusted code: point
it only at a directory that no one else can write (JAX's own warning).
"""

from __future__ import annotations

import importlib.util
import os

import jax

DEFAULT_DIR = os.path.join("~", ".cache", "sat_jax", "xla")
#: Programs that compile faster than this are not worth a file each (unless the environment's
#: ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` says otherwise).
MIN_COMPILE_SECONDS = 0.3
#: The cache's size bound (least recently used entries go first), set where ``filelock`` is
#: installed (JAX's eviction needs it; it also locks the cache for processes that share it).
MAX_BYTES = 8 << 30


def enable(path: str | None = DEFAULT_DIR) -> str | None:
    """Turns on the persistent compilation cache in ``path`` (``~`` expanded, created if absent)
    and returns the directory in use; ``None`` or ``""`` leaves it off (``None`` returned).

    Must run before the process's first compilation (JAX reads the setting once). A directory
    already set in JAX's config (by ``JAX_COMPILATION_CACHE_DIR`` or by the caller) wins, and is
    returned; then nothing else is changed either.
    """
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    if not path:
        return None
    if not isinstance(path, str):
        raise TypeError(f"compile cache path must be a string, got {path!r}")
    directory = os.path.expanduser(path)
    if "://" not in directory:
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"compile cache {path!r} is a file, not a directory")
        os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    if (
        jax.config.jax_compilation_cache_max_size == -1
        and importlib.util.find_spec("filelock") is not None
    ):
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return directory
