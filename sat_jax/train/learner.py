"""The host loop that ties rollouts, the trainer step, snapshots, evaluation, logs and checkpoints.

    rollout source (lag schedule, snapshot store) → scored batch + behaviour parameters
            → trainer step → new parameter version → rollout source → eval / checkpoint hooks

The loop (:func:`train`) only reads the next batch, steps, publishes the new version and runs the
hooks; which version samples which batch and which versions stay in memory is the rollout
source's business (``sat_jax.rl.rollout_sources``), building the components is
``sat_jax.train.components``,
stop signals, the non-finite-update guard and timers are ``sat_jax.train.controls``.

Safety: one process trains in a workdir at a time (``sat_jax.run.lock``, in the bucket for a
``gs://`` workdir, checked before every checkpoint write); SIGINT and SIGTERM at any moment (the
closing evaluation and save included) end with a checkpoint on every host, after the same step,
and the signal's exit status everywhere; an update with a non-finite loss
or gradient is not applied, and ``optim.max_nonfinite_steps`` such steps in a row stop the run
(:class:`NonFiniteError`); no checkpoint is written with a non-finite value, and a restored one
is checked (``sat_jax.run.checkpoint``).

Reproducibility: randomness comes from named streams of the seed (``sat_jax.rl.rng``), the prompt
iterator, optimizer state and snapshot store are checkpointed, so in the ``fixed`` and
``broadcast`` modes a run killed at any point and resumed logs the same metrics as an
uninterrupted one, each step once. Resuming refuses a workdir whose run has a different config
(``sat_jax.config.changed_fields``); ``resume=False`` moves an earlier run's outputs aside and
starts over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from etils import epath

from sat_jax import parallel
from sat_jax.config.validation import (
    Checked,
    changed_fields,
    full_eval_steps,
    loss_spec,
    plain,
    validate,
)
from sat_jax.data import PromptIterator
from sat_jax.rl import rng, trainer
from sat_jax.rl.lag import lag_stats
from sat_jax.rl.rollout import batch_stats, evaluate
from sat_jax.rl.rollout_sources import Rollout, RolloutSource, ScheduledRollouts
from sat_jax.rl.stream import StreamRollouts
from sat_jax.run import workdir as workdir_lib
from sat_jax.run.checkpoint import Checkpointer
from sat_jax.run.lock import LockLost, WorkdirLock, WorkdirLocked
from sat_jax.run.metrics import RunLogger
from sat_jax.run.plots import plot_run
from sat_jax.run.progress import Progress
from sat_jax.run.workdir import WorkdirNotShared, WorkdirURLError
from sat_jax.train.components import Components, build, shared_train_step
from sat_jax.train.controls import NonFiniteError, NonFiniteGuard, StopFlag, Timer

__all__ = [
    "Components",
    "LockLost",
    "NonFiniteError",
    "ResumeError",
    "WorkdirLocked",
    "WorkdirNotShared",
    "WorkdirURLError",
    "build",
    "evaluate_run",
    "loss_spec",
    "make_source",
    "source_type",
    "train",
]

# Run outputs moved aside when a run starts over in the same workdir.
_OUTPUTS = workdir_lib.LOG_OUTPUTS


# The checkpoint entry of the rollout source's own state beyond the prompt position (stream
# mode's finished batches): rollout data, not weights, whose support cut-offs are -inf where
# nothing was cut.
_SOURCE = "stream"
_DATA = (_SOURCE,)


class ResumeError(ValueError):
    """The workdir holds a different run; the message names the differing fields."""


def source_type(config) -> type[RolloutSource]:
    """The rollout source class of ``config.lag_mode``."""
    return StreamRollouts if config.lag_mode == "stream" else ScheduledRollouts


def make_source(config, parts: Components, prompts, *, first_step: int) -> RolloutSource:
    """The rollout source of ``config.lag_mode``."""
    common = dict(
        needs_old=parts.spec.needs_old, placement=config.snapshot_placement, view=parts.rollout_view
    )
    if source_type(config) is StreamRollouts:
        return StreamRollouts(
            parts.engine,
            prompts,
            config.seed,
            queue_size=max(1, config.lag),
            chunk=config.rollout.stream_chunk,
            first_index=first_step,
            timeout=config.rollout.stream_timeout_s,
            **common,
        )
    k = config.rollout.decode_devices
    devices = jax.local_devices()[:k] if k > 1 else None
    return ScheduledRollouts(
        parts.engine, parts.schedule, prompts, config.seed, decode_devices=devices, **common
    )


def _eval(config, parts: Components, params, step: int) -> dict[str, float]:
    """Held-out evaluation of ``params`` at ``step``: the same keys in training and ``eval``; the
    first ``eval.full_num_prompts`` prompts at the steps of ``eval.full_at``, the first
    ``eval.num_prompts`` at the others (logged as ``eval/num_prompts``)."""
    full = step in full_eval_steps(config)
    rows = config.eval.full_num_prompts if full else config.eval.num_prompts
    examples = parts.eval_examples[:rows]
    result = evaluate(
        parts.engine,
        parts.rollout_view(params),
        examples,
        config.rollout.prompts_per_step // jax.process_count(),
        rng.key(config.seed, "eval", step),
        version=step,
    )
    return {**result, "num_prompts": float(len(examples))}


def _restore_target(state, params, ref_params, source: type[RolloutSource] = ScheduledRollouts):
    def target(meta):
        out = {
            "state": state._asdict(),
            "store": {str(v): params for v in meta["store_versions"]},
            "ref": ref_params,
        }
        saved = source.restore_target(meta.get(_SOURCE, {}))
        if saved:
            out[_SOURCE] = saved
        return out

    return target


def evaluate_run(config, *, checked: Checked | None = None) -> dict[str, Any]:
    """Held-out evaluation of the latest valid checkpoint of ``config``'s run directory; equal to
    the in-training evaluation at that step. ``checked``: what validating ``config`` built.

    The checkpoints are opened read-only: nothing in the run directory is created, moved or
    cleaned, so a run may be evaluated while it trains.

    Raises:
      FileNotFoundError: the run directory holds no checkpoint (checked before anything is
        built).
      WorkdirNotShared: the processes of a multi-host run see different checkpoints.
      ResumeError: the run was trained with a different config (``eval.*`` aside).
    """
    workdir, ckpt_dir = workdir_lib.run_paths(config)
    found = epath.Path(ckpt_dir).is_dir()
    with Checkpointer(ckpt_dir, read_only=True) if found else contextlib.nullcontext() as ckpt:
        latest = None if ckpt is None else ckpt.latest_step()
        # The restore below is collective: every process must find the same newest step.
        workdir_lib.check_same_on_every_host(
            -2 if ckpt is None else -1 if latest is None else latest,
            f"newest checkpoint in {ckpt_dir}",
        )
        if ckpt is None:
            raise FileNotFoundError(
                f"no checkpoints in {workdir} ({ckpt_dir} does not exist): is it a run directory?"
            )
        if latest is None:
            raise FileNotFoundError(f"no checkpoint in {ckpt_dir}")
        # Another task, model or method would be evaluated without a word; the evaluation's own
        # settings (eval.*) may differ.
        stored = ckpt.read_meta(latest).get("config", {})
        changed = [c for c in changed_fields(stored, config) if not c.startswith("eval.")]
        if changed:
            raise ResumeError(
                f"{workdir} holds a run with a different config ({'; '.join(changed)}): "
                "evaluate it with the config it was trained with (its config.json)"
            )
        # The checkpoint's parameters replace these.
        parts = build(config, warmup=False, checked=checked)
        state = trainer.init_train_state(
            parts.params, parts.optimizer, parts.mesh, config=parts.model_cfg
        )
        restored, _, step = ckpt.restore(
            _restore_target(state, parts.params, parts.params, source_type(config)),
            unchecked=_DATA,
        )
    return {
        "workdir": workdir,
        "step": step,
        **_eval(config, parts, restored["state"]["params"], step),
    }


def _start_over(workdir: str, ckpt_dir: str, log, url: str | None = None) -> None:
    """Moves an earlier run's checkpoints and outputs to ``<workdir>/replaced-<time>/`` (and,
    for a URL workdir, the outputs kept there to ``<url>/replaced-<time>/``)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if parallel.is_primary():
        ckpt = epath.Path(ckpt_dir)
        moved = []
        if ckpt.exists() and any(ckpt.iterdir()):
            dest = (
                epath.Path(f"{ckpt_dir.rstrip('/')}-replaced-{stamp}")
                if "://" in ckpt_dir
                else epath.Path(workdir) / f"replaced-{stamp}" / "checkpoints"
            )
            dest.parent.mkdir(parents=True, exist_ok=True)
            ckpt.rename(dest)
            moved.append(str(dest))
        for name in _OUTPUTS:
            path = os.path.join(workdir, name)
            if os.path.exists(path):
                dest = os.path.join(workdir, f"replaced-{stamp}", name)
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                shutil.move(path, dest)
                moved.append(dest)
            if url is not None and (workdir_lib.remote(url) / name).exists():
                dest = workdir_lib.remote(url) / f"replaced-{stamp}" / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                (workdir_lib.remote(url) / name).rename(dest)
                moved.append(str(dest))
        if moved:
            log(
                f"resume=False: moved the earlier run in {workdir} aside ({len(moved)} items "
                f"under replaced-{stamp})"
            )
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("sat_jax_start_over")


