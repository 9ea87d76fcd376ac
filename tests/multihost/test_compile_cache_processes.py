"""A CPU job of two processes runs again on the same persistent compilation cache directory.

With JAX 0.12.1 the second run hangs in its first cross-process collective when each process
loads the program from the cache; ``parallel.maybe_initialize_distributed`` leaves the cache off
for several CPU processes, so both runs finish with the same result.
"""

import os
import sys

from test_two_processes import HERE, _env, _free_port, _run_processes

_DRIVER = os.path.join(HERE, "_cached_program.py")


def test_a_second_run_on_the_same_cache_finishes(tmp_path):
    env = dict(
        _env(2),
        JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    runs = []
    for _ in range(2):
        port = str(_free_port())
        runs.append(
            _run_processes(
                [([sys.executable, _DRIVER, str(i), port], env) for i in range(2)], timeout=120
            )
        )
    results = {
        line
        for outs in runs
        for out in outs
        for line in out.splitlines()
        if line.startswith("result:")
    }
    assert len(results) == 1, results
    for out in runs[0] + runs[1]:
        assert "cache on: False" in out, out[-2000:]
    # Nothing was written: the cache stayed off in both runs.
    assert not any((tmp_path / "xla").glob("*"))
