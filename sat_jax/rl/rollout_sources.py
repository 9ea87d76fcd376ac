"""Where the trainer's batches come from: one interface, two implementations.

A rollout source owns the lag schedule, the :class:`SnapshotStore` and its retention. The loop
asks it for the batch of step j (:meth:`RolloutSource.next`, which also hands over the behaviour
parameters the loss needs) and tells it about each new parameter version
(:meth:`RolloutSource.publish`); everything about which version samples which batch, and which
versions must stay in memory for that, lives behind these two calls. A checkpoint keeps the
source's store and :meth:`RolloutSource.state` (the prompt position to resume from, and any
batches the source holds), and :meth:`RolloutSource.restore` puts them back.

* :class:`ScheduledRollouts` — the synchronous ``fixed`` and ``broadcast`` modes
  (``sat_jax.rl.lag``): batch j is sampled by ``schedule.version_for(j)``, exactly; and
  ``sampled``: each group of batch j by its own ``schedule.group_versions(j, ...)``, exactly.
* :class:`sat_jax.rl.stream.StreamRollouts` — ``stream``: a worker thread decodes with the newest
  version, swapping weights mid-decode.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import jax
import numpy as np

from sat_jax.rl import rng
from sat_jax.rl.batch import RolloutBatch
from sat_jax.rl.lag import LagSchedule
from sat_jax.rl.rollout import RolloutEngine
from sat_jax.rl.snapshots import SnapshotStore


@dataclasses.dataclass(frozen=True)
class Rollout:
    """A scored batch and what the trainer step needs besides it.

    Attributes:
      batch: the host batch.
      behaviour: ``{"old": params}`` (the behaviour version, for a recompute of log μ̃) when the
        loss needs it, else empty.
      metrics: the source's own logs (rollout and queue times, weight swaps, snapshot memory).
      compiled_seconds: wall time spent inside compiled rollout computations; ``None`` when they
        run on another thread (stream mode).
    """

    batch: RolloutBatch
    behaviour: dict[str, Any]
    metrics: dict[str, float]
    compiled_seconds: float | None


class RolloutSource(Protocol):
    """The interface the training loop sees (see the module docstring)."""

    store: SnapshotStore

    def start(self) -> None:
        """Begins producing batches (after the store holds its restored or initial versions)."""

    def next(self, step: int) -> Rollout:
        """The scored batch trainer step ``step`` consumes."""

    def publish(self, version: int, params: Any) -> None:
        """Records ``params`` as ``version`` and drops the versions no later batch needs."""

    def state(self, batches: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(arrays, meta)`` a checkpoint keeps besides the store, from the trainer's thread
        between steps: host arrays (the batches the source holds; none with ``batches=False``,
        for runs whose host batches cannot be saved) and JSON, whose ``"iterator"`` is the prompt
        position a resumed run draws from next."""

    @staticmethod
    def restore_target(meta: dict[str, Any]) -> dict[str, Any]:
        """The structure of the ``arrays`` :meth:`state` returned with ``meta``, to restore
        into."""

    def restore(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        """Back to what :meth:`state` returned, before :meth:`start`: the prompt iterator at
        ``meta["iterator"]`` and any saved batches; the store is loaded separately."""

    def close(self) -> None:
        """Stops any worker."""


def prompt_position(prompts) -> Any:
    """The prompt iterator's resumable position (``None`` for a plain iterator)."""
    state = getattr(prompts, "state", None)
    return state() if callable(state) else None


def restore_position(prompts, position) -> None:
    """Puts the prompt iterator at ``position`` (nothing for a plain iterator or ``None``)."""
    restore = getattr(prompts, "restore", None)
    if position is not None and callable(restore):
        restore(position)


class ScheduledRollouts:
    """``fixed`` / ``broadcast``: batch j is sampled by ``schedule.version_for(j)`` on the caller's
    thread, with the key ``rng.key(seed, "rollout", j, process)``.

    ``sampled``: the groups of batch j are sampled by their own versions
    ``schedule.group_versions(j, groups, seed)`` (drawn over the global batch; each process takes
    its share). The groups of one version form one batch keyed
    ``rng.key(seed, "rollout", j, process, version)``, padded with repeats of its last group to
    a power of two (so the engine compiles for at most log₂ of the prompts per step + 1 batch
    sizes; the repeats are dropped), and the batch is reassembled in prompt order. Each token's
    version is the version of the snapshot that decoded it. An engine that ``vmaps_versions``
    decodes the versions' batches (each padded to the largest, their number to a power of two)
    in one ``vmap``'d call, each with its own snapshot and key; otherwise each is its own
    decode. ``rollout/versions`` logs the number of distinct versions in the batch.

    The store keeps exactly ``schedule.needed_after(j)`` plus the newest version, which is never
    more than ``schedule.capacity`` (k + 1 for fixed lag k, 2 for broadcast, C + 1 for sampled
    with cap C).

    Args:
      engine: samples and scores.
      schedule: a ``fixed`` or ``broadcast`` :class:`LagSchedule`.
      prompts: iterator of prompt-example lists (this process's share of each step).
      seed: the run's seed.
      needs_old: hand the behaviour version's parameters to the trainer.
      placement: the store's ``"device"`` or ``"host"``.
      view: maps stored parameters to the copy the engine samples from.
      decode_devices: sampled lag only: the devices a batch's behaviour versions are decoded
        on, in turn, all dispatched before any is read (None: the view's device, one version
        after another).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        schedule: LagSchedule,
        prompts: Iterator,
        seed: int,
        *,
        needs_old: bool,
        placement: str = "device",
        view: Callable[[Any], Any] = lambda params: params,
        decode_devices: Sequence[Any] | None = None,
    ):
        if schedule.mode == "stream":
            raise ValueError(
                "ScheduledRollouts needs a fixed or broadcast schedule; stream mode "
                "is sat_jax.rl.stream.StreamRollouts"
            )
        self.engine, self.schedule, self.prompts, self.seed = engine, schedule, prompts, seed
        self.needs_old, self.view = needs_old, view
        self.decode_devices = list(decode_devices) if decode_devices else None
        self.store = SnapshotStore(schedule.capacity, placement)

    def start(self) -> None:
        pass

    def newest_read(self, step: int) -> int:
        """The newest parameter version ``next(step)`` may sample from: batch ``step + 1`` can
        be rolled out while the trainer makes version ``step + 1`` when this is at most
        ``step`` (every lag ≥ 1; ``rollout.prefetch``)."""
        if self.schedule.mode == "sampled":  # lags are drawn from 1 … cap
            return max(step - 1, 0)
        return self.schedule.version_for(step)

    def position(self) -> Any:
        """Where the prompt iterator stands (``state``'s ``"iterator"``): saved before a
        prefetched ``next``, so a checkpoint taken while its batch waits resumes before it."""
        return prompt_position(self.prompts)

    def next(self, step: int) -> Rollout:
        if self.schedule.mode == "sampled":
            return self._next_sampled(step)
        version = self.schedule.version_for(step)
        examples = next(self.prompts)
        t0 = time.perf_counter()
        params = self.store.get(version)
        out = self.engine.generate(
            self.view(params),
            examples,
            rng.key(self.seed, "rollout", step, jax.process_index()),
            version,
        )
        jax.block_until_ready(out.tokens)
        generate_s = time.perf_counter() - t0
        batch = self.engine.score(examples, out)
        metrics = {
            "time/rollout_s": time.perf_counter() - t0,
            "time/queue_wait_s": 0.0,
            **self.store.memory(),
        }
        # Every token of batch j comes from version_for(j): that is the behaviour version.
        behaviour = {"old": params} if self.needs_old else {}
        return Rollout(batch, behaviour, metrics, generate_s)

    def _next_sampled(self, step: int) -> Rollout:
        examples = next(self.prompts)
        n, process = len(examples), jax.process_index()
        versions = self.schedule.group_versions(step, n * jax.process_count(), self.seed)
        versions = versions[process * n : (process + 1) * n]
        t0 = time.perf_counter()
        distinct = [int(v) for v in np.unique(versions)]
        groups = [np.flatnonzero(versions == v) for v in distinct]
        sizes = [min(1 << int(len(g) - 1).bit_length(), n) for g in groups]
        merged = self.engine.vmaps_versions
        if merged:  # one vmap'd decode: every version's batch padded to the largest
            sizes = [max(sizes)] * len(sizes)
        chosen = [
            [examples[i] for i in g] + [examples[g[-1]]] * (size - len(g))
            for g, size in zip(groups, sizes, strict=True)
        ]
        keys = [rng.key(self.seed, "rollout", step, process, v) for v in distinct]
        t1 = time.perf_counter()
        if merged:
            # The version axis padded to a power of two (≤ the prompts) with repeats of the last
            # version, whose outputs are dropped: few compiled shapes.
            pad = min(1 << (len(distinct) - 1).bit_length(), n) - len(distinct)
            params = [self.view(self.store.get(v)) for v in distinct]
            outs = self.engine.generate_versions(
                params + params[-1:] * pad,
                chosen + chosen[-1:] * pad,
                keys + keys[-1:] * pad,
                distinct + distinct[-1:] * pad,
            )[: len(distinct)]
        else:
            # With decode_devices, version i on device i mod k and every decode dispatched
            # before any is read: XLA runs one device's programs one at a time, but different
            # devices' at once.
            outs, devices = [], self.decode_devices
            for i, (v, examples_v, key) in enumerate(zip(distinct, chosen, keys, strict=True)):
                params = self.view(self.store.get(v))
                if devices:
                    params = jax.device_put(params, devices[i % len(devices)])
                outs.append(self.engine.generate(params, examples_v, key, v))
                if not devices:
                    jax.block_until_ready(outs[-1].tokens)
        jax.block_until_ready([out.tokens for out in outs])
        generate_s = time.perf_counter() - t1
        g = self.engine.group_size
        parts = [
            self.engine.score(examples_v, out).select(slice(0, len(rows) * g))
            for examples_v, out, rows in zip(chosen, outs, groups, strict=True)
        ]
        batch = _in_prompt_order(parts, np.concatenate(groups), g)
        metrics = {
            "time/rollout_s": time.perf_counter() - t0,
            "time/queue_wait_s": 0.0,
            "rollout/versions": float(len(parts)),
            **self.store.memory(),
        }
        return Rollout(batch, {}, metrics, generate_s)

    def publish(self, version: int, params: Any) -> None:
        self.store.put(version, params, keep=self.schedule.needed_after(version - 1))

    def state(self, batches: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
        # Batches are sampled on demand: the next step's prompts are the iterator's next ones.
        return {}, {"iterator": prompt_position(self.prompts)}

    @staticmethod
    def restore_target(meta: dict[str, Any]) -> dict[str, Any]:
        return {}

    def restore(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        restore_position(self.prompts, meta.get("iterator"))

    def close(self) -> None:
        pass


def _in_prompt_order(parts: list[RolloutBatch], order: np.ndarray, group_size: int):
    """One batch from per-version ``parts`` whose groups are the prompts ``order`` (in turn):
    the rows of prompt i end up at rows i·G … (i + 1)·G − 1, each field along its batch axis."""
    rank = np.argsort(order, kind="stable")
    rows = (rank[:, None] * group_size + np.arange(group_size)[None, :]).ravel()

    def field(name):
        axis = RolloutBatch.batch_axis(name)
        joined = np.concatenate([np.asarray(getattr(p, name)) for p in parts], axis=axis)
        return np.take(joined, rows, axis=axis)

    return RolloutBatch(**{name: field(name) for name in RolloutBatch.fields()})
