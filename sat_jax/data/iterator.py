"""A resumable, shardable batch iterator over a `PromptSource`.

Global batches are fixed by (seed, epoch) alone: epoch ``e`` visits the examples in the order
``default_rng([seed, e]).permutation(n)`` (or ``0..n-1`` without shuffle) and cuts it into
``n // batch_size`` full batches; the last ``n % batch_size`` examples of that order are left out
of the epoch, so every batch has the same shape (a new order each epoch gives them their turn).
Process ``p`` of ``P`` receives rows ``[p * batch_size / P, (p + 1) * batch_size / P)`` of each
global batch, so concatenating the per-process batches in process order gives the global batch.

The state is the global position only, so a run may resume with a different process count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sat_jax.data.prompt_sources import PromptSource
from sat_jax.data.tasks import Example


def _check_int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class PromptIterator:
    """Endless iterator of prompt batches, epoch after epoch, with exact resume.

    Args:
      source: the examples (any `PromptSource`, or a sequence of example dicts).
      batch_size: GLOBAL batch size (prompts per step over all processes); must divide evenly
        among processes and be at most ``len(source)``.
      seed: non-negative int fixing every epoch's order.
      shuffle: reshuffle each epoch; False keeps source order.
      process_index, process_count: this process's shard (e.g. ``jax.process_index()``,
        ``jax.process_count()``).

    ``next(it)`` returns this process's ``batch_size // process_count`` examples (dicts).

    Example::

        it = PromptIterator(TaskSource(AdditionTask()), batch_size=16, seed=0)
        batch = next(it)                 # 16 example dicts
        saved = it.state()               # {"epoch": 0, "position": 1, "seed": 0, ...}
        it2 = PromptIterator(TaskSource(AdditionTask()), batch_size=16, seed=0)
        it2.restore(saved)               # next(it2) == next(it)
    """

    def __init__(
        self,
        source: PromptSource,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        process_index: int = 0,
        process_count: int = 1,
    ):
        self.source = source
        self.num_examples = len(source)
        if self.num_examples == 0:
            raise ValueError("source is empty")
        self.batch_size = _check_int(batch_size, "batch_size", 1)
        self.seed = _check_int(seed, "seed", 0)
        self.process_count = _check_int(process_count, "process_count", 1)
        self.process_index = _check_int(process_index, "process_index", 0)
        if self.process_index >= self.process_count:
            raise ValueError(
                f"process_index={process_index} must be < process_count={process_count}"
            )
        if self.batch_size > self.num_examples:
            raise ValueError(
                f"batch_size={batch_size} is larger than the source ({self.num_examples} "
                f"examples in {getattr(source, 'name', type(source).__name__)!r})"
            )
        if self.batch_size % self.process_count:
            raise ValueError(
                f"batch_size={batch_size} (global) must be divisible by "
                f"process_count={process_count}"
            )
        self.shuffle = bool(shuffle)
        self.local_batch_size = self.batch_size // self.process_count
        self.batches_per_epoch = self.num_examples // self.batch_size
        self.epoch = 0
        self.position = 0  # global batches already produced in the current epoch
        self._order_epoch: int | None = None
        self._order: np.ndarray | None = None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, epoch])
                self._order = rng.permutation(self.num_examples)
            else:
                self._order = np.arange(self.num_examples)
            self._order_epoch = epoch
        return self._order

    def global_indices(self) -> np.ndarray:
        """Source indices of the next global batch (all processes), without advancing."""
        epoch, position = self.epoch, self.position
        if position >= self.batches_per_epoch:
            epoch, position = epoch + 1, 0
        start = position * self.batch_size
        return self._epoch_order(epoch)[start : start + self.batch_size]

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> list[Example]:
        indices = self.global_indices()
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        self.position += 1
        lo = self.process_index * self.local_batch_size
        return [self.source[int(i)] for i in indices[lo : lo + self.local_batch_size]]

    def state(self) -> dict[str, Any]:
        """JSON-serialisable position: epoch, batches done in it, seed and the shape it assumes."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_examples": self.num_examples,
            "shuffle": self.shuffle,
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continues from ``state`` (from `state`), so the next batch is the one that followed it.

        Raises:
          ValueError: a missing key, or a state saved with another batch size, source size or
            shuffle setting (its positions would mean different examples).
        """
        for key in ("epoch", "position", "seed"):
            if key not in state:
                raise ValueError(f"state has no {key!r} key: {dict(state)!r}")
        for key, mine in (
            ("batch_size", self.batch_size),
            ("num_examples", self.num_examples),
            ("shuffle", self.shuffle),
        ):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"state was saved with {key}={state[key]!r}, but this iterator has "
                    f"{key}={mine!r}"
                )
        epoch = _check_int(state["epoch"], "state['epoch']", 0)
        position = _check_int(state["position"], "state['position']", 0)
        if position > self.batches_per_epoch:
            raise ValueError(
                f"state['position']={position} exceeds the {self.batches_per_epoch} batches "
                "of an epoch"
            )
        self.seed = _check_int(state["seed"], "state['seed']", 0)
        self.epoch, self.position = epoch, position
        self._order_epoch = None
