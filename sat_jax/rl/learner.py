"""The host loop that ties rollouts, the trainer step, snapshots, evaluation, logs and checkpoints.

    rollout source (lag schedule, snapshot store) → scored batch + behaviour parameters
            → trainer step → new parameter version → rollout source → eval / checkpoint hooks

The loop (:func:`train`) only reads the next batch, steps, publishes the new version and runs the
hooks; which version samples which batch and which versions stay in memory is the rollout
source's business (``sat_jax.rl.rollout_sources``), building the components is
``sat_jax.rl.components``,
Ctrl-C and timers are ``sat_jax.rl.controls``.

Reproducibility: randomness comes from named streams of the seed (``sat_jax.rl.rng``), the prompt
iterator, optimizer state and snapshot store are checkpointed, so in the ``fixed`` and
``broadcast`` modes a run killed at any point and resumed logs the same metrics as an
uninterrupted one, each step once. Resuming refuses a workdir whose run has a different config
(``sat_jax.config.changed_fields``); ``resume=False`` moves an earlier run's outputs aside and
starts over.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from typing import Any

import jax
from etils import epath

from sat_jax import parallel
from sat_jax.config.validation import changed_fields, loss_spec, plain, validate
from sat_jax.data import PromptIterator
from sat_jax.rl import rng, trainer
from sat_jax.rl.components import Components, build, build_sources, shared_train_step
from sat_jax.rl.controls import StopFlag, Timer
from sat_jax.rl.lag import LagSchedule, lag_stats
from sat_jax.rl.rollout import batch_stats, evaluate
from sat_jax.rl.rollout_sources import Rollout, RolloutSource, ScheduledRollouts
from sat_jax.rl.stream import StreamRollouts
from sat_jax.run import workdir as workdir_lib
from sat_jax.run.checkpoint import Checkpointer
from sat_jax.run.metrics import METRICS_FILE, RunLogger
from sat_jax.run.plots import plot_run
from sat_jax.run.progress import Progress

__all__ = [
    "Components",
    "ResumeError",
    "build",
    "build_sources",
    "evaluate_run",
    "loss_spec",
    "make_source",
    "train",
]

# Run outputs moved aside when a run starts over in the same workdir.
_OUTPUTS = (METRICS_FILE, "config.json", "config.yaml", "tensorboard", "plots")


class ResumeError(ValueError):
    """The workdir holds a different run; the message names the differing fields."""


def make_source(config, parts: Components, prompts, *, first_step: int) -> RolloutSource:
    """The rollout source of ``config.lag_mode``."""
    common = dict(
        needs_old=parts.spec.needs_old, placement=config.snapshot_placement, view=parts.rollout_view
    )
    if config.lag_mode == "stream":
        return StreamRollouts(
            parts.engine,
            prompts,
            config.seed,
            queue_size=max(1, config.lag),
            chunk=config.rollout.stream_chunk,
            first_index=first_step,
            **common,
        )
    schedule = LagSchedule(config.lag_mode, config.lag, config.lag_dist, config.lag_cap)
    return ScheduledRollouts(parts.engine, schedule, prompts, config.seed, **common)


def _eval(config, parts: Components, params, step: int) -> dict[str, float]:
    """Held-out evaluation of ``params`` at ``step``: the same keys in training and ``eval``."""
    return evaluate(
        parts.engine,
        parts.rollout_view(params),
        parts.eval_examples,
        config.rollout.prompts_per_step // jax.process_count(),
        rng.key(config.seed, "eval", step),
        version=step,
    )


def _restore_target(state, params, ref_params):
    def target(meta):
        return {
            "state": state._asdict(),
            "store": {str(v): params for v in meta["store_versions"]},
            "ref": ref_params,
        }

    return target


def evaluate_run(config) -> dict[str, Any]:
    """Held-out evaluation of the latest valid checkpoint of ``config``'s run directory; equal to
    the in-training evaluation at that step."""
    workdir, ckpt_dir = workdir_lib.run_paths(config)
    parts = build(config)
    state = trainer.init_train_state(
        parts.params, parts.optimizer, parts.mesh, config=parts.model_cfg
    )
    with Checkpointer(ckpt_dir) as ckpt:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint in {workdir}")
        restored, _, step = ckpt.restore(_restore_target(state, parts.params, parts.params))
    return {
        "workdir": workdir,
        "step": step,
        **_eval(config, parts, restored["state"]["params"], step),
    }


def _start_over(workdir: str, ckpt_dir: str, log) -> None:
    """Moves an earlier run's checkpoints and outputs to ``<workdir>/replaced-<time>/``."""
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


