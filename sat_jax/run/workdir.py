"""Where a run lives: its workdir, and the directories for its logs and checkpoints.

A local workdir holds everything: checkpoints in ``<workdir>/checkpoints``, metrics,
TensorBoard files, config and plots beside them. A URL workdir (``gs://bucket/runs/x``) holds
everything too, so the run survives its VM: checkpoints are written there directly by every
host, and the primary host writes its logs into a local mirror (``runs/_remote/gs/bucket/runs/x``,
one per URL, so two runs never share one) and copies them into the workdir with every checkpoint
and when the session ends (:func:`upload_logs`). A resumed session first takes the workdir's
copies back (:func:`download_logs`), on whichever VM it runs; rows after the checkpoint it resumes
from are logged again anyway.
"""

from __future__ import annotations

import os

from etils import epath

#: The run outputs beside the checkpoints (files and directories).
LOG_OUTPUTS = (
    "metrics.jsonl",
    "metrics.jsonl.gz",
    "config.json",
    "config.yaml",
    "tensorboard",
    "plots",
)


def run_dir(config) -> str:
    return config.workdir or os.path.join(
        "runs", f"{config.name}-{config.lag_mode}{config.lag}-seed{config.seed}"
    )


def is_url(path: str) -> bool:
    return "://" in path


class WorkdirURLError(ValueError):
    """A URL workdir with an empty or dot path segment."""


def check_url(url: str) -> str:
    """``url`` without one trailing ``/``, refused when a path segment is empty, ``.`` or ``..``.

    In a bucket ``runs//x``, ``runs/./x`` and ``runs/x`` are three different object names, while
    local tools (and a reader's eye) take them for one directory: the same run would be locked
    and resumed under one spelling and written under another. They are refused, not rewritten.

    Raises:
      WorkdirURLError: naming the URL and the segment.
    """
    scheme, _, rest = url.partition("://")
    rest = rest[:-1] if rest.endswith("/") else rest
    for i, segment in enumerate(rest.split("/")):
        if segment in ("", ".", ".."):
            what = "an empty" if not segment else f"a {segment!r}"
            raise WorkdirURLError(
                f"workdir {url!r} has {what} path segment (number {i + 1}): write the URL with "
                "no '//', '/./' or '/../' in it"
            )
    return f"{scheme}://{rest}"


def remote(url: str) -> epath.Path:
    """The path object of a URL workdir."""
    return epath.Path(url.rstrip("/"))


def run_paths(config) -> tuple[str, str]:
    """(local directory the logs and plots are written in, checkpoint directory)."""
    workdir = run_dir(config)
    if is_url(workdir):
        workdir = check_url(workdir)
        scheme, rest = workdir.split("://", 1)
        local = os.path.abspath(os.path.join("runs", "_remote", scheme, *rest.split("/")))
        return local, os.fspath(remote(workdir) / "checkpoints")
    workdir = os.path.abspath(workdir)
    return workdir, os.path.join(workdir, "checkpoints")


def upload_logs(local: str, workdir: str) -> None:
    """Copies the run outputs in ``local`` into the URL ``workdir`` (replacing its copies)."""
    _copy_tree(epath.Path(local), remote(workdir))


def download_logs(workdir: str, local: str) -> None:
    """Replaces the run outputs in ``local`` by the URL ``workdir``'s copies, where it has
    them."""
    _copy_tree(remote(workdir), epath.Path(local))


def _copy_tree(src: epath.Path, dst: epath.Path) -> None:
    for name in LOG_OUTPUTS:
        if (src / name).exists():
            _copy(src / name, dst / name)


def _copy(src: epath.Path, dst: epath.Path) -> None:
    if src.is_dir():
        dst.mkdir(parents=True, exist_ok=True)
        for child in src.iterdir():
            _copy(child, dst / child.name)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        src.copy(dst, overwrite=True)


class WorkdirNotShared(RuntimeError):
    """The hosts of a multi-host run do not share its local workdir."""


def check_shared(workdir: str) -> None:
    """On a multi-host run, checks that every host sees what the primary host writes in the local
    ``workdir`` (a URL is shared by construction); every process must call it.

    Orbax finalises a checkpoint on the primary host only, so hosts with separate copies of one
    path disagree on which steps exist and branch into mismatched collectives on resume.

    Raises:
      WorkdirNotShared: some hosts do not see the primary host's file (on every process).
    """
    import jax

    if jax.process_count() == 1 or is_url(workdir):
        return
    import numpy as np
    from jax.experimental import multihost_utils

    token = np.zeros((), np.int32)  # 32 bits: what a collective carries without x64
    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        token = np.asarray(int.from_bytes(os.urandom(3), "little"), np.int32)
        with open(os.path.join(workdir, f".sat_jax-shared-{int(token)}"), "w"):
            pass
    token = int(multihost_utils.broadcast_one_to_all(token))
    marker = os.path.join(workdir, f".sat_jax-shared-{token}")
    seen = multihost_utils.process_allgather(np.asarray(os.path.exists(marker), np.int32))
    if jax.process_index() == 0:
        os.remove(marker)
    missing = [i for i, ok in enumerate(np.asarray(seen).reshape(-1)) if not ok]
    if missing:
        raise WorkdirNotShared(
            f"the workdir {workdir} is not shared by the hosts of this multi-host run (processes "
            f"{missing} do not see what process 0 writes there): use a gs:// workdir or a "
            "directory on a file system every host mounts"
        )


def check_same_on_every_host(value: int, what: str) -> None:
    """Raises :class:`WorkdirNotShared` on every process unless all processes pass the same
    ``value`` (an int describing ``what`` they see); every process must call it."""
    import jax

    if jax.process_count() == 1:
        return
    import numpy as np
    from jax.experimental import multihost_utils

    values = np.asarray(multihost_utils.process_allgather(np.asarray(value, np.int32))).reshape(-1)
    if len(set(values.tolist())) > 1:
        raise WorkdirNotShared(
            f"the processes of this multi-host run do not see the same {what} (per process: "
            f"{values.tolist()}; -1: none, -2: no directory): use a gs:// workdir or a "
            "directory on a file system every host mounts"
        )
