"""Fully asynchronous rollouts (``lag_mode="stream"``): a worker thread decodes while the trainer
trains, swaps in new weights between decode chunks, and hands finished batches over a bounded
queue.

Each token records the version that produced it, so a response decoded across a weight swap
carries two versions (N_PQS > 0), and a batch that waits in the queue ages (N_IQS > 0): the two
terms of Eq. (25), measured rather than configured. Stream runs are not bit-reproducible (thread
timing decides where swaps land); use ``fixed`` or ``broadcast`` for exact lag.

Retention: the worker always decodes with the newest version and holds its own reference to it,
so the store keeps only the newest version, plus, when the loss recomputes the behaviour policy,
the version each unconsumed batch started from (its oldest token's version): at most
``queue_size + 1`` batches are unconsumed (queued, or finished and waiting for a free slot), so
the store never holds more than ``queue_size + 2``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from sat_jax.rl import rng
from sat_jax.rl.rollout import RolloutEngine
from sat_jax.rl.rollout_sources import Rollout
from sat_jax.rl.snapshots import SnapshotStore


class StreamRollouts:
    """A rollout worker thread feeding a bounded queue of scored batches (a rollout source).

    Args:
      engine: builds and scores rollouts.
      prompts: iterator of prompt-example lists (owned by the worker once started).
      seed: the run's seed; batch i uses ``rng.key(seed, "stream", i)``.
      queue_size: finished batches that may wait (the queue's bound: back-pressure beyond it).
      chunk: decode steps between checks for a newer weight version.
      first_index: index of the first batch (the resumed step).
      needs_old: hand each batch's behaviour version (the one it started from) to the trainer.
      placement: the store's ``"device"`` or ``"host"``.
      view: maps stored parameters to the copy the engine samples from.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        prompts: Iterator,
        seed: int,
        *,
        queue_size: int = 2,
        chunk: int = 2,
        first_index: int = 0,
        needs_old: bool = False,
        placement: str = "device",
        view: Callable[[Any], Any] = lambda params: params,
    ):
        if queue_size < 1 or chunk < 1:
            raise ValueError(f"queue_size and chunk must be >= 1, got {queue_size}, {chunk}")
        self.engine, self.prompts, self.seed = engine, prompts, seed
        self.chunk, self.needs_old, self.view = chunk, needs_old, view
        self.store = SnapshotStore(queue_size + 2 if needs_old else 1, placement)
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()  # a version picked by the worker is pinned atomically
        self._pinned: dict[int, int] = {}  # batch index -> version it started from
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._index = first_index
        self.swaps = 0
        self._thread = threading.Thread(target=self._run, name="sat-jax-rollout", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _latest(self, pin: int | None = None):
        with self._lock:
            version, params = self.store.latest()
            if pin is not None:
                self._pinned[pin] = version
        return version, self.view(params)

    def _run(self):
        try:
            sampler = self.engine.sampler
            while not self._stop.is_set():
                examples = next(self.prompts)
                index = self._index
                version, params = self._latest(pin=index)
                state = self.engine.start(params, examples, rng.key(self.seed, "stream", index))
                while not sampler.is_done(state):
                    state = sampler.decode(params, state, num_steps=self.chunk, version=version)
                    if self.store.latest_version() > version:  # weights swapped mid-decode
                        version, params = self._latest()
                        self.swaps += 1
                batch = self.engine.score(examples, sampler.finalize(state))
                self._index += 1
                while not self._stop.is_set():
                    try:
                        self.queue.put((index, batch), timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # surfaced to the trainer by next()
            self._error = e

    def _get(self, timeout: float):
        deadline = time.time() + timeout
        while True:
            if self._error is not None:
                raise RuntimeError("the rollout worker failed") from self._error
            try:
                return self.queue.get(timeout=0.1)
            except queue.Empty:
                if time.time() > deadline:
                    raise TimeoutError(f"no rollout batch within {timeout} s") from None

    def next(self, step: int, timeout: float = 600.0) -> Rollout:
        """The oldest finished batch; re-raises a worker failure."""
        t0 = time.perf_counter()
        index, batch = self._get(timeout)
        wait = time.perf_counter() - t0
        with self._lock:
            started = self._pinned.pop(index)
            behaviour = {"old": self.store.get(started)} if self.needs_old else {}
        metrics = {
            "time/rollout_s": wait,
            "time/queue_wait_s": wait,
            "stream/swaps": float(self.swaps),
            **self.store.memory(),
        }
        return Rollout(batch, behaviour, metrics, None)

    def publish(self, version: int, params: Any) -> None:
        with self._lock:
            keep = set(self._pinned.values()) if self.needs_old else set()
            self.store.put(version, params, keep=keep)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
