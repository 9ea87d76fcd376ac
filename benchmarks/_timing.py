"""Timing shared by the benchmarks (imported as a sibling module: scripts run from this folder)."""

from __future__ import annotations

import time

import jax
import numpy as np


def median_seconds(fn, *args, repeats: int) -> float:
    """Median wall time of ``fn(*args)`` over ``repeats`` calls after one warm-up (compilation),
    ``block_until_ready`` included."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def interleaved_ms(fns, args, repeats):
    """Times functions round-robin, so that load drifting on a shared machine hits all alike.

    Returns per-function median milliseconds and the per-round times (for paired ratios).
    """
    for fn in fns.values():
        jax.block_until_ready(fn(*args))  # compile + warm-up
    rounds = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            rounds[name].append(time.perf_counter() - start)
    return {k: float(np.median(v) * 1e3) for k, v in rounds.items()}, rounds


def paired_ratio(rounds, num, den):
    """Median over rounds of num/den measured back to back: robust to slow drifts in load."""
    return round(float(np.median(np.array(rounds[num]) / np.array(rounds[den]))), 3)
