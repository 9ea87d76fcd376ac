"""Test-wide setup: eight fake CPU devices, strict numpy rank promotion and one persistent
compilation cache for the whole run.

XLA_FLAGS must be set before JAX initialises its backends, so this runs at import time of the
conftest, which pytest loads before any test module (and, under xdist, in the controller before it
starts the workers, so the workers and every subprocess a test starts inherit the environment).

The cache: many tests compile the same programs through different jit objects (the same tiny
model's pass in several files; the CLI tests start ``sat_jax.cli train`` on the same config
again and again), which jit's in-memory cache cannot share. JAX's persistent cache keys on the
program and the devices, so a repeat is loaded instead of compiled. It lives in a fresh directory
for this run (removed at exit), unless JAX_COMPILATION_CACHE_DIR is already set.
"""

import atexit
import importlib.util
import os
import shutil
import tempfile

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    # LLVM at -O0: XLA:CPU's compile time is most of this suite's time (tiny shapes, hundreds of
    # programs), and -O0 compiles faster while the programs run only a little slower at these
    # sizes. XLA's own optimisations still run, and there is no fast-math at either level.
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="sat_jax_tests_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    # Programs that compile in under 0.3 s are not worth a file each.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")
    if importlib.util.find_spec("filelock") is not None:
        # A size limit turns on the cache's file lock: the xdist workers write it concurrently.
        os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