class _Session:
    """One training session: the run's parts, state, rollout source, logs and checkpoints."""

    def __init__(self, config, *, max_steps, quiet, ckpt, workdir, log):
        self.config, self.ckpt, self.workdir, self.log = config, ckpt, workdir, log
        self.primary = parallel.is_primary()
        self.parts = parts = build(config, log)
        # Reused from an earlier run of this process with the same program (a study's grid).
        self.train_step = shared_train_step(config, parts, donate=True)
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
        if config.resume and ckpt.latest_step() is not None:
            restored, meta, self.start = ckpt.restore(
                _restore_target(self.state, parts.params, self.ref_params)
            )
            self.iterator.restore(meta["iterator"])
        self.source = make_source(config, parts, self.iterator, first_step=self.start)
        if restored is not None:
            self.state = trainer.TrainState(**restored["state"])
            self.source.store.load(restored["store"])
            self.ref_params = restored["ref"]
            log(f"resumed from {workdir} at step {self.start}")
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
        self.history: list[dict[str, float]] = []
        self.eval_result = None

    def update(self, rollout: Rollout) -> dict[str, float]:
        """The optimizer updates of one batch (minibatches × updates_per_batch)."""
        extra = dict(rollout.behaviour)
        if self.parts.spec.needs_ref:
            extra["ref"] = self.ref_params
        o = self.config.optim
        for _ in range(o.updates_per_batch):
            for mb in rollout.batch.minibatches(o.num_minibatches):
                share = trainer.shares_prompt(mb, self.parts.spec, self.config.data.max_prompt_len)
                self.state, metrics = self.train_step(
                    self.state, mb.shard(self.parts.mesh), extra, share=share
                )
        return {k: float(v) for k, v in parallel.to_host(metrics).items()}

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
        store = self.source.store
        self.ckpt.save(
            step,
            {"state": self.state._asdict(), "store": store.state(), "ref": self.ref_params},
            {
                "step": step,
                "iterator": self.iterator.state(),
                "store_versions": store.versions(),
                "config": plain(self.config),
            },
            force=True,
        )

    def close(self) -> None:
        self.source.close()
        self.progress.close()
        self.ckpt.wait()
        self.logger.close()


def train(config, *, max_steps: int | None = None, quiet: bool = False) -> dict[str, Any]:
    """Runs (or resumes) a training run; returns a summary. See ``sat_jax.config``.

    Raises:
      ConfigError: ``config`` is impossible (before any compute).
      ResumeError: the workdir holds a run with another config and ``config.resume`` is set.
    """
    validate(config, num_devices=jax.device_count(), num_processes=jax.process_count())
    workdir, ckpt_dir = workdir_lib.run_paths(config)
    log = (
        (lambda msg: None)
        if (quiet or not parallel.is_primary())
        else (lambda msg: print(msg, flush=True))
    )
    if not config.resume:
        _start_over(workdir, ckpt_dir, log)
    with Checkpointer(ckpt_dir, max_to_keep=config.checkpoint.max_to_keep) as ckpt:
        resumed = _check_resumable(config, ckpt, workdir)
        if resumed is not None and resumed >= config.num_steps:
            log(
                f"the run in {workdir} is finished (step {resumed} of num_steps="
                f"{config.num_steps}); raise --config.num_steps to continue it, or start over "
                "with --config.resume=False"
            )
            return {
                "workdir": workdir,
                "start_step": resumed,
                "end_step": resumed,
                "finished": True,
                "interrupted": False,
                "wall_seconds": 0.0,
                "compiled_seconds": 0.0,
                "outside_compiled_share": 0.0,
                "history": [],
                "final_eval": None,
                "state": None,
            }
        s = _Session(config, max_steps=max_steps, quiet=quiet, ckpt=ckpt, workdir=workdir, log=log)
        interrupted = False
        try:
            if s.start == 0 and config.eval.every:
                s.evaluate(0)
            s.source.start()
            with StopFlag() as stop:
                for step in range(s.start, s.end):
                    t0 = time.perf_counter()
                    rollout = s.source.next(step)
                    s.timer.add_compiled(rollout.compiled_seconds)
                    t1 = time.perf_counter()
                    with s.timer.compiled_section():
                        train_metrics = s.update(rollout)
                    train_s = time.perf_counter() - t1
                    s.source.publish(step + 1, s.state.params)
                    s.record(step, rollout, train_metrics, train_s, time.perf_counter() - t0)
                    s.hooks(step + 1)
                    if stop.requested:
                        interrupted = True
                        s.save(step + 1)
                        log(f"interrupted: checkpoint saved at step {step + 1} in {workdir}")
                        break
            if not interrupted:
                s.finish()
        finally:
            s.close()
    wall = s.timer.wall
    if s.primary and config.log.plots and not interrupted:
        with contextlib.suppress(Exception):
            plot_run(workdir)
    return {
        "workdir": workdir,
        "start_step": s.start,
        "end_step": s.start + len(s.history),
        "finished": False,
        "interrupted": interrupted,
        "wall_seconds": wall,
        "compiled_seconds": s.timer.compiled,
        "outside_compiled_share": 1.0 - s.timer.compiled / wall if wall > 0 else 0.0,
        "history": s.history,
        "final_eval": s.eval_result,
        "state": s.state,
    }
