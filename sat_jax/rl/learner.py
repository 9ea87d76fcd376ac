"""The host loop that ties rollouts, the trainer step, snapshots, evaluation, logs and checkpoints.

    prompts → rollout (sampler on a stale snapshot) → scored, grouped batch → trainer step
            → new parameter version → snapshot store

Reproducibility: all randomness of step j derives from ``fold_in(key(seed), j)``, the prompt
iterator, optimizer state and snapshot store are checkpointed, so in the ``fixed`` and
``broadcast`` modes a run killed at any point and resumed logs the same metrics as an
uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sat_jax import default_config, parallel
from sat_jax.checkpoint import Checkpointer
from sat_jax.data import (
    CharTokenizer,
    JsonlSource,
    PromptIterator,
    TaskSource,
    TfdsSource,
    make_task,
)
from sat_jax.logging import Progress, RunLogger, plot_run
from sat_jax.models import ModelConfig, init_model, load_hf
from sat_jax.rl import sft, trainer
from sat_jax.rl.lag import LagSchedule, lag_stats
from sat_jax.rl.rollout import RolloutEngine, batch_stats, evaluate
from sat_jax.rl.snapshots import SnapshotStore
from sat_jax.rl.stream import StreamRollouts
from sat_jax.sampling import Sampler, SamplingParams
from sat_jax.tokenizers import HFTokenizer, qwen_chat_prompt


def loss_spec(config) -> trainer.LossSpec:
    """The objective's plain arguments from the config (configuration stops at this edge)."""
    c = config.loss
    name = c.objective
    kw: dict[str, Any] = {}
    if name in ("ppo", "grpo", "sat", "sat_grpo", "gspo", "gspo_token", "sat_gspo", "seqclip",
                "dppo"):
        kw.update(eps_low=c.eps_low, eps_high=c.eps_high)
    if name in ("sat", "sat_grpo", "sat_gspo"):
        kw.update(alpha=float(c.alpha), hill_exponent=c.hill_exponent)
    if name in ("ppo", "grpo", "sat", "sat_grpo") and c.dual_clip > 0:
        kw["dual_clip"] = c.dual_clip
    if name == "dppo":
        kw["divergence"] = c.divergence
        if c.delta > 0:
            kw["delta"] = c.delta
    if name == "drpo" and c.delta > 0:
        kw["delta"] = c.delta
    if name == "spo":
        kw["eps"] = c.spo_eps
    if name == "seqclip":
        kw.update(low=c.seqclip_low, high=c.seqclip_high)
    corr: dict[str, Any] = {}
    if c.correction == "tis":
        corr = {"cap": c.tis_cap}
    elif c.correction == "icepop":
        corr = {"low": c.icepop_low, "high": c.icepop_high}
    return trainer.LossSpec(
        objective=name,
        objective_kwargs=tuple(sorted(kw.items())),
        aggregation=c.aggregation,
        correction=c.correction,
        correction_kwargs=tuple(sorted(corr.items())),
        ratio_denominator=c.ratio_denominator,
        kl_coef=float(c.kl_coef),
        r3=bool(c.r3),
        support_replay=bool(c.support_replay),
        temperature=float(config.rollout.temperature),
        router_aux=config.model.router_aux_loss_coef > 0,
    )


def build_sources(config):
    """(train source, held-out eval examples, task or None) from ``config.data``."""
    d = config.data
    if d.source == "task":
        task = make_task(d.task, num_digits=d.num_digits, eval_size=d.eval_size, seed=0)
        return TaskSource(task, "train"), TaskSource(task, "eval"), task
    if d.source == "jsonl":
        def jsonl(path):
            return JsonlSource(os.path.expanduser(path), prompt_field=d.prompt_field,
                               answer_field=d.answer_field)

        src = jsonl(d.path)
        return src, jsonl(d.eval_path) if d.eval_path else src, None
    kwargs = dict(data_dir=d.tfds_data_dir or None, prompt_field=d.prompt_field,
                  answer_field=d.answer_field)
    return (TfdsSource(d.tfds_name, split=d.split, **kwargs),
            TfdsSource(d.tfds_name, split=d.eval_split, **kwargs), None)


