"""A bounded store of parameter versions: the rollout engine samples from these, never from the
trainer's live parameters, so asynchronous lag is reproduced exactly.

Which versions to keep is the lag mode's business (``sat_jax.rl.rollout_sources``): each ``put``
names the versions still needed, and the store drops the rest.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

_log = logging.getLogger(__name__)

PLACEMENTS = ("device", "host")
_HOST_KIND = "pinned_host"


def _host_copy(x):
    """``x`` in pinned host memory with its sharding kept, or a NumPy copy where the backend has
    no pinned host memory."""
    if isinstance(x, jax.Array):
        try:
            return jax.device_put(x, x.sharding.with_memory_kind(_HOST_KIND))
        except (ValueError, RuntimeError, NotImplementedError) as e:
            _warn_numpy_fallback(e)
    return np.asarray(jax.device_get(x))


_warned = False


def _warn_numpy_fallback(error) -> None:
    global _warned
    if not _warned:
        _log.warning(
            "this backend has no %r memory: host snapshots fall back to NumPy copies "
            "(resharded on every get) (%s)",
            _HOST_KIND,
            error,
        )
        _warned = True


def _device_copy(x):
    if isinstance(x, jax.Array) and x.sharding.memory_kind == _HOST_KIND:
        return jax.device_put(x, x.sharding.with_memory_kind("device"))
    return jax.device_put(x) if isinstance(x, np.ndarray) else x


def _bytes(tree) -> tuple[int, int]:
    """(device bytes, host bytes) held by this process for ``tree``: every addressable shard."""
    device = host = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            n = sum(s.data.nbytes for s in x.addressable_shards)
            if x.sharding.memory_kind in (_HOST_KIND, "unpinned_host"):
                host += n
            else:
                device += n
        else:
            host += np.asarray(x).nbytes
    return device, host


class SnapshotStore:
    """Versioned, immutable parameter snapshots, bounded in count.

    JAX arrays are immutable, so a device snapshot is a reference, not a copy: keeping version v
    costs one parameter set in device memory only after the trainer has moved past it (the
    newest version is the trainer's own parameters). With ``placement="host"`` snapshots are
    copied to pinned host memory with their sharding kept
    (``device_put(x, x.sharding.with_memory_kind("pinned_host"))``) and brought back on ``get``,
    which frees accelerator memory for long lags at the price of a transfer; on a backend without
    pinned host memory they are NumPy copies (a warning says so).

    Thread-safe: the stream mode's rollout thread reads while the trainer writes.

    Args:
      capacity: the most versions held at once; ``put`` evicts the oldest beyond it.
      placement: ``"device"`` or ``"host"``.
    """

    def __init__(self, capacity: int, placement: str = "device"):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        self.capacity = int(capacity)
        self.placement = placement
        self._versions: dict[int, Any] = {}
        self._bytes: dict[int, tuple[int, int]] = {}
        self._lock = threading.RLock()

    def _place(self, params):
        return jax.tree.map(_host_copy, params) if self.placement == "host" else params

    def put(self, version: int, params: Any, keep: Iterable[int] | None = None) -> None:
        """Adds ``params`` as ``version`` (versions only grow); then, when ``keep`` is given,
        drops every other version not in it, and beyond ``capacity`` the oldest."""
        version = int(version)
        params = self._place(params)
        with self._lock:
            if self._versions and version <= max(self._versions):
                raise ValueError(f"version {version} is not newer than {max(self._versions)}")
            self._versions[version] = params
            self._bytes[version] = _bytes(params)
            if keep is not None:
                self._drop(set(keep) | {version})
            while len(self._versions) > self.capacity:
                self._drop(set(self._versions) - {min(self._versions)})

    def _drop(self, keep: set[int]) -> None:
        for v in [v for v in self._versions if v not in keep]:
            del self._versions[v]
            del self._bytes[v]

    def get(self, version: int) -> Any:
        with self._lock:
            if version not in self._versions:
                raise KeyError(
                    f"parameter version {version} is not in the store (held: {self.versions()}); "
                    "raise the snapshot capacity or lower the lag"
                )
            params = self._versions[version]
        return jax.tree.map(_device_copy, params) if self.placement == "host" else params

    def latest(self) -> tuple[int, Any]:
        """``(version, params)`` of the newest version."""
        with self._lock:
            if not self._versions:
                raise KeyError("the snapshot store is empty")
            version = max(self._versions)
            return version, self.get(version)

    def latest_version(self) -> int:
        with self._lock:
            return max(self._versions) if self._versions else -1

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._versions)

    def retain(self, keep: Iterable[int]) -> None:
        """Evicts every version not in ``keep`` except the newest one."""
        with self._lock:
            if self._versions:
                self._drop(set(keep) | {max(self._versions)})

    def memory(self) -> dict[str, float]:
        """Bytes this process holds for the snapshots: per version (the newest) and in total, on
        device and in host memory, plus the number of versions."""
        with self._lock:
            device = sum(d for d, _ in self._bytes.values())
            host = sum(h for _, h in self._bytes.values())
            newest = self._bytes[max(self._bytes)] if self._bytes else (0, 0)
            return {
                "snapshots/versions": float(len(self._versions)),
                "snapshots/bytes_per_version": float(sum(newest)),
                "snapshots/device_bytes": float(device),
                "snapshots/host_bytes": float(host),
            }

    def state(self) -> dict[str, Any]:
        """{str(version): params} for checkpointing (host or device arrays)."""
        with self._lock:
            return {str(v): p for v, p in sorted(self._versions.items())}

    def load(self, state: dict[str, Any]) -> None:
        """Replaces the contents with ``state`` (as from :meth:`state`), placed as configured."""
        with self._lock:
            self._versions = {int(v): self._place(p) for v, p in state.items()}
            self._bytes = {v: _bytes(p) for v, p in self._versions.items()}