def _check_resumable(config, ckpt: Checkpointer, workdir: str) -> int | None:
    """The step a resume would start from (``None``: nothing to resume); refuses another run."""
    if not config.resume or ckpt.latest_step() is None:
        return None
    meta = ckpt.read_meta()
    changed = changed_fields(meta.get("config", {}), config)
    if changed:
        raise ResumeError(
            f"{workdir} holds a run with a different config ({'; '.join(changed)}). Resume it "
            "with its own config, use another --workdir, or start over with "
            "--config.resume=False (moves the earlier run aside)"
        )
    return int(meta.get("step", ckpt.latest_step()))


def _schedule_horizon(config, ckpt: Checkpointer | None) -> int:
    """Training steps the learning-rate schedule spans: ``optim.decay_steps``, else
    ``num_steps`` at the run's first start (stored in every checkpoint; ``ckpt`` when
    resuming)."""
    if config.optim.decay_steps:
        return int(config.optim.decay_steps)
    if ckpt is None:
        return int(config.num_steps)
    meta = ckpt.read_meta()
    return int(meta.get("schedule_steps") or meta["config"]["num_steps"])


def _with_horizon(config, horizon: int):
    """``config`` with ``optim.decay_steps`` set to the run's horizon (what the optimizer is
    built from; the stored config keeps the user's value)."""
    config = config.copy_and_resolve_references()
    config.optim.decay_steps = horizon
    return config