class _StopFlag:
    """First Ctrl-C asks the loop to checkpoint and stop after the current step; a second one
    interrupts at once."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        if jax.process_count() == 1 and _in_main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, *_):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nstopping after this step (Ctrl-C again to abort without saving)", flush=True)

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class _Timer:
    """Accumulates wall time spent inside compiled computations (blocked on their results)."""

    def __init__(self):
        self.compiled = 0.0

    @contextlib.contextmanager
    def compiled_section(self):
        t0 = time.perf_counter()
        yield
        self.compiled += time.perf_counter() - t0


@dataclasses.dataclass
class Components:
    """Everything a run is built from (shared by training and ``sat-jax eval``)."""

    mesh: Any
    tokenizer: Any
    model_cfg: ModelConfig
    graphdef: Any
    params: Any  # post-warm-up, replicated on the mesh
    engine: RolloutEngine
    train_src: Any
    eval_examples: list
    spec: trainer.LossSpec
    optimizer: Any
    sft_info: dict
    rollout_device: Any = None

    def rollout_view(self, params):
        """The parameters the rollout engine samples from: this process's replica, or a copy on
        the reserved rollout device."""
        if self.rollout_device is not None:
            return jax.device_put(params, self.rollout_device)
        return parallel.local_view(params)


def build(config, log=lambda msg: None) -> Components:
    """Builds data, model (with its cached warm-up), rollout engine, loss and optimizer."""
    devices = jax.devices()
    rollout_device = None
    if config.mesh.rollout_device >= 0:
        rollout_device = jax.local_devices()[config.mesh.rollout_device]
        devices = [d for d in devices if d != rollout_device]
    mesh = parallel.make_mesh(config.mesh.data, devices)
    train_src, eval_src, task = build_sources(config)
    model_fields = config.model.to_dict()
    hf_path = os.path.expanduser(model_fields.pop("hf_path"))
    if config.data.tokenizer == "char":
        tokenizer = CharTokenizer()
    else:
        tokenizer = HFTokenizer(os.path.expanduser(config.data.tokenizer),
                                eos_token=config.data.eos_token or None)
    if hf_path:
        model_cfg, graphdef, params = load_hf(
            hf_path, router_aux_loss_coef=model_fields["router_aux_loss_coef"],
            remat=model_fields["remat"],
        )
        if tokenizer.vocab_size > model_cfg.vocab_size:
            raise ValueError(f"the tokenizer's {tokenizer.vocab_size} ids exceed the model's "
                             f"vocab_size {model_cfg.vocab_size}")
        log(f"loaded {hf_path}")
    else:
        model_cfg = ModelConfig(vocab_size=tokenizer.vocab_size, **model_fields)
        graphdef, params = init_model(model_cfg, seed=config.seed)
    prompt_width, response_width = config.data.max_prompt_len, config.data.max_new_tokens
    sft_info: dict[str, float] = {}
    # The warm-up makes a weak base policy for the built-in tasks; a loaded checkpoint is one.
    if task is not None and config.sft.steps > 0 and not hf_path:
        t0 = time.perf_counter()
        params, sft_info = sft.warmup(
            graphdef, params, tokenizer, task,
            steps=config.sft.steps, batch_size=config.sft.batch_size,
            learning_rate=config.sft.learning_rate, seed=config.seed,
            prompt_width=prompt_width, response_width=response_width,
            cache_dir=config.sft.cache_dir,
            cache_spec={"model": config.model.to_dict(), "data": config.data.to_dict(),
                        "vocab": tokenizer.vocab_size},
            log=log,
        )
        sft_info["sft/seconds"] = time.perf_counter() - t0
        log(f"warm-up: {'cached' if sft_info.get('sft/cached') else 'trained'} "
            f"({sft_info['sft/seconds']:.1f}s)")
    sampler = Sampler(model_cfg, max_prompt_len=prompt_width, max_new_tokens=response_width,
                      eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                      dtype=jnp.dtype(config.rollout.dtype))
    engine = RolloutEngine(
        sampler=sampler, tokenizer=tokenizer, reward_fn=train_src.reward,
        group_size=config.rollout.group_size,
        sampling=SamplingParams(config.rollout.temperature, config.rollout.top_p,
                                config.rollout.top_k),
        advantage=config.loss.advantage,
        prompt_format=(lambda text: qwen_chat_prompt([{"role": "user", "content": text}]))
        if config.data.chat_template else None,
    )
    total = config.num_steps * config.optim.updates_per_batch * config.optim.num_minibatches
    optimizer = trainer.make_optimizer(
        config.optim.learning_rate, b1=config.optim.b1, b2=config.optim.b2,
        grad_clip=config.optim.grad_clip, weight_decay=config.optim.weight_decay,
        warmup_steps=config.optim.warmup_steps, schedule=config.optim.schedule,
        total_steps=total,
    )
    eval_examples = [eval_src[i] for i in range(min(config.eval.num_prompts, len(eval_src)))]
    return Components(
        mesh=mesh, tokenizer=tokenizer, model_cfg=model_cfg, graphdef=graphdef,
        params=parallel.replicate(params, mesh), engine=engine, train_src=train_src,
        eval_examples=eval_examples, spec=loss_spec(config), optimizer=optimizer,
        sft_info=sft_info, rollout_device=rollout_device,
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
    """Held-out evaluation of the latest valid checkpoint of ``config``'s run directory."""
    workdir, ckpt_dir = default_config.run_paths(config)
    parts = build(config)
    state = trainer.init_train_state(parts.params, parts.optimizer)
    with Checkpointer(ckpt_dir) as ckpt:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint in {workdir}")
        restored, _, step = ckpt.restore(_restore_target(state, parts.params, parts.params))
    params = restored["state"]["params"]
    res = evaluate(parts.engine, params, parts.eval_examples, config.rollout.prompts_per_step,
                   jax.random.fold_in(jax.random.key(config.seed), 3 * 10**7 + step),
                   version=step)
    return {"workdir": workdir, "step": step, **res}


