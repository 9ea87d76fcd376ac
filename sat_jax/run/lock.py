"""One writer per run directory: an exclusive lock held by the process that trains in it.

A local workdir is locked with ``flock`` on ``<workdir>/.sat_jax.lock``. The kernel releases an
``flock`` when its holder exits, however it exits, so a crashed holder's lock is free and is taken
over; a live holder's lock is refused with a message naming it (host, pid, command, start time),
read from the file, which the holder writes when it takes the lock and empties when it releases
it. On NFS, Linux maps ``flock`` onto NFS byte-range locks, so processes on different machines
sharing the directory exclude each other too.

A ``gs://`` workdir is locked in the bucket, so the lock holds across machines: the object
``<workdir>/.sat_jax.lock`` is created only if absent (generation precondition 0) and holds the
holder's record. The holder renews it every :data:`RENEW_S` seconds (a rewrite conditional on the
generation it last wrote) and a successor takes it over only when it was not renewed for
:data:`LEASE_S` seconds (a rewrite conditional on the expired generation, so two successors cannot
both win). Expiry compares the object's server-side update time with this machine's clock, which
on cloud VMs agree to well under a second. Before every checkpoint write the holder checks that it
still holds the lock (:meth:`WorkdirLock.check`, a fence): a holder that could not renew within
its lease, or whose object now has another generation, raises :class:`LockLost` and stops instead
of writing. It needs the ``gcs`` extra (``google-cloud-storage``). Other URL schemes are locked
through a file under the machine's temporary directory, which guards that machine only.

Multi-host: the primary process takes the lock for the run (every host of one run writes to the
same directory), and all processes agree on the outcome, so either every host proceeds or every
host raises :class:`WorkdirLocked`; the fence is agreed the same way.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import time

import jax
import numpy as np

__all__ = [
    "LEASE_S",
    "LOCK_FILE",
    "RENEW_S",
    "LockLost",
    "WorkdirLock",
    "WorkdirLocked",
    "lock_path",
]

_log = logging.getLogger(__name__)

LOCK_FILE = ".sat_jax.lock"
#: A bucket lock not renewed for this many seconds may be taken over.
LEASE_S = 60.0
#: How often the holder of a bucket lock renews it.
RENEW_S = 15.0


class WorkdirLocked(RuntimeError):
    """Another live process holds the run directory's lock; the message names it."""


class LockLost(RuntimeError):
    """This process no longer holds its run's bucket lock (its lease lapsed or another run took
    it over): it must stop writing."""


def lock_path(workdir: str) -> str:
    """The file locked for ``workdir``."""
    if workdir.startswith("gs://"):
        return f"{workdir.rstrip('/')}/{LOCK_FILE}"
    if "://" in workdir:
        digest = hashlib.sha256(workdir.rstrip("/").encode()).hexdigest()[:16]
        return os.path.join(tempfile.gettempdir(), "sat_jax-locks", f"{digest}.lock")
    return os.path.join(os.path.abspath(workdir), LOCK_FILE)


