"""Evaluation metrics: unbiased pass@k, avg@k, pass@1, and a generate-and-score helper.

A sample counts as correct for pass@k when its reward is above 0.5 (rewards of the built-in
tasks and of the math verifier are 0 or 1); avg@k averages the rewards themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sat_jax.data.tasks import Example

GenerateFn = Callable[[list[str]], Sequence[Sequence[str]]]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021, Codex).

    pass@k = 1 - C(n - c, k) / C(n, k), computed as a product so large ``n`` does not overflow.
    """
    for value, name in ((n, "n"), (c, "c"), (k, "k")):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if n < k:
        raise ValueError(f"n={n} samples cannot estimate pass@{k}; need n >= k")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got {c}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def _rewards_2d(rewards: Any) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2 or r.shape[0] == 0 or r.shape[1] == 0:
        raise ValueError(f"rewards must have shape [num_prompts, k] with both > 0, got {r.shape}")
    return r


def avg_at_k(rewards: Any) -> float:
    """Mean reward over k samples per prompt, averaged over prompts. ``rewards``: [P, k]."""
    return float(_rewards_2d(rewards).mean())


def pass1(rewards: Any) -> float:
    """pass@1: the mean reward over all samples (the unbiased estimator c/n, per prompt averaged).

    For 0/1 rewards this equals `avg_at_k`; it is kept as a name of its own for logging.
    """
    return float(_rewards_2d(rewards).mean())


def mean_pass_at_k(rewards: Any, k: int) -> float:
    """Unbiased pass@k averaged over prompts; ``rewards`` is [P, n] with n >= k samples each."""
    r = _rewards_2d(rewards)
    correct = (r > 0.5).sum(axis=1)
    return float(np.mean([pass_at_k(r.shape[1], int(c), k) for c in correct]))


def evaluate(
    generate_fn: GenerateFn,
    source: Any,
    k: int,
    *,
    num_prompts: int | None = None,
    batch_size: int | None = None,
    reward_fn: Callable[[str, Example], float] | None = None,
) -> dict[str, float]:
    """Samples ``k`` completions per prompt, scores them and returns the metrics.

    Args:
      generate_fn: maps a list of prompt strings to, for each prompt, a list of ``k`` completion
        strings (decoded text).
      source: a `PromptSource` (or any sequence of example dicts, then ``reward_fn`` is needed).
      k: completions per prompt.
      num_prompts: evaluate the first ``num_prompts`` examples (default: all).
      batch_size: prompts per ``generate_fn`` call (default: all at once).
      reward_fn: ``(completion, example) -> float``; default ``source.reward``.

    Returns:
      ``{"pass@1": ..., f"avg@{k}": ..., f"pass@{k}": ..., "n": num_prompts, "k": k}``, and
      ``f"pass@1/{level}"`` for each difficulty level when the examples carry a ``"level"``
      (the built-in tasks' mixtures), over that level's evaluated prompts.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    size = len(source)
    if num_prompts is None:
        num_prompts = size
    if not 1 <= num_prompts <= size:
        raise ValueError(f"num_prompts must be in [1, {size}] (the source size), got {num_prompts}")
    if batch_size is None:
        batch_size = num_prompts
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if reward_fn is None:
        if not hasattr(source, "reward"):
            raise ValueError("source has no reward method; pass reward_fn")
        reward_fn = source.reward
    rewards = np.zeros((num_prompts, k), dtype=np.float64)
    levels: list[Any] = []
    for start in range(0, num_prompts, batch_size):
        examples = [source[i] for i in range(start, min(start + batch_size, num_prompts))]
        levels += [ex.get("level") if isinstance(ex, dict) else None for ex in examples]
        outputs = generate_fn([ex["prompt"] for ex in examples])
        if len(outputs) != len(examples):
            raise ValueError(
                f"generate_fn returned {len(outputs)} results for {len(examples)} prompts"
            )
        for j, (ex, completions) in enumerate(zip(examples, outputs, strict=True)):
            if isinstance(completions, str) or len(completions) != k:
                got = "a str" if isinstance(completions, str) else f"{len(completions)}"
                raise ValueError(
                    f"generate_fn returned {got} completions for prompt {start + j}; expected "
                    f"a list of k={k} strings"
                )
            for s, text in enumerate(completions):
                value = float(reward_fn(text, ex))
                if not math.isfinite(value):
                    raise ValueError(f"reward of prompt {start + j}, sample {s} is {value}")
                rewards[start + j, s] = value
    out = {
        "pass@1": pass1(rewards),
        f"avg@{k}": avg_at_k(rewards),
        f"pass@{k}": mean_pass_at_k(rewards, k),
        "n": num_prompts,
        "k": k,
    }
    if any(level is not None for level in levels):
        names = np.array([str(level) for level in levels])
        for name in sorted(set(names)):
            out[f"pass@1/{name}"] = pass1(rewards[names == name])
    return out
