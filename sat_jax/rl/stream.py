"""Fully asynchronous rollouts (``lag_mode="stream"``): a worker thread decodes while the trainer
trains, swaps in new weights between decode chunks, and hands finished batches over a bounded
queue.

Each token records the version that produced it, so a response decoded across a weight swap
carries two versions (N_PQS > 0), and a batch that waits in the queue ages (N_IQS > 0): the two
terms of Eq. (25), measured rather than configured. Stream runs are not bit-reproducible (thread
timing decides where swaps land); use ``fixed`` or ``broadcast`` for exact lag.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import jax

from sat_jax.rl.rollout import RolloutEngine
from sat_jax.rl.snapshots import SnapshotStore


class StreamRollouts:
    """A rollout worker thread feeding a bounded queue of scored batches.

    Args:
      engine: builds and scores rollouts.
      store: parameter snapshots; the worker always decodes with the newest version.
      prompts: iterator of prompt-example lists (owned by the worker once started).
      key: base PRNG key; batch i uses ``fold_in(key, i)``.
      queue_size: finished batches that may wait (the queue's bound: back-pressure beyond it).
      chunk: decode steps between checks for a newer weight version.
    """

    def __init__(self, engine: RolloutEngine, store: SnapshotStore, prompts: Iterator,
                 key: jax.Array, *, queue_size: int = 2, chunk: int = 2, first_index: int = 0,
                 view=lambda params: params):
        if queue_size < 1 or chunk < 1:
            raise ValueError(f"queue_size and chunk must be >= 1, got {queue_size}, {chunk}")
        self.engine, self.store, self.prompts, self.key = engine, store, prompts, key
        self.chunk = chunk
        self.view = view  # e.g. parallel.local_view: sample from this process's own copy
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._index = first_index
        self.swaps = 0
        self.compute_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="sat-jax-rollout", daemon=True)

    def start(self) -> StreamRollouts:
        self._thread.start()
        return self

    def _run(self):
        try:
            sampler = self.engine.sampler
            while not self._stop.is_set():
                examples = next(self.prompts)
                version, params = self.store.latest()
                params = self.view(params)
                t0 = time.perf_counter()
                state = self.engine.start(params, examples, jax.random.fold_in(self.key,
                                                                               self._index))
                while not sampler.is_done(state):
                    state = sampler.decode(params, state, num_steps=self.chunk, version=version)
                    if self.store.latest_version() > version:  # weights swapped mid-decode
                        version, params = self.store.latest()
                        params = self.view(params)
                        self.swaps += 1
                out = sampler.finalize(state)
                jax.block_until_ready(out.tokens)
                self.compute_seconds += time.perf_counter() - t0
                batch = self.engine.score(examples, out)
                batch["enqueue_time"] = time.time()
                self._index += 1
                while not self._stop.is_set():
                    try:
                        self.queue.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # surfaced to the trainer by get()
            self._error = e

    def get(self, timeout: float = 600.0) -> dict:
        """The next finished batch; re-raises a worker failure."""
        deadline = time.time() + timeout
        while True:
            if self._error is not None:
                raise RuntimeError("the rollout worker failed") from self._error
            try:
                return self.queue.get(timeout=0.1)
            except queue.Empty:
                if time.time() > deadline:
                    raise TimeoutError(f"no rollout batch within {timeout} s") from None

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=60)