class WorkdirLock:
    """``with WorkdirLock(workdir, "train"):`` holds ``workdir``'s lock for the block.

    Args:
      workdir: the run directory (created if missing; a URL is not touched).
      command: what the holder does, for the message another process gets.
      primary: whether this process takes the lock (default: process 0 of the run).
    """

    def __init__(
        self,
        workdir: str,
        command: str = "train",
        *,
        primary: bool | None = None,
        lease_s: float = LEASE_S,
        renew_s: float = RENEW_S,
    ):
        if not 0 < renew_s < lease_s:
            raise ValueError(f"renew_s must be in (0, lease_s={lease_s}), got {renew_s}")
        self.workdir = workdir
        self.command = command
        self.path = lock_path(workdir)
        self.primary = jax.process_index() == 0 if primary is None else bool(primary)
        self._fd: int | None = None
        self._lease = (
            _BucketLease(self.path, lease_s, renew_s) if workdir.startswith("gs://") else None
        )

    def acquire(self) -> None:
        """Takes the lock (and, on a multi-host run, agrees on it with every process).

        Raises:
          WorkdirLocked: a live process holds it.
        """
        error = None
        if self.primary:
            try:
                self._acquire_here()
            except WorkdirLocked as e:
                error = e
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            ok = multihost_utils.process_allgather(np.asarray(error is None, np.int32))
            if error is None and not np.all(ok):
                self.release()
                error = WorkdirLocked(f"{self.workdir} is in use (reported by the primary host)")
        if error is not None:
            raise error

    def check(self) -> None:
        """The fence before a checkpoint write: raises :class:`LockLost` on every process unless
        the primary still holds the bucket lock (a no-op for a file lock, which the kernel holds
        for as long as the process lives). Every process must call it."""
        error = None
        if self.primary and self._lease is not None:
            try:
                self._lease.check()
            except LockLost as e:
                error = e
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            ok = multihost_utils.process_allgather(np.asarray(error is None, np.int32))
            if error is None and not np.all(ok):
                error = LockLost(f"the primary host lost the lock of {self.workdir}")
        if error is not None:
            raise error

    def _acquire_here(self) -> None:
        if self._lease is not None:
            self._lease.acquire(self._holder())
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                raise
            raise WorkdirLocked(
                f"{self.workdir} is in use by {_describe(holder)}; wait for it to finish or stop "
                f"it (its lock, {self.path}, frees itself when that process exits), or use "
                "another --workdir"
            ) from None
        previous = _read_holder(fd)
        if previous:
            # Its holder exited without releasing it (killed or crashed): the lock is free.
            _log.warning(
                "taking over the lock of %s on %s: that process no longer holds it",
                _describe(previous),
                self.workdir,
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(self._holder()) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def _holder(self) -> dict:
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "command": self.command,
            "argv": sys.argv,
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }

    def release(self) -> None:
        """Empties the holder record and releases the lock (the file stays: deleting it would let
        a process lock a new file while another still holds the old one); deletes a bucket lock
        that this process still holds."""
        if self._lease is not None and self.primary:
            self._lease.release()
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> WorkdirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class _BucketLease:
    """The lock object ``path`` (``gs://bucket/.../.sat_jax.lock``) with its lease."""

    def __init__(self, path: str, lease_s: float, renew_s: float):
        self.path, self.lease_s, self.renew_s = path, float(lease_s), float(renew_s)
        self._bucket_name, _, self._name = path[len("gs://") :].partition("/")
        self._bucket = None
        self.generation: int | None = None
        self._renewed = 0.0  # time.monotonic() of the last successful write
        self._body = b""
        self._lost: str | None = None
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _client_bucket(self):
        if self._bucket is None:
            try:
                from google.cloud import storage
            except ImportError as e:
                raise ImportError(
                    f"locking a gs:// workdir ({self.path}) needs google-cloud-storage: "
                    'pip install "sat-jax[gcs]"'
                ) from e
            self._bucket = storage.Client().bucket(self._bucket_name)
        return self._bucket

    def acquire(self, holder: dict) -> None:
        from google.api_core.exceptions import NotFound, PreconditionFailed

        bucket = self._client_bucket()
        self._body = json.dumps({**holder, "lease_s": self.lease_s}).encode()
        blob = bucket.blob(self._name)
        try:
            blob.upload_from_string(self._body, if_generation_match=0)
        except PreconditionFailed:
            current = bucket.get_blob(self._name)
            if current is None:  # released in between: try once more from scratch
                blob.upload_from_string(self._body, if_generation_match=0)
            else:
                try:
                    previous = json.loads(current.download_as_bytes())
                except (NotFound, ValueError):
                    previous = {"unreadable": True}
                idle = time.time() - current.updated.timestamp()
                lease = float(previous.get("lease_s", self.lease_s))
                if idle < lease:
                    raise WorkdirLocked(
                        f"{self.path.rsplit('/', 1)[0]} is in use by {_describe(previous)}, whose "
                        f"lock in the bucket was renewed {idle:.0f} s ago (it expires "
                        f"{lease:.0f} s after its last renewal); wait for that run to finish, "
                        "or use another --workdir"
                    ) from None
                try:
                    blob.upload_from_string(self._body, if_generation_match=current.generation)
                except PreconditionFailed:
                    raise WorkdirLocked(
                        f"{self.path} was taken over by another process at the same moment"
                    ) from None
                _log.warning(
                    "taking over the lock of %s on %s: not renewed for %.0f s (lease %.0f s)",
                    _describe(previous),
                    self.path,
                    idle,
                    lease,
                )
        self.generation, self._renewed, self._lost = blob.generation, time.monotonic(), None
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, name="sat_jax-lock", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        from google.api_core.exceptions import PreconditionFailed

        while not self._stop.wait(self.renew_s):
            blob = self._client_bucket().blob(self._name)
            # Held across the write so that the fence never sees the new generation on the
            # server before this process records it.
            with self._mutex:
                try:
                    blob.upload_from_string(self._body, if_generation_match=self.generation)
                except PreconditionFailed:
                    self._lost = f"another process took over {self.path}"
                    return
                except Exception as e:  # transient: the fence refuses once the lease lapses
                    _log.warning("could not renew the lock %s: %s", self.path, e)
                    continue
                self.generation, self._renewed = blob.generation, time.monotonic()

    def check(self) -> None:
        with self._mutex:
            if self._lost is None and time.monotonic() - self._renewed > self.lease_s:
                self._lost = f"its lease of {self.lease_s:.0f} s lapsed without a renewal"
            if self._lost is None:
                current = self._client_bucket().get_blob(self._name)
                if current is None or current.generation != self.generation:
                    self._lost = f"{self.path} now belongs to another process"
        if self._lost is not None:
            raise LockLost(
                f"this run no longer holds the lock of {self.path.rsplit('/', 1)[0]} "
                f"({self._lost}): stopping without writing"
            )

    def release(self) -> None:
        from google.api_core.exceptions import NotFound, PreconditionFailed

        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.generation is None or self._lost is not None:
            return
        try:
            self._client_bucket().blob(self._name).delete(if_generation_match=self.generation)
        except (NotFound, PreconditionFailed):
            pass  # taken over after its lease lapsed: that holder's now
        self.generation = None


def _read_holder(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {"unreadable": True}


def _describe(holder: dict) -> str:
    if not holder or holder.get("unreadable"):
        return "another process (holder record unreadable)"
    return (
        f"`sat-jax {holder.get('command', '?')}` (pid {holder.get('pid', '?')} on host "
        f"{holder.get('host', '?')}, since {holder.get('since', '?')})"
    )
