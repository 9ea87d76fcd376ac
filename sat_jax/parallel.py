"""Mesh construction, data-parallel placement and multi-host initialisation.

The mesh has four axes, ``(data, fsdp, expert, tensor)`` (``MESH_AXES``), any of them of size 1:
the batch is split over ``data × fsdp``; parameters are split by the table of
``sat_jax.models.sharding`` (FSDP over ``fsdp``, experts over ``expert``, heads and widths over
``tensor``) and replicated over ``data``. Plain data parallelism is the special case
``fsdp = expert = tensor = 1``: batches sharded along their batch axis, parameters replicated.
On several hosts every process runs the same program, holds its own shard
of each global batch, and ``jax.make_array_from_process_local_data`` assembles the global array.
"""

from __future__ import annotations

import logging
import os

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

_log = logging.getLogger(__name__)

DATA = "data"
FSDP = "fsdp"
EXPERT = "expert"
TENSOR = "tensor"
MESH_AXES = (DATA, FSDP, EXPERT, TENSOR)


def maybe_initialize_distributed(
    mode: str = "auto",
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Calls ``jax.distributed.initialize()`` when running on several hosts.

    Args:
      mode: ``"on"`` (always), ``"off"`` (never) or ``"auto"``: on when a coordinator address is
        given, or when the environment of a Cloud TPU slice with several workers (``TPU_WORKER_
        HOSTNAMES`` with more than one host) or of a cluster JAX auto-detects is present.
      coordinator_address: ``host:port`` of process 0 (needed off Cloud TPU and on multi-slice).
      num_processes, process_id: explicit values for clusters JAX cannot detect (e.g. the local
        two-process test).
    Returns:
      Whether ``jax.distributed`` was initialised. Must run before any other JAX call.
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"multihost must be auto|on|off, got {mode!r}")
    if mode == "off":
        return False
    if mode == "auto":
        hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
        detected = coordinator_address or len([h for h in hosts.split(",") if h]) > 1
        if not detected:
            return False
    kwargs = {}
    if coordinator_address:
        kwargs["coordinator_address"] = coordinator_address
    if num_processes is not None:
        kwargs["num_processes"] = num_processes
    if process_id is not None:
        kwargs["process_id"] = process_id
    jax.distributed.initialize(**kwargs)
    _log.info(
        "jax.distributed initialised: process %d of %d", jax.process_index(), jax.process_count()
    )
    _no_persistent_cache_across_cpu_processes()
    return True


def _no_persistent_cache_across_cpu_processes() -> None:
    """Turns JAX's persistent compilation cache off in a CPU run of several processes.

    With JAX 0.12.1's CPU client, a cross-process program that a process loads from the
    persistent cache (rather than compiles) never finishes its first gloo collective: the second
    run of one two-process job on one cache directory hangs (``tests/multihost/
    test_compile_cache_processes.py`` runs that job). Several CPU processes are a test and
    debugging setup, whose programs are small, so the cache is left off there on every JAX
    version; accelerator backends keep it. JAX reads the setting at its first compilation, which
    comes after this.
    """
    if (
        jax.process_count() > 1
        and jax.default_backend() == "cpu"
        and jax.config.jax_enable_compilation_cache
        and jax.config.jax_compilation_cache_dir
    ):
        jax.config.update("jax_enable_compilation_cache", False)
        _log.warning(
            "persistent compilation cache %s left off: a CPU run of %d processes does not use it",
            jax.config.jax_compilation_cache_dir,
            jax.process_count(),
        )


def make_mesh(
    num_data: int = -1, devices=None, *, fsdp: int = 1, expert: int = 1, tensor: int = 1
) -> jax.sharding.Mesh:
    """A ``(data, fsdp, expert, tensor)`` mesh of ``num_data · fsdp · expert · tensor`` devices.

    Args:
      num_data: size of the ``data`` axis; -1 uses every device (over all hosts) left after the
        other axes.
      devices: the devices to use (default ``jax.devices()``), in mesh order: ``tensor`` varies
        fastest, so tensor-parallel groups are neighbouring devices.
      fsdp, expert, tensor: sizes of the other axes (1: that kind of parallelism is off).
    Raises:
      ValueError: naming the axis, for a non-positive size or more devices than available.
    """
    devices = list(jax.devices() if devices is None else devices)
    for name, size in (("fsdp", fsdp), ("expert", expert), ("tensor", tensor)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {name!r} must have a positive size, got {size!r}")
    inner = fsdp * expert * tensor
    n = len(devices) // inner if num_data == -1 else num_data
    if n < 1 or n * inner > len(devices):
        raise ValueError(
            f"mesh (data={num_data}, fsdp={fsdp}, expert={expert}, tensor={tensor}) needs "
            f"{max(n, 1) * inner} devices, {len(devices)} available"
        )
    grid = np.array(devices[: n * inner]).reshape(n, fsdp, expert, tensor)
    # Auto axes: placement comes from the inputs' NamedShardings and shard_map's specs, so code that
    # is not sharding-aware (the sampler's cache updates) runs unchanged on replicated inputs.
    return jax.sharding.Mesh(
        grid, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    )


def replicate(tree, mesh):
    """Places a pytree replicated on every device of ``mesh`` (across hosts: every process must
    pass the same values, as after a seeded initialisation). Leaves already replicated on ``mesh``
    are returned as they are, so a partly placed tree (parameters placed, a fresh optimizer step
    counter not) can be passed whole."""
    sharding = NamedSharding(mesh, P())

    def put(x):
        # Exactly this sharding (equivalence is not enough: on a one-device mesh a single-device
        # array is "equivalent" but traces as a different type, costing a recompilation).
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(put, tree)


def to_host(tree):
    """NumPy copies of a pytree of (possibly multi-host, replicated) arrays."""

    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(x.addressable_data(0))
        return np.asarray(x)

    return jax.tree.map(get, tree)


def local_view(tree):
    """A process-local view of replicated parameters: the copy on this process's first device.

    The rollout engine samples process-local prompts, so it must not run a global computation;
    with one process the arrays are returned as they are.
    """
    if jax.process_count() == 1:
        return tree
    return jax.tree.map(lambda x: x.addressable_shards[0].data, tree)


def is_primary() -> bool:
    return jax.process_index() == 0
