"""A bounded store of parameter versions: the rollout engine samples from these, never from the
trainer's live parameters, so asynchronous lag is reproduced exactly."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import jax


class SnapshotStore:
    """Versioned, immutable parameter snapshots, bounded in count.

    JAX arrays are immutable, so a device snapshot is a reference, not a copy: keeping version v
    costs one parameter set in device memory only after the trainer has moved past it. With
    ``placement="host"`` snapshots are pulled to host memory (NumPy) and sent back to the device
    when sampled, which frees accelerator memory for long lags at the price of a transfer.

    Thread-safe: the stream mode's rollout thread reads while the trainer writes.

    Args:
      capacity: the most versions held at once; ``put`` evicts the oldest beyond it.
      placement: ``"device"`` or ``"host"``.
    """

    def __init__(self, capacity: int, placement: str = "device"):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if placement not in ("device", "host"):
            raise ValueError(f"placement must be 'device' or 'host', got {placement!r}")
        self.capacity = int(capacity)
        self.placement = placement
        self._versions: dict[int, Any] = {}
        self._lock = threading.Condition()

    def put(self, version: int, params: Any) -> None:
        """Adds ``params`` as ``version`` (versions only grow) and evicts beyond capacity."""
        version = int(version)
        if self.placement == "host":
            params = jax.device_get(params)
        with self._lock:
            if self._versions and version <= max(self._versions):
                raise ValueError(f"version {version} is not newer than {max(self._versions)}")
            self._versions[version] = params
            while len(self._versions) > self.capacity:
                del self._versions[min(self._versions)]
            self._lock.notify_all()

    def get(self, version: int) -> Any:
        with self._lock:
            if version not in self._versions:
                raise KeyError(
                    f"parameter version {version} is not in the store (held: {self.versions()}); "
                    "raise the snapshot capacity or lower the lag"
                )
            params = self._versions[version]
        return jax.device_put(params) if self.placement == "host" else params

    def latest(self) -> tuple[int, Any]:
        with self._lock:
            if not self._versions:
                raise KeyError("the snapshot store is empty")
            version = max(self._versions)
        return version, self.get(version)

    def latest_version(self) -> int:
        with self._lock:
            return max(self._versions) if self._versions else -1

    def wait_for_newer(self, version: int, timeout: float) -> bool:
        """Blocks until a version newer than ``version`` exists or ``timeout`` seconds pass."""
        with self._lock:
            return self._lock.wait_for(lambda: self.latest_version() > version, timeout=timeout)

    def versions(self) -> list[int]:
        return sorted(self._versions)

    def retain(self, keep: Iterable[int]) -> None:
        """Evicts every version not in ``keep`` except the newest one."""
        keep = set(keep)
        with self._lock:
            newest = max(self._versions) if self._versions else None
            for v in list(self._versions):
                if v not in keep and v != newest:
                    del self._versions[v]

    def state(self) -> dict[str, Any]:
        """{str(version): params} for checkpointing (host or device arrays)."""
        with self._lock:
            return {str(v): p for v, p in sorted(self._versions.items())}

    def load(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._versions = {int(v): p for v, p in state.items()}
