"""Fully asynchronous rollouts (``lag_mode="stream"``): a worker thread decodes while the trainer
trains, swaps in new weights between decode chunks, and hands finished batches over a bounded
queue.

Each token records the version that produced it, so a response decoded across a weight swap
carries two versions (N_PQS > 0), and a batch that waits in the queue ages (N_IQS > 0): the two
terms of Eq. (25), measured rather than configured. Stream runs are not bit-reproducible (thread
timing decides where swaps land); use ``fixed`` or ``broadcast`` for exact lag.

With the static engine (``Sampler``) the worker decodes one batch at a time and checks for new
weights every ``chunk`` decode steps. With the continuous engine (``ContinuousSampler``) it keeps
the decode slots full from the prompt iterator, swaps weights at harvest points (every
``harvest_every`` steps), and a batch is the next ``len(examples)`` prompts whose groups finish,
in the order they finish: partial rollouts cross swaps, as in the paper's fully asynchronous
regime.

Retention: the worker always decodes with the newest version and holds its own reference to it,
so the store keeps only the newest version, plus, when the loss recomputes the behaviour policy,
the version each unconsumed batch started from (its oldest token's version): at most
``queue_size + 1`` batches are unconsumed (queued, or finished and waiting for a free slot), so
the store never holds more than ``queue_size + 2``; the continuous engine's groups still in its
slots pin the version they were admitted with, at most ``num_slots // group_size`` more.
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
from sat_jax.sampling import ContinuousSampler, concat_outputs


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
        sampler = engine.sampler
        in_slots = (
            sampler.num_slots // sampler.group_size if isinstance(sampler, ContinuousSampler) else 0
        )
        self.store = SnapshotStore(queue_size + 2 + in_slots if needs_old else 1, placement)
        self._group_pins: dict[int, int] = {}  # prompt id in the slots -> version it started from
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()  # a version picked by the worker is pinned atomically
        self._pinned: dict[int, int] = {}  # batch index -> version it started from
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._index = first_index
        self.swaps = 0
        self.slot_use: float | None = None  # continuous engine: live share of slot-steps
        self._thread = threading.Thread(target=self._run, name="sat-jax-rollout", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _latest(self, pin: int | None = None, pins: dict | None = None):
        """The newest version and its view, pinned as ``pins[pin]`` (``_pinned``) atomically."""
        with self._lock:
            version, params = self.store.latest()
            if pin is not None:
                (self._pinned if pins is None else pins)[pin] = version
        return version, self.view(params)

    def _run(self):
        try:
            if isinstance(self.engine.sampler, ContinuousSampler):
                self._run_continuous()
            else:
                self._run_static()
        except BaseException as e:  # surfaced to the trainer by next()
            self._error = e

    def _run_static(self):
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
            self._put(index, batch)

    def _put(self, index: int, batch) -> None:
        while not self._stop.is_set():
            try:
                self.queue.put((index, batch), timeout=0.1)
                break
            except queue.Full:
                continue

    def _run_continuous(self):
        """Slots kept full; a batch is the next ``len(examples)`` groups to finish."""
        engine, sampler = self.engine, self.engine.sampler
        g = engine.group_size
        run = sampler.session(rng.key(self.seed, "stream", self._index), engine.sampling)
        next_id, per_batch, done = 0, None, []
        # Key -1 pins the version the slots decode with until the groups it admits pin it.
        version, params = self._latest(pin=-1, pins=self._group_pins)
        while not self._stop.is_set():
            while run.waiting < sampler.num_slots // g:  # enough to refill every slot
                examples = next(self.prompts)
                per_batch = per_batch or len(examples)
                ids, lengths = engine.encode(examples)
                run.add(
                    ids[::g],
                    lengths[::g],
                    prompt_ids=range(next_id, next_id + len(examples)),
                    tags=examples,
                )
                next_id += len(examples)
            if self.store.latest_version() > version:  # weights swapped at a harvest point
                version, params = self._latest(pin=-1, pins=self._group_pins)
                self.swaps += 1
            finished = run.advance(params, version)
            with self._lock:  # groups admitted by this window started from ``version``
                for pid in run.decoding + [grp.prompt_id for grp in finished]:
                    self._group_pins.setdefault(pid, version)
            done += finished
            while len(done) >= per_batch:
                groups, done = done[:per_batch], done[per_batch:]
                with self._lock:
                    started = min(self._group_pins.pop(grp.prompt_id) for grp in groups)
                    self._pinned[self._index] = started
                out = concat_outputs([grp.output for grp in groups])
                batch = engine.score([grp.tag for grp in groups], out)
                self.slot_use = run.live_steps / max(run.slot_steps, 1)
                self._index += 1
                self._put(self._index - 1, batch)

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
            **({"stream/slot_use": self.slot_use} if self.slot_use is not None else {}),
            **self.store.memory(),
        }
        return Rollout(batch, behaviour, metrics, None)

    def publish(self, version: int, params: Any) -> None:
        with self._lock:
            keep = set(self._pinned.values()) | set(self._group_pins.values())
            keep = keep if self.needs_old else set()
            self.store.put(version, params, keep=keep)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