def combine_updates(updates: list[dict]) -> dict[str, float]:
    """One step's metrics from the metrics of its optimizer updates (minibatches × passes).

    A maximum (a name ending in ``max``) is the maximum over the updates, a minimum (``min``) the
    minimum, every other figure (rates, means, percentiles, norms) the mean over the updates;
    ``optim/nonfinite_updates`` counts the updates refused as non-finite, and ``optim/nonfinite``
    is 1 when any was.
    """
    if not updates:
        raise ValueError("combine_updates: a step has at least one update")
    out = {}
    for key in updates[0]:
        values = np.asarray([float(u[key]) for u in updates], np.float64)
        if key.endswith("max"):
            out[key] = float(values.max())
        elif key.endswith("min"):
            out[key] = float(values.min())
        else:
            out[key] = float(values.mean())
    refused = np.asarray([float(u["optim/nonfinite"]) for u in updates])
    out["optim/nonfinite"] = float(refused.max())
    out["optim/nonfinite_updates"] = float(refused.sum())
    return out


@dataclasses.dataclass
class _Prefetched:
    """Batch ``step``, rolled out while the trainer ran step ``step - 1`` (``rollout.prefetch``),
    and where the prompt iterator stood before it was drawn (what a checkpoint saves)."""

    step: int
    rollout: Rollout
    position: Any


