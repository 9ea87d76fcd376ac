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

Resuming: :meth:`StreamRollouts.state` gives every finished batch not yet trained on (the
queued ones and one waiting for a slot), with its per-token versions and the version it started
from, plus the prompt iterator's position before the batch being decoded; the store's state
(saved beside it) holds the versions those batches need. :meth:`StreamRollouts.restore` puts
them back in order, so a resumed run trains on exactly the batches the interrupted one had
finished. A batch still being decoded is discarded, and counted: its prompts are drawn again,
with the same key, after the resume. With the continuous engine the groups still in its slots
are discarded and counted instead, and the prompts they came from are not drawn again (the
iterator resumes after the last prompt drawn).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from sat_jax.rl import rng
from sat_jax.rl.batch import RolloutBatch
from sat_jax.rl.rollout import RolloutEngine
from sat_jax.rl.rollout_sources import Rollout, prompt_position, restore_position
from sat_jax.rl.snapshots import SnapshotStore
from sat_jax.sampling import ContinuousSampler, concat_outputs

_log = logging.getLogger(__name__)


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
      timeout: seconds :meth:`next` waits for a batch (the first wait includes the worker's
        compilation); ``rollout.stream_timeout_s`` in a run's config.
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
        timeout: float = 600.0,
    ):
        if queue_size < 1 or chunk < 1:
            raise ValueError(f"queue_size and chunk must be >= 1, got {queue_size}, {chunk}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.timeout = float(timeout)
        self.engine, self.prompts, self.seed = engine, prompts, seed
        self.chunk, self.needs_old, self.view = chunk, needs_old, view
        sampler = getattr(engine, "sampler", None)
        self._continuous = isinstance(sampler, ContinuousSampler)
        in_slots = sampler.num_slots // sampler.group_size if self._continuous else 0
        self.store = SnapshotStore(queue_size + 2 + in_slots if needs_old else 1, placement)
        self._group_pins: dict[int, int] = {}  # prompt id in the slots -> version it started from
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()  # a version picked by the worker is pinned atomically
        self._pinned: dict[int, int] = {}  # batch index -> version it started from
        self._drawn_at: dict[int, Any] = {}  # batch index -> prompt position before its draw
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._index = first_index
        # Under _lock: the batch being decoded (index, prompt position before its draw), and a
        # finished one waiting for a free slot.
        self._inflight: tuple[int, Any] | None = None
        self._finished: tuple[int, RolloutBatch] | None = None
        self._groups_in_flight = 0  # continuous engine: drawn groups not yet in a batch
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
            if self._continuous:
                self._run_continuous()
            else:
                while not self._stop.is_set():
                    if self._finished is None:  # else one restored from a checkpoint goes first
                        self._produce()
                    self._hand_over()
        except BaseException as e:  # surfaced to the trainer by next()
            self._error = e

    def _produce(self) -> None:
        """Static engine: decodes the next batch, swapping weights between decode chunks."""
        sampler = self.engine.sampler
        with self._lock:
            index, before = self._index, prompt_position(self.prompts)
            examples = next(self.prompts)
            self._inflight, self._drawn_at[index] = (index, before), before
        version, params = self._latest(pin=index)
        state = self.engine.start(params, examples, rng.key(self.seed, "stream", index))
        while not sampler.is_done(state):
            state = sampler.decode(params, state, num_steps=self.chunk, version=version)
            if self.store.latest_version() > version:  # weights swapped mid-decode
                version, params = self._latest()
                self.swaps += 1
        batch = self.engine.score(examples, sampler.finalize(state))
        with self._lock:
            self._inflight, self._finished = None, (index, batch)
            self._index += 1

    def _hand_over(self) -> None:
        """Moves the finished batch into the queue once it has room (back-pressure)."""
        while not self._stop.is_set():
            with self._lock:  # in the queue or waiting, never both, for state()
                try:
                    self.queue.put_nowait(self._finished)
                    self._finished = None
                    return
                except queue.Full:
                    pass
            time.sleep(0.01)

    def _run_continuous(self):
        """Slots kept full; a batch is the next ``len(examples)`` groups to finish. Prompts are
        drawn and batches handed over under the lock, so :meth:`state` sees every drawn
        group either in a finished batch or still in the slots."""
        if self._finished is not None:  # restored from a checkpoint: it goes first
            self._hand_over()
        engine, sampler = self.engine, self.engine.sampler
        g = engine.group_size
        run = sampler.session(rng.key(self.seed, "stream", self._index), engine.sampling)
        next_id, per_batch, done = 0, None, []
        # Key -1 pins the version the slots decode with until the groups it admits pin it.
        version, params = self._latest(pin=-1, pins=self._group_pins)
        while not self._stop.is_set():
            while run.waiting < sampler.num_slots // g:  # enough to refill every slot
                with self._lock:
                    examples = next(self.prompts)
                    self._groups_in_flight += len(examples)
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
                out = concat_outputs([grp.output for grp in groups])
                batch = engine.score([grp.tag for grp in groups], out)
                self.slot_use = run.live_steps / max(run.slot_steps, 1)
                with self._lock:
                    started = min(self._group_pins.pop(grp.prompt_id) for grp in groups)
                    self._pinned[self._index] = started
                    self._finished = (self._index, batch)
                    self._groups_in_flight -= len(groups)
                    self._index += 1
                self._hand_over()

    def _get(self, timeout: float):
        deadline = time.time() + timeout
        while True:
            if self._error is not None:
                raise RuntimeError("the rollout worker failed") from self._error
            try:
                return self.queue.get(timeout=0.1)
            except queue.Empty:
                if time.time() > deadline:
                    raise TimeoutError(
                        f"no rollout batch within {timeout} s (rollout.stream_timeout_s; the "
                        "first wait includes the rollout worker's compilation)"
                    ) from None

    def next(self, step: int, timeout: float | None = None) -> Rollout:
        """The oldest finished batch; re-raises a worker failure. ``timeout``: seconds to wait
        (default: the source's ``timeout``)."""
        t0 = time.perf_counter()
        index, batch = self._get(self.timeout if timeout is None else timeout)
        wait = time.perf_counter() - t0
        with self._lock:
            started = self._pinned.pop(index)
            self._drawn_at.pop(index, None)
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

    def state(self, batches: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(arrays, meta)`` of the finished batches not yet trained on, oldest first: arrays
        ``{str(index): {field: np.ndarray}}``, meta ``{"queued": [{"index", "started",
        "fields": {field: [shape, dtype]}}], "next_index", "iterator", "inflight",
        "inflight_groups"}`` (the prompt position and index the worker resumes from, how many
        partial batches that discards, and, with the continuous engine, how many groups still in
        its slots). Call from the trainer's thread, between steps; the worker keeps running.

        ``batches=False`` keeps no batch: the position is the one the oldest untrained batch
        drew from, and every untrained batch is counted as discarded (for runs whose host
        batches cannot be saved, e.g. one per process of a multi-host run)."""
        with self._lock:
            items = sorted(
                list(self.queue.queue) + ([self._finished] if self._finished else []),
                key=lambda item: item[0],
            )
            started = {i: self._pinned[i] for i, _ in items}
            if self._inflight is not None:
                (next_index, position), inflight = self._inflight, 1
            else:
                next_index, position, inflight = self._index, prompt_position(self.prompts), 0
            if not batches and items:
                if not self._continuous:  # redraw from the oldest untrained batch's prompts
                    next_index, position = items[0][0], self._drawn_at[items[0][0]]
                inflight, items = inflight + len(items), []
            inflight_groups = self._groups_in_flight if self._continuous else 0
        arrays = {str(i): dataclasses.asdict(batch) for i, batch in items}
        queued = [
            {
                "index": i,
                "started": started[i],
                "fields": {
                    k: [list(np.shape(v)), np.asarray(v).dtype.str]
                    for k, v in arrays[str(i)].items()
                },
            }
            for i, _ in items
        ]
        meta = {
            "queued": queued,
            "next_index": next_index,
            "iterator": position,
            "inflight": inflight,
            "inflight_groups": inflight_groups,
        }
        return arrays, meta

    @staticmethod
    def restore_target(meta: dict[str, Any]) -> dict[str, Any]:
        """The ``arrays`` structure of :meth:`state` for ``meta``, to restore into."""
        return {
            str(q["index"]): {
                k: np.zeros(shape, np.dtype(dtype)) for k, (shape, dtype) in q["fields"].items()
            }
            for q in meta.get("queued", ())
        }

    def restore(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        """Puts the prompt position and batches of :meth:`state` back, before :meth:`start`; the
        store must hold the versions it had."""
        if self._thread.is_alive():
            raise RuntimeError("restore() must come before start()")
        restore_position(self.prompts, meta.get("iterator"))
        queued = meta.get("queued", [])
        items = [
            (
                q["index"],
                RolloutBatch(**{k: np.asarray(v) for k, v in arrays[str(q["index"])].items()}),
            )
            for q in queued
        ]
        with self._lock:
            self._index = int(meta.get("next_index", self._index))
            self._pinned = {q["index"]: q["started"] for q in queued}
            for item in items[: self.queue.maxsize]:
                self.queue.put_nowait(item)
            rest = items[self.queue.maxsize :]
            if len(rest) > 1:
                raise ValueError(
                    f"{len(items)} saved batches exceed the queue of {self.queue.maxsize} and "
                    "one waiting batch: resume with the lag the run was saved with"
                )
            self._finished = rest[0] if rest else None
        if meta.get("inflight_groups"):
            _log.warning(
                "stream resume: discarded %d group(s) still in the continuous engine's slots "
                "(partial rollouts; their prompts are not drawn again)",
                meta["inflight_groups"],
            )
        if meta.get("inflight"):
            _log.warning(
                "stream resume: discarded %d rollout batch(es) the checkpoint did not keep "
                "(from batch %d on, partial or not saved; their prompts are drawn again); %d "
                "finished batch(es) restored",
                meta["inflight"],
                self._index,
                len(items),
            )

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