def train(config, *, max_steps: int | None = None, quiet: bool = False) -> dict[str, Any]:
    """Runs (or resumes) a training run; returns a summary. See ``sat_jax.default_config``."""
    default_config.validate(config, num_devices=jax.device_count(),
                                    num_processes=jax.process_count())
    workdir, ckpt_dir = default_config.run_paths(config)
    primary = parallel.is_primary()
    log = (lambda msg: None) if (quiet or not primary) else (lambda msg: print(msg, flush=True))
    parts = build(config, log)
    mesh, engine, spec, params = parts.mesh, parts.engine, parts.spec, parts.params
    eval_examples, sft_info = parts.eval_examples, parts.sft_info
    prompt_width = config.data.max_prompt_len
    train_step = trainer.make_train_step(parts.graphdef, parts.optimizer, spec,
                                         prompt_width=prompt_width, mesh=mesh)
    ref_params = params
    # Every leaf on the mesh, the step counters included: the step returns them replicated, and an
    # uncommitted input at step 1 would make step 2 a cache miss (a second compilation).
    state = parallel.replicate(trainer.init_train_state(params, parts.optimizer), mesh)
    schedule = LagSchedule(config.lag_mode, int(config.lag))
    capacity = config.lag + 3 if config.lag_mode != "stream" else config.lag + 8
    store = SnapshotStore(capacity, config.snapshot_placement)
    # prompts_per_step is global; each process rolls out its own contiguous share of it.
    iterator = PromptIterator(parts.train_src, config.rollout.prompts_per_step,
                              seed=config.seed, process_index=jax.process_index(),
                              process_count=jax.process_count())
    key = jax.random.key(config.seed)

    # ------------------------------------------------------------------ resume
    ckpt = Checkpointer(ckpt_dir,
                        max_to_keep=config.checkpoint.max_to_keep)
    start = 0
    if config.resume and ckpt.latest_step() is not None:
        restored, meta, start = ckpt.restore(_restore_target(state, params, ref_params))
        state = trainer.TrainState(**restored["state"])
        store.load(restored["store"])
        ref_params = restored["ref"]
        iterator.restore(meta["iterator"])
        log(f"resumed from {workdir} at step {start}")
    else:
        store.put(0, params)

    logger = RunLogger(workdir, config=config.to_dict(), enable_tensorboard=config.log.tensorboard,
                       is_primary=primary, resume_step=start if start else None)
    if sft_info and start == 0:
        logger.log(0, sft_info)

    def save(step):
        if step in ckpt.all_steps():
            return
        ckpt.save(step, {"state": state._asdict(), "store": store.state(), "ref": ref_params},
                  {"iterator": iterator.state(), "store_versions": store.versions(),
                   "config": json.loads(json.dumps(config.to_dict(), default=str))},
                  force=True)

    def run_eval(step):
        with timer.compiled_section():
            res = evaluate(engine, parts.rollout_view(state.params), eval_examples,
                           config.rollout.prompts_per_step // jax.process_count(),
                           jax.random.fold_in(key, 10**7 + step), version=step)
        logger.log(step, res, prefix="eval")
        return res

    timer = _Timer()
    stream = None
    if config.lag_mode == "stream":
        stream = StreamRollouts(engine, store, iterator, jax.random.fold_in(key, 2 * 10**7),
                                queue_size=max(1, int(config.lag)),
                                chunk=config.rollout.stream_chunk, first_index=start,
                                view=parts.rollout_view).start()
    end = config.num_steps if max_steps is None else min(config.num_steps, start + max_steps)
    progress = Progress(end, is_primary=primary and config.log.progress and not quiet)
    history: list[dict[str, float]] = []
    t_start = time.perf_counter()
    interrupted = False
    eval_result = None
    if start == 0 and config.eval.every:
        eval_result = run_eval(0)
    try:
        with _StopFlag() as stop:
            for step in range(start, end):
                t0 = time.perf_counter()
                compiled_before = timer.compiled
                if stream is None:
                    version = schedule.version_for(step)
                    examples = next(iterator)
                    with timer.compiled_section():
                        out = engine.generate(
                            parts.rollout_view(store.get(version)), examples,
                            jax.random.fold_in(jax.random.fold_in(key, step), jax.process_index()),
                            version,
                        )
                        jax.block_until_ready(out.tokens)
                    batch = engine.score(examples, out)
                    wait = 0.0
                else:
                    t_wait = time.perf_counter()
                    batch = stream.get()
                    wait = time.perf_counter() - t_wait
                t_roll = time.perf_counter() - t0
                metrics = batch_stats(batch, config.rollout.group_size)
                metrics.update(lag_stats(batch["versions"], batch["response_mask"], step))
                extra = {}
                if spec.needs_old:
                    live = batch["versions"][batch["response_mask"]]
                    old_version = int(live.min()) if live.size else step
                    extra["old"] = store.get(old_version)
                if spec.needs_ref:
                    extra["ref"] = ref_params
                t1 = time.perf_counter()
                step_metrics = None
                with timer.compiled_section():
                    for _ in range(config.optim.updates_per_batch):
                        for mb in _minibatches(batch, config.optim.num_minibatches):
                            device_batch = parallel.shard_batch(mb, trainer.BATCH_SPECS, mesh)
                            state, step_metrics = train_step(state, device_batch, extra)
                    step_metrics = parallel.to_host(step_metrics)
                t_train = time.perf_counter() - t1
                store.put(step + 1, state.params)
                if stream is None:  # stream mode keeps the newest `capacity` versions
                    store.retain(schedule.needed_after(step) | {step + 1})
                metrics.update({k: float(v) for k, v in step_metrics.items()})
                step_s = time.perf_counter() - t0
                metrics.update({
                    "time/step_s": step_s,
                    # Wall time not spent waiting on compiled computations (host-side Python:
                    # tokenising, scoring, batching, logging) as a share of the step.
                    "time/outside_compiled_share": 1.0 - (timer.compiled - compiled_before) / step_s
                    if stream is None else float("nan"),
                    "time/rollout_s": t_roll,
                    "time/train_s": t_train,
                    "time/queue_wait_s": wait,
                    "throughput/rollout_tokens_per_s": metrics["train/tokens"] / max(t_roll, 1e-9),
                })
                if stream is not None:
                    metrics["stream/swaps"] = float(stream.swaps)
                logger.log(step + 1, metrics)
                history.append(metrics)
                progress.update(step + 1, {k: metrics[k] for k in
                                           ("train/reward_mean", "loss/mismatch", "lag/mean")})
                done = step + 1
                if config.eval.every and done % config.eval.every == 0:
                    eval_result = run_eval(done)
                if config.checkpoint.every and done % config.checkpoint.every == 0:
                    save(done)
                if stop.requested:
                    interrupted = True
                    save(done)
                    log(f"interrupted: checkpoint saved at step {done} in {workdir}")
                    break
        if not interrupted and end > start:
            if config.eval.every and end % config.eval.every:
                eval_result = run_eval(end)
            save(end)
    finally:
        if stream is not None:
            stream.stop()
        progress.close()
        ckpt.wait()
        ckpt.close()
        logger.close()
    wall = time.perf_counter() - t_start
    if primary and config.log.plots and not interrupted:
        with contextlib.suppress(Exception):
            plot_run(workdir)
    summary = {
        "workdir": workdir,
        "start_step": start,
        "end_step": start + len(history),
        "interrupted": interrupted,
        "wall_seconds": wall,
        "compiled_seconds": timer.compiled,
        "outside_compiled_share": 1.0 - timer.compiled / wall if wall > 0 else 0.0,
        "history": history,
        "final_eval": eval_result,
        "state": state,
    }
    return summary


def _minibatches(batch: dict[str, np.ndarray], num: int):
    if num == 1:
        yield batch
        return
    size = batch["tokens"].shape[0] // num
    for i in range(num):
        sl = slice(i * size, (i + 1) * size)
        yield {k: batch[k][:, sl] if k == "routing" else batch[k][sl] for k in trainer.BATCH_SPECS}