class _Session:
    """One training session: the run's parts, state, rollout source, logs and checkpoints."""

    def __init__(self, config, *, max_steps, quiet, ckpt, workdir, log, horizon, checked, url=None):
        self.config, self.ckpt, self.workdir, self.log = config, ckpt, workdir, log
        self.horizon, self.url = horizon, url
        self.primary = parallel.is_primary()
        resuming = bool(config.resume) and ckpt.latest_step() is not None
        # A resumed run's parameters (and its reference policy) come from the checkpoint.
        self.parts = parts = build(
            _with_horizon(config, horizon), log, warmup=not resuming, checked=checked
        )
        # Reused from an earlier run of this process with the same program (a study's grid).
        self.train_step = shared_train_step(_with_horizon(config, horizon), parts, donate=True)
        self.ref_params = parts.params
        # Every leaf on the mesh in the layout the step returns (optimizer state created sharded,
        # step counter replicated): an uncommitted input at step 1 would make step 2 a cache miss.
        self.state = trainer.init_train_state(
            parts.params, parts.optimizer, parts.mesh, config=parts.model_cfg
        )
        # prompts_per_step is global; each process rolls out its own contiguous share of it.
        self.iterator = PromptIterator(
            parts.train_src,
            config.rollout.prompts_per_step,
            seed=config.seed,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        self.start = 0
        restored = None
        if resuming:
            restored, meta, self.start = ckpt.restore(
                _restore_target(self.state, parts.params, self.ref_params, source_type(config)),
                unchecked=_DATA,
            )
        self.source = make_source(config, parts, self.iterator, first_step=self.start)
        if restored is not None:
            self.state = trainer.TrainState(**restored["state"])
            self.source.store.load(restored["store"])
            self.source.restore(
                restored.get(_SOURCE, {}), {**meta.get(_SOURCE, {}), "iterator": meta["iterator"]}
            )
            self.ref_params = restored["ref"]
            log(f"resumed from {url or workdir} at step {self.start}")
            if url is not None and self.primary:  # the logs as the run's checkpoints left them
                workdir_lib.download_logs(url, workdir)
        else:
            self.source.publish(0, parts.params)
        # Rows after the restored step are logged again; a fresh start drops every old row.
        self.logger = RunLogger(
            workdir,
            config=plain(config),
            enable_tensorboard=config.log.tensorboard,
            is_primary=self.primary,
            resume_step=self.start if self.start else -1,
        )
        if parts.sft_info and self.start == 0:
            self.logger.log(0, parts.sft_info)
        self.end = (
            config.num_steps if max_steps is None else min(config.num_steps, self.start + max_steps)
        )
        self.progress = Progress(
            self.end, is_primary=self.primary and config.log.progress and not quiet
        )
        self.timer = Timer()
        self.nonfinite = NonFiniteGuard(config.optim.max_nonfinite_steps)
        self.history: list[dict[str, float]] = []
        self.eval_result = None
        self.pending: _Prefetched | None = None

    def rollout(self, step: int) -> Rollout:
        """Batch ``step``: the one prefetched during the last step, else drawn now."""
        pending, self.pending = self.pending, None
        if pending is None:
            return self.source.next(step)
        if pending.step != step:
            raise RuntimeError(f"batch {pending.step} was prefetched, but step {step} runs")
        # The snapshot memory as a batch drawn now would log it (after the last publish).
        pending.rollout.metrics.update(self.source.store.memory())
        return pending.rollout

    def prefetch(self, step: int) -> None:
        """Rolls out batch ``step`` now, while the trainer makes version ``step`` (its updates
        are dispatched), when ``rollout.prefetch`` is on and the batch reads only versions
        already published (``ScheduledRollouts.newest_read``): the same batch, drawn earlier."""
        source = self.source
        if not (
            self.config.rollout.prefetch
            and step < self.end
            and isinstance(source, ScheduledRollouts)
            and source.newest_read(step) < step
        ):
            return
        position = source.position()
        rollout = source.next(step)
        # Its compiled time lies inside the train step's compiled section, which timed it.
        rollout = dataclasses.replace(rollout, compiled_seconds=0.0)
        rollout.metrics["rollout/prefetched"] = 1.0
        self.pending = _Prefetched(step, rollout, position)

    def update(
        self, rollout: Rollout, step: int, during: Callable[[], None] | None = None
    ) -> dict[str, float]:
        """The optimizer updates of one batch (minibatches × updates_per_batch) at training step
        ``step``, whose parameters are version ``step`` (the batch's versions count the same).
        ``during`` runs once the updates are dispatched, before their metrics are read."""
        extra = dict(rollout.behaviour)
        if self.parts.spec.needs_ref:
            extra["ref"] = self.ref_params
        o = self.config.optim
        updates = []
        for _ in range(o.updates_per_batch):
            for mb in rollout.batch.minibatches(o.num_minibatches):
                share = trainer.shares_prompt(mb, self.parts.spec, self.config.data.max_prompt_len)
                self.state, metrics = self.train_step(
                    self.state, mb.shard(self.parts.mesh), extra, share=share, version=step
                )
                updates.append(metrics)
        if during is not None:
            during()
        return combine_updates(parallel.to_host(updates))

    def check_finite(self, step: int, train: dict[str, float]) -> None:
        """Warns about refused updates; raises ``NonFiniteError`` after too many in a row."""
        o = self.config.optim
        warning = self.nonfinite.check(
            step + 1, int(train["optim/nonfinite_updates"]), o.updates_per_batch * o.num_minibatches
        )
        if warning:
            self.log(warning)

    def record(
        self, step: int, rollout: Rollout, train: dict[str, float], train_s: float, step_s: float
    ) -> None:
        batch = rollout.batch
        metrics = batch_stats(batch, self.config.rollout.group_size)
        metrics.update(lag_stats(batch.versions, batch.response_mask, step))
        metrics.update(train)
        compiled = rollout.compiled_seconds
        metrics.update(
            {
                "time/step_s": step_s,
                # Wall time not spent waiting on compiled computations (host-side Python:
                # tokenising, scoring, batching, logging) as a share of the step.
                "time/outside_compiled_share": float("nan")
                if compiled is None
                else 1.0 - (compiled + train_s) / step_s,
                "time/train_s": train_s,
                **rollout.metrics,
            }
        )
        metrics["throughput/rollout_tokens_per_s"] = metrics["train/tokens"] / max(
            metrics["time/rollout_s"], 1e-9
        )
        self.logger.log(step + 1, metrics)
        self.history.append(metrics)
        self.progress.update(
            step + 1, {k: metrics[k] for k in ("train/reward_mean", "loss/mismatch", "lag/mean")}
        )

    def evaluate(self, step: int) -> None:
        with self.timer.compiled_section():
            self.eval_result = _eval(self.config, self.parts, self.state.params, step)
        self.logger.log(step, self.eval_result, prefix="eval")

    def hooks(self, done: int) -> None:
        """Evaluation and checkpoint after ``done`` steps, at their intervals."""
        if self.config.eval.every and done % self.config.eval.every == 0:
            self.evaluate(done)
        if self.config.checkpoint.every and done % self.config.checkpoint.every == 0:
            self.save(done)

    def finish(self) -> None:
        """The closing evaluation and checkpoint of a session that ran to its end."""
        if self.end > self.start:
            if self.config.eval.every and self.end % self.config.eval.every:
                self.evaluate(self.end)
            self.save(self.end)

    def save(self, step: int) -> None:
        if step in self.ckpt.all_steps():
            return
        state = {"state": self.state._asdict(), "ref": self.ref_params}
        # Host batches differ per process, and orbax writes host arrays from the primary only:
        # a multi-host run saves none (the source counts them as discarded, drawn again).
        arrays, source_meta = self.source.state(batches=jax.process_count() == 1)
        if self.pending is not None:  # its batch is drawn again after a resume
            source_meta["iterator"] = self.pending.position
        meta = {
            "step": step,
            "iterator": source_meta.pop("iterator"),
            "config": plain(self.config),
            "schedule_steps": self.horizon,
        }
        if source_meta:
            meta[_SOURCE] = source_meta
        if arrays:
            state[_SOURCE] = arrays
        store = self.source.store
        state["store"], meta["store_versions"] = store.state(), store.versions()
        self.ckpt.save(step, state, meta, force=True, unchecked=_DATA)
        self.upload_logs()

    def upload_logs(self) -> None:
        """Copies the logs into a URL workdir, beside its checkpoints."""
        if self.url is not None and self.primary:
            self.logger.flush()
            workdir_lib.upload_logs(self.workdir, self.url)

    def close(self) -> None:
        self.source.close()
        self.progress.close()
        self.ckpt.wait()
        self.upload_logs()
        self.logger.close()


def train(
    config, *, max_steps: int | None = None, quiet: bool = False, checked: Checked | None = None
) -> dict[str, Any]:
    """Runs (or resumes) a training run; returns a summary. See ``sat_jax.config``.

    ``checked``: what ``sat_jax.config.validate`` returned for ``config`` (the caller validated
    it); without it the config is validated here.

    Raises:
      ConfigError: ``config`` is impossible (before any compute).
      WorkdirLocked: another live process trains in the workdir (before any compute).
      LockLost: a gs:// workdir's lock was lost (its lease lapsed and another run took it);
        raised before a checkpoint write, which is not made.
      WorkdirURLError: a URL workdir with an empty or ``.`` path segment.
      WorkdirNotShared: a multi-host run's local workdir is not shared by its hosts.
      ResumeError: the workdir holds a run with another config and ``config.resume`` is set.
      NonFiniteError: ``config.optim.max_nonfinite_steps`` steps in a row had a non-finite loss
        or gradient (none of their updates was applied or saved).
    """
    if checked is None:
        checked = validate(
            config, num_devices=jax.device_count(), num_processes=jax.process_count()
        )
    workdir, ckpt_dir = workdir_lib.run_paths(config)
    url = workdir_lib.run_dir(config)
    url = workdir_lib.check_url(url) if workdir_lib.is_url(url) else None
    workdir_lib.check_shared(workdir if url is None else url)
    with WorkdirLock(url or workdir, "train") as lock:
        return _train(
            config,
            workdir,
            ckpt_dir,
            url=url,
            max_steps=max_steps,
            quiet=quiet,
            checked=checked,
            fence=lock.check,
        )


def _train(
    config, workdir: str, ckpt_dir: str, *, url, max_steps, quiet, checked, fence=None
) -> dict[str, Any]:
    log = (
        (lambda msg: None)
        if (quiet or not parallel.is_primary())
        else (lambda msg: print(msg, flush=True))
    )
    if not config.resume:
        _start_over(workdir, ckpt_dir, log, url)
    with Checkpointer(ckpt_dir, max_to_keep=config.checkpoint.max_to_keep, fence=fence) as ckpt:
        resumed = _check_resumable(config, ckpt, workdir)
        horizon = _schedule_horizon(config, ckpt if resumed is not None else None)
        cosine = config.optim.schedule == "cosine"
        if resumed is not None and resumed >= config.num_steps:
            more = (
                f"its cosine schedule decays to 0 at step {horizon} (optim.decay_steps), which "
                "resuming keeps, so continue past it in a new run"
                if cosine
                else "raise --config.num_steps to continue it"
            )
            log(
                f"the run in {workdir} is finished (step {resumed} of num_steps="
                f"{config.num_steps}); {more}, or start over with --config.resume=False"
            )
            return {
                "workdir": workdir,
                "start_step": resumed,
                "end_step": resumed,
                "finished": True,
                "interrupted": False,
                "signal": None,
                "wall_seconds": 0.0,
                "compiled_seconds": 0.0,
                "outside_compiled_share": 0.0,
                "history": [],
                "final_eval": None,
                "state": None,
            }
        if resumed is not None and cosine and config.num_steps > horizon:
            raise ResumeError(
                f"num_steps={config.num_steps} runs past the cosine schedule's horizon of "
                f"{horizon} steps in {workdir} (optim.decay_steps; num_steps at the run's first "
                "start when 0), where the rate is 0: resuming keeps the horizon. Start a new "
                "run (another --workdir, or --config.resume=False) with the longer horizon"
            )
        # Installed from the session's start through its closing evaluation, save and log upload:
        # a signal at any of those moments ends with a checkpoint, never a half-written one.
        stop = StopFlag()
        interrupted = False
        with stop:
            s = _Session(
                config,
                max_steps=max_steps,
                quiet=quiet,
                ckpt=ckpt,
                workdir=workdir,
                log=log,
                horizon=horizon,
                checked=checked,
                url=url,
            )
            try:
                if s.start == 0 and config.eval.every:
                    s.evaluate(0)
                s.source.start()
                for step in range(s.start, s.end):
                    t0 = time.perf_counter()
                    rollout = s.rollout(step)
                    s.timer.add_compiled(rollout.compiled_seconds)
                    t1 = time.perf_counter()
                    with s.timer.compiled_section():
                        train_metrics = s.update(
                            rollout, step, during=lambda step=step: s.prefetch(step + 1)
                        )
                    train_s = time.perf_counter() - t1
                    s.source.publish(step + 1, s.state.params)
                    s.record(step, rollout, train_metrics, train_s, time.perf_counter() - t0)
                    s.check_finite(step, train_metrics)
                    s.hooks(step + 1)
                    if stop.agreed():
                        interrupted = True
                        s.save(step + 1)
                        log(f"interrupted: checkpoint saved at step {step + 1} in {workdir}")
                        break
                if not interrupted:
                    s.finish()
            finally:
                s.close()
            if not interrupted and stop.agreed():
                # Signalled during the closing evaluation, save or upload, on some host: the
                # closing checkpoint is written, and every host exits with the signal's status,
                # as a scheduler expects of a preempted process.
                interrupted = True
                log(f"interrupted after the last step: checkpoint at step {s.end} in {workdir}")
    wall = s.timer.wall
    if s.primary and config.log.plots and not interrupted:
        with contextlib.suppress(Exception):
            plot_run(workdir)
        s.upload_logs()
    return {
        "workdir": workdir,
        "start_step": s.start,
        "end_step": s.start + len(s.history),
        "finished": False,
        "interrupted": interrupted,
        "signal": stop.signum if interrupted else None,
        "wall_seconds": wall,
        "compiled_seconds": s.timer.compiled,
        "outside_compiled_share": 1.0 - s.timer.compiled / wall if wall > 0 else 0.0,
        "history": s.history,
        "final_eval": s.eval_result,
        "state": s.state,
    }
