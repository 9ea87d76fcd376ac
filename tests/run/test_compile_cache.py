"""The persistent compilation cache of ``sat-jax train`` / ``eval`` / ``compare --grid``
(``sat_jax.run.compile_cache``): on where asked, off when empty, an environment's own cache kept,
and a run with a warm cache loads every program and logs the same numbers as with a cold one.

This test process runs under the suite's own cache (``JAX_COMPILATION_CACHE_DIR``, set by
conftest), so each case runs in a subprocess without it."""

import json
import os
import subprocess
import sys

import pytest
from _tiny_models import TINY_RUN

from sat_jax.run.metrics import read_metrics


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop("JAX_COMPILATION_CACHE_MAX_SIZE", None)
    return {**env, "JAX_PLATFORMS": "cpu", **extra}


def _python(code: str, **env) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(**env), timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


_ENABLE = """
import json, sys
import jax
from sat_jax.run import compile_cache
out = {}
try:
    out["dir"] = compile_cache.enable(sys.argv[1] if len(sys.argv) > 1 else %r)
except ValueError as e:
    out["error"] = str(e)
out["config_dir"] = jax.config.jax_compilation_cache_dir
out["min_seconds"] = jax.config.jax_persistent_cache_min_compile_time_secs
print(json.dumps(out))
"""


def test_enable_sets_the_directory_and_creates_it(tmp_path):
    target = tmp_path / "a" / "xla"
    out = _python(_ENABLE % str(target))
    assert out["dir"] == out["config_dir"] == str(target) and target.is_dir()
    assert out["min_seconds"] == pytest.approx(0.3)


def test_enable_off_when_empty(tmp_path):
    out = _python(_ENABLE % "")
    assert out["dir"] is None and out["config_dir"] is None


def test_enable_keeps_the_environments_cache(tmp_path):
    mine = tmp_path / "env-cache"
    out = _python(
        _ENABLE % str(tmp_path / "flag-cache"),
        JAX_COMPILATION_CACHE_DIR=str(mine),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="2.5",
    )
    assert out["dir"] == out["config_dir"] == str(mine)
    assert out["min_seconds"] == pytest.approx(2.5)
    assert not (tmp_path / "flag-cache").exists()


def test_enable_refuses_a_file(tmp_path):
    path = tmp_path / "cache"
    path.write_text("")
    out = _python(_ENABLE % str(path))
    assert out["error"] == f"compile cache {str(path)!r} is a file, not a directory"
    assert out["config_dir"] is None


def _train(tmp_path, workdir, cache, cache_dir):
    fields = (*TINY_RUN, "num_steps=2", "lag=1", "sft.steps=3", "eval.every=2")
    args = [
        f"--workdir={workdir}",
        f"--compile_cache={cache}",
        f"--config.sft.cache_dir={cache_dir}",
        "--config.log.progress=False",
        *(f"--config.{f}" for f in fields),
    ]
    res = subprocess.run(
        [sys.executable, "-m", "sat_jax.cli", "train", *args],
        capture_output=True,
        text=True,
        # Every program into the cache, however fast it compiles.
        env=_env(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"),
        cwd=tmp_path,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return [{k: v for k, v in row.items() if not _timing(k)} for row in read_metrics(str(workdir))]


def _timing(key: str) -> bool:
    """A wall-clock figure, which differs between any two runs."""
    return (
        key == "time"
        or key.startswith(("time/", "throughput/"))
        or key.endswith(("seconds", "_s", "_per_s"))
    )


def _entries(cache):
    return {n for n in os.listdir(cache) if not n.endswith(".lock")}


def test_a_warm_cache_loads_every_program_and_logs_the_same_numbers(tmp_path):
    cache, sft = tmp_path / "xla", tmp_path / "sft"
    _train(tmp_path, tmp_path / "warmup", cache, sft)  # the warm-up is trained and cached once
    cold_cache = tmp_path / "xla-cold"
    cold = _train(tmp_path, tmp_path / "cold", cold_cache, sft)
    written = _entries(cold_cache)
    assert written, "the cold run cached no program"
    warm = _train(tmp_path, tmp_path / "warm", cold_cache, sft)
    assert _entries(cold_cache) == written  # nothing compiled again: every program was loaded
    assert warm == cold and len(cold) >= 2
