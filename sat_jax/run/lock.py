"""One writer per run directory: an exclusive lock held by the process that trains in it.

The lock is ``flock`` on ``<workdir>/.sat_jax.lock`` (a URL workdir is locked through a file
under the machine's temporary directory named by a hash of the URL, which guards the processes of
that machine only). The kernel releases an ``flock`` when its holder exits, however it exits, so
a crashed holder's lock is free and is taken over; a live holder's lock is refused with a message
naming it (host, pid, command, start time), read from the file, which the holder writes when it
takes the lock and empties when it releases it. On NFS, Linux maps ``flock`` onto NFS byte-range
locks, so processes on different machines sharing the directory exclude each other too.

Multi-host: the primary process takes the lock for the run (every host of one run writes to the
same directory), and all processes agree on the outcome, so either every host proceeds or every
host raises :class:`WorkdirLocked`.
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
import time

import jax
import numpy as np

__all__ = ["LOCK_FILE", "WorkdirLock", "WorkdirLocked", "lock_path"]

_log = logging.getLogger(__name__)

LOCK_FILE = ".sat_jax.lock"


class WorkdirLocked(RuntimeError):
    """Another live process holds the run directory's lock; the message names it."""


def lock_path(workdir: str) -> str:
    """The file locked for ``workdir``."""
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

    def __init__(self, workdir: str, command: str = "train", *, primary: bool | None = None):
        self.workdir = workdir
        self.command = command
        self.path = lock_path(workdir)
        self.primary = jax.process_index() == 0 if primary is None else bool(primary)
        self._fd: int | None = None

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

    def _acquire_here(self) -> None:
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
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "command": self.command,
            "argv": sys.argv,
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Empties the holder record and releases the lock (the file stays: deleting it would let
        a process lock a new file while another still holds the old one)."""
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
