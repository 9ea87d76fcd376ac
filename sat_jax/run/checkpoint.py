"""Orbax checkpoints of the whole run state, with fall-back past corrupt or partial steps.

A checkpoint at step ``s`` holds two items written by one ``orbax.checkpoint.CheckpointManager``:

* ``state``: an arbitrary JAX pytree (parameters, optax state, the snapshot store of versioned
  parameters, the RNG key as ``jax.random.key_data`` uint32, step counters), written with
  ``args.StandardSave`` so sharded ``jax.Array`` leaves are saved without gathering them.
* ``meta``: a JSON dict (data iterator position, resolved config, list of snapshot versions, ...),
  written with ``args.JsonSave``.

Restoring a state whose *structure* depends on the step (the snapshot store holds a different
number of versions at different steps) is meta-driven: read ``meta`` first, build the target from
it, then restore the state. Either do it by hand::

    step = ckpt.latest_step()
    meta = ckpt.read_meta(step)
    state, meta, step = ckpt.restore(make_target(meta), step=step)

or pass the builder itself, which also works when ``restore`` has to walk back to an older step
whose meta differs::

    state, meta, step = ckpt.restore(make_target)   # make_target(meta) -> target pytree

Validity: a step is skipped, with a ``logging.warning`` naming the step and the reason, only when
it is shown to be corrupt: its directory lacks orbax's step metadata file, one of the two items or
the state's tree metadata (a bogus or partial directory); reading it fails with an error that
says the bytes are bad (unparsable JSON, a missing file, TensorStore's ``DATA_LOSS``,
``OUT_OF_RANGE`` for a read past the end of a truncated file, ``FAILED_PRECONDITION`` for a
stream that does not decompress, ``NOT_FOUND``); or the restored state holds a NaN or an
infinity. The error itself or one it was raised *from* (``__cause__``) must say so: an error raised
while another was being handled (``__context__``: out of memory while handling a missing file) is
not corruption. Any other error (out of memory, a transient storage error, a target that does not
match what was saved) is raised as it is, and no step is marked. ``restore(step=None)`` walks back
past corrupt steps to the newest valid one; if none is valid it raises ``FileNotFoundError``.

A step that ``restore`` or ``read_meta`` finds corrupt is moved at once to
``<directory>/invalid/<step>.<time>`` (kept for inspection, never deleted) with a warning naming
the step, the reason and where it went, so the resumed run's next save of that step really writes
(and orbax accepts it: it refuses a step older than its newest directory). A structurally
incomplete directory is left out of ``all_steps`` and moved aside by the next ``save`` of a step
at or below it. A read-only ``Checkpointer`` moves nothing. Orbax does not checksum array data:
bytes flipped in place without changing a file's size can go undetected.

Finiteness: ``save`` refuses a state with a NaN or an infinity in any floating-point leaf
(:class:`NonFiniteStateError`, naming the leaves), so a checkpoint never holds one.

Read-only: ``Checkpointer(directory, read_only=True)`` (what ``sat-jax eval`` opens) creates no
directory, deletes no temporary directory of another process's save in flight, and refuses
``save``.

Multi-host: orbax writes and reads collectively, so EVERY process must call ``save``, ``restore``,
``read_meta``, ``wait`` and ``close`` with the same arguments; no ``jax.process_index() == 0``
guard belongs around them. The only host-local decisions here are agreed across processes: a step
counts as valid only if it is valid on every process, an error that is not corruption on any
process stops every process, and only the primary process moves invalid steps aside, followed by
a barrier.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

__all__ = ["Checkpointer", "NonFiniteStateError"]

_log = logging.getLogger(__name__)

_STATE = "state"
_META = "meta"
# Orbax writes this file into every finalized step directory; a directory without it was not
# produced by a completed save.
_STEP_METADATA_FILE = "_CHECKPOINT_METADATA"
_INVALID_DIR = "invalid"
# Written by orbax into every PyTree item; a state directory without it cannot be restored.
_TREE_METADATA_FILE = "_METADATA"
# TensorStore status codes that say the stored bytes are bad (truncated, undecodable, missing),
# as opposed to the reader failing (RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, ...).
_CORRUPT_CODES = ("DATA_LOSS", "OUT_OF_RANGE", "FAILED_PRECONDITION", "NOT_FOUND")

Target = Any | Callable[[dict[str, Any]], Any]


class NonFiniteStateError(ValueError):
    """A state to save holds a NaN or an infinity; the message names the leaves."""


class _Corrupt(Exception):
    """A step whose stored data are shown to be bad (restore walks back past it)."""


class Checkpointer:
    """Saves and restores ``(state, meta)`` pairs at integer steps under one directory.

    Args:
      directory: Root directory of the run's checkpoints (created if missing). Local paths and
        any path ``etils.epath`` understands (e.g. ``gs://``) work.
      max_to_keep: Number of newest checkpoints kept; older ones are deleted by orbax.
      save_interval_steps: ``save`` writes only when ``step`` is a multiple of this (or
        ``force=True``); other calls return ``False``.
      async_save: Write in a background thread after copying arrays to host; call ``wait()``
        before reading the files or exiting. Restores are always synchronous.
      read_only: Only read: the directory must exist, nothing in it is created, moved or
        deleted (orbax's clean-up of temporary directories included), and ``save`` raises.
      fence: called at the start of every ``save`` (by every process); it raises to stop a
        writer that no longer owns the directory (``sat_jax.run.lock.WorkdirLock.check``).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int = 3,
        save_interval_steps: int = 1,
        async_save: bool = False,
        read_only: bool = False,
        fence: Callable[[], None] | None = None,
    ):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}")
        self.directory = os.fspath(directory)
        self._fence = fence
        self._root = epath.Path(self.directory)
        self.read_only = bool(read_only)
        if self.read_only:
            if not self._root.is_dir():
                raise FileNotFoundError(f"no checkpoint directory {self.directory}")
            # A temporary directory may be another process's save in flight: left alone.
            options = ocp.CheckpointManagerOptions(
                read_only=True,
                save_interval_steps=0,
                max_to_keep=None,
                create=False,
                cleanup_tmp_directories=False,
                enable_async_checkpointing=False,
            )
        else:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                save_interval_steps=save_interval_steps,
                enable_async_checkpointing=async_save,
                create=True,
                # Temporary directories of a save interrupted by a crash are never valid (one
                # writer per directory: sat_jax.run.lock).
                cleanup_tmp_directories=True,
            )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        # Steps found invalid by this process, with the reason; moved aside by the next save.
        self._invalid: dict[int, str] = {}
        self._moves = 0  # names each move-aside barrier

    # ------------------------------------------------------------------ queries

    def all_steps(self) -> list[int]:
        """Steps whose directories look complete and that no restore found corrupt, ascending
        (data are checked only on restore)."""
        steps = []
        for step in sorted(self._manager.all_steps()):
            reason = self._invalid.get(step) or self._incomplete_reason(step)
            if reason is None:
                steps.append(step)
            else:
                self._mark_invalid(step, reason)
        return steps

    def latest_step(self) -> int | None:
        """Newest step that looks complete, or ``None`` when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ save

    def save(
        self,
        step: int,
        state: Any,
        meta: Mapping[str, Any],
        *,
        force: bool = False,
        unchecked: Collection[str] = (),
    ) -> bool:
        """Writes ``state`` and ``meta`` at ``step``; every process must call it.

        Args:
          step: Non-negative training step; must exceed every valid step already saved.
          state: Pytree of arrays and Python scalars. PRNG keys must be stored as
            ``jax.random.key_data(key)`` (typed key arrays are rejected).
          meta: JSON-serialisable dict. NumPy scalars and 0-d arrays become Python numbers and
            tuples become lists, so that is what ``restore`` gives back.
          force: Save even if ``step`` is not a multiple of ``save_interval_steps``.
          unchecked: Top-level keys of a dict ``state`` whose values may hold NaN or infinity
            (data such as a mask of ``-inf``); every other floating-point leaf must be finite.

        Returns:
          Whether a checkpoint was started (with ``async_save`` it may still be in flight).

        Raises:
          NonFiniteStateError: a floating-point leaf of ``state`` holds a NaN or an infinity
            (nothing is written).
        """
        if self.read_only:
            raise ValueError(f"cannot save step {step}: {self.directory} was opened read-only")
        step = _check_step(step)
        _check_no_typed_keys(state)
        bad = nonfinite_leaves(_without(state, unchecked))
        if bad:
            raise NonFiniteStateError(
                f"refusing to save step {step} in {self.directory}: NaN or infinity in "
                f"{_names(bad)}"
            )
        meta = _jsonable(dict(meta), "meta")
        if self._fence is not None:
            self._fence()
        self._move_aside_invalid_at_or_above(step)
        existing = [s for s in self._manager.all_steps() if s >= step]
        if existing:
            raise ValueError(
                f"cannot save step {step} in {self.directory}: checkpoints at steps {existing} "
                "already exist. Resume from the newest one, or use a new directory."
            )
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                **{_STATE: ocp.args.StandardSave(state), _META: ocp.args.JsonSave(meta)}
            ),
            force=force,
        )

    # ------------------------------------------------------------------ restore

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """Reads only the JSON meta of ``step`` (default: newest step whose meta is readable).

        Raises:
          FileNotFoundError: No checkpoint, or none with a readable meta.
          ValueError: ``step`` was given and its checkpoint is invalid.
        """
        return self._walk(step, self._restore_meta)

    def restore(
        self, target_state: Target, step: int | None = None, *, unchecked: Collection[str] = ()
    ) -> tuple[Any, dict, int]:
        """Restores ``(state, meta, step)``; every process must call it.

        Args:
          target_state: The structure, dtypes and shardings to restore into: a concrete pytree
            (e.g. a freshly initialised state; optax NamedTuples are kept) or an abstract one of
            ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` leaves (Python scalars stay as
            is). May also be a callable ``meta -> target`` for states whose structure depends on
            the step; it is called with each candidate step's meta.
          step: Step to restore. ``None`` restores the newest valid step, walking back past
            invalid ones with a warning each.
          unchecked: As in ``save``: top-level keys not checked for NaN and infinity.

        Raises:
          FileNotFoundError: The directory holds no checkpoint, or none could be restored (the
            message lists every step tried and why it failed).
          ValueError: ``step`` was given and its checkpoint is corrupt.
          Exception: any error that does not show the checkpoint to be corrupt (out of memory,
            storage unavailable, a target that does not match), as raised.
        """

        def attempt(s: int) -> tuple[Any, dict, int]:
            meta = self._restore_meta(s)
            target = target_state(meta) if callable(target_state) else target_state
            restored = self._manager.restore(
                s, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(target)})
            )
            bad = nonfinite_leaves(_without(restored[_STATE], unchecked))
            if bad:
                raise _Corrupt(f"NaN or infinity in {_names(bad)}")
            return restored[_STATE], meta, s

        return self._walk(step, attempt)

    # ------------------------------------------------------------------ lifecycle

    def wait(self) -> None:
        """Blocks until an asynchronous save has been written and committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases orbax's resources."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _step_dir(self, step: int) -> epath.Path:
        # Default CheckpointManagerOptions name step directories by the bare step number.
        return self._root / str(step)

    def _incomplete_reason(self, step: int) -> str | None:
        """Cheap structural check of a step directory; ``None`` when it looks complete."""
        path = self._step_dir(step)
        if not (path / _STEP_METADATA_FILE).exists():
            return f"missing {_STEP_METADATA_FILE} (save never completed)"
        for item in (_STATE, _META):
            item_dir = path / item
            if not item_dir.is_dir() or not any(item_dir.iterdir()):
                return f"missing or empty item directory '{item}'"
        if not (path / _STATE / _TREE_METADATA_FILE).exists():
            return f"missing {_STATE}/{_TREE_METADATA_FILE} (the state's tree metadata)"
        return None

    def _restore_meta(self, step: int) -> dict[str, Any]:
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()})
        )
        meta = restored[_META]
        if not isinstance(meta, dict):
            raise ValueError(f"meta is a {type(meta).__name__}, expected a dict")
        return meta

    def _walk(self, step: int | None, attempt: Callable[[int], Any]) -> Any:
        """Runs ``attempt`` on ``step`` or on each step newest first until one succeeds."""
        # An asynchronous save still in flight would otherwise be invisible or half-written.
        self._manager.wait_until_finished()
        if step is None:
            candidates = sorted(self._manager.all_steps(), reverse=True)
            if not candidates:
                raise FileNotFoundError(f"no checkpoint found in {self.directory}")
        else:
            candidates = [_check_step(step)]
            if candidates[0] not in self._manager.all_steps():
                raise ValueError(
                    f"no checkpoint at step {step} in {self.directory}; "
                    f"available steps: {self.all_steps()}"
                )
        failures = []
        reason = None
        for s in candidates:
            reason = self._incomplete_reason(s)
            result = error = None
            if reason is None:
                try:
                    result = attempt(s)
                except Exception as e:
                    if _is_corruption(e):
                        reason = f"restore failed: {type(e).__name__}: {_first_line(e)}"
                    else:
                        error = e
            # Every process takes the same branch: return, raise, or walk back.
            outcome = _agreed_outcome(2 if error is not None else 1 if reason else 0)
            if outcome == 2:
                if error is not None:
                    raise error
                raise RuntimeError(
                    f"restoring step {s} from {self.directory} failed on another process"
                )
            if outcome == 0:
                return result
            reason = reason or "invalid on another process"
            self._mark_invalid(s, reason)
            failures.append(f"step {s}: {reason}")
            if not self.read_only:
                # Every process reaches this point for the same step (the agreed outcome above).
                self._move_aside([s])
        if step is not None:
            raise ValueError(f"checkpoint at step {step} in {self.directory} is invalid: {reason}")
        raise FileNotFoundError(
            f"no valid checkpoint in {self.directory}; tried " + "; ".join(failures)
        )

    def _mark_invalid(self, step: int, reason: str) -> None:
        if self._invalid.get(step) != reason:
            _log.warning(
                "checkpoint step %d in %s is invalid and will be skipped: %s",
                step,
                self.directory,
                reason,
            )
        self._invalid[step] = reason

    def _move_aside_invalid_at_or_above(self, step: int) -> None:
        """Moves invalid steps >= ``step`` to ``invalid/`` so orbax accepts the new save."""
        # Incomplete directories are found here even if restore was never called.
        for s in self._manager.all_steps():
            if s >= step and s not in self._invalid:
                reason = self._incomplete_reason(s)
                if reason is not None:
                    self._mark_invalid(s, reason)
        doomed = sorted(s for s in self._invalid if s >= step and s in self._manager.all_steps())
        if doomed:
            self._move_aside(doomed)

    def _move_aside(self, steps: list[int]) -> None:
        """Moves invalid ``steps`` to ``invalid/``, kept; every process must call it."""
        if jax.process_index() == 0:
            dest_root = self._root / _INVALID_DIR
            dest_root.mkdir(parents=True, exist_ok=True)
            for s in steps:
                dest = dest_root / f"{s}.{time.strftime('%Y%m%d-%H%M%S')}"
                _log.warning(
                    "checkpoint step %d in %s is invalid (%s): moved to %s, kept for inspection",
                    s,
                    self.directory,
                    self._invalid[s],
                    dest,
                )
                self._step_dir(s).rename(dest)
        if jax.process_count() > 1:
            self._moves += 1
            ocp.multihost.sync_global_processes(f"sat_jax_checkpoint_move_aside_{self._moves}")
        for s in steps:
            del self._invalid[s]
        self._manager.reload()


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return int(step)


def _check_no_typed_keys(state: Any) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"state leaf {jax.tree_util.keystr(path)} is a typed PRNG key array; store "
                "jax.random.key_data(key) instead and rebuild with jax.random.wrap_key_data."
            )


def _jsonable(value: Any, where: str) -> Any:
    """Converts NumPy scalars / tuples to JSON types and fails early, naming the bad entry."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where} has a non-string key {k!r}; JSON keys must be strings")
            out[k] = _jsonable(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, list | tuple):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, np.generic | np.ndarray | jax.Array) and np.ndim(value) == 0:
        return np.asarray(value).item()
    if value is None or isinstance(value, str | bool | int | float):
        return value
    try:
        json.dumps(value)
    except TypeError as e:
        raise TypeError(f"{where} is not JSON-serialisable ({type(value).__name__})") from e
    return value


def nonfinite_leaves(tree: Any) -> list[str]:
    """Paths of the floating-point leaves of ``tree`` holding a NaN or an infinity, agreed by
    every process (each checks the shards it holds, on the device or host memory they lie in;
    every process must call it)."""
    checks: list[tuple[str, Any]] = []  # (path, a flag still on device or a host bool)
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        name = jax.tree_util.keystr(path)
        if isinstance(leaf, float):
            checks.append((name, math.isfinite(leaf)))
            continue
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jax.dtypes.issubdtype(dtype, np.inexact):
            continue
        if not isinstance(leaf, jax.Array):
            checks.append((name, bool(np.isfinite(np.asarray(leaf)).all())))
            continue
        for shard in leaf.addressable_shards:
            data = shard.data
            if data.sharding.memory_kind in ("pinned_host", "unpinned_host"):
                checks.append((name, bool(np.isfinite(np.asarray(data)).all())))
            else:
                checks.append((name, _all_finite(data)))
    flags = jax.device_get([flag for _, flag in checks])  # one wait for every device flag
    bad = list(dict.fromkeys(name for (name, _), ok in zip(checks, flags, strict=True) if not ok))
    if jax.process_count() > 1 and not _all_processes_agree(not bad):
        return bad or ["(a leaf held by another process)"]
    return bad


@jax.jit
def _all_finite(x: jax.Array) -> jax.Array:
    return jnp.isfinite(x).all()


def _without(state: Any, keys: Collection[str]) -> Any:
    if not keys:
        return state
    return {k: v for k, v in state.items() if k not in keys}


def _names(paths: list[str], limit: int = 5) -> str:
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return ", ".join(paths[:limit]) + more


def _is_corruption(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from (``__cause__``), says the stored bytes
    are bad. An error only being handled when ``error`` was raised (``__context__``) proves
    nothing: the new error is the failure."""
    seen = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, _Corrupt | json.JSONDecodeError | FileNotFoundError):
            return True
        text = str(e)
        if any(f"{code}:" in text for code in _CORRUPT_CODES):
            return True
        e = e.__cause__
    return False


def _agreed_outcome(code: int) -> int:
    """The largest of every process's ``code`` (0 valid, 1 corrupt, 2 failed)."""
    if jax.process_count() == 1:
        return code
    from jax.experimental import multihost_utils  # Only needed on multi-host runs.

    return int(np.max(multihost_utils.process_allgather(np.asarray(code, dtype=np.int32))))


def _all_processes_agree(ok: bool) -> bool:
    """True only if ``ok`` holds on every process, so all hosts restore the same step."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils  # Only needed on multi-host runs.

    flags = multihost_utils.process_allgather(np.asarray(ok, dtype=np.int32))
    return bool(np.all(flags))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else "(no message)"
