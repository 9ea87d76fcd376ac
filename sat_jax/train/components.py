"""Building a run's components from its config: data, tokenizer, model (with its cached warm-up),
rollout engine, loss, optimizer and mesh. Shared by training and ``sat-jax eval``."""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp

from sat_jax import parallel
from sat_jax.config.validation import check_data_rows, full_eval_steps, loss_spec
from sat_jax.data import CharTokenizer, HFTokenizer, build_sources, user_prompt
from sat_jax.models import ModelConfig, check_mesh, init_model, load_hf, param_shardings
from sat_jax.rl import sft, trainer
from sat_jax.rl.rollout import RolloutEngine
from sat_jax.sampling import ContinuousSampler, Sampler, SamplingParams


@dataclasses.dataclass
class Components:
    """Everything a run is built from (shared by training and ``sat-jax eval``)."""

    mesh: Any
    tokenizer: Any
    model_cfg: ModelConfig
    graphdef: Any
    params: Any  # post-warm-up, in the sharding table on the mesh
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


def make_sampler(config, model_cfg: ModelConfig, tokenizer) -> Sampler | ContinuousSampler:
    """The rollout engine of ``config.rollout.engine``: the static batch or the decode slots."""
    r = config.rollout
    common = dict(
        max_prompt_len=config.data.max_prompt_len,
        max_new_tokens=config.data.max_new_tokens,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        dtype=jnp.dtype(r.dtype),
    )
    if r.engine == "static":
        return Sampler(model_cfg, router_noise=float(r.router_noise), **common)
    sequences = r.prompts_per_step // jax.process_count() * r.group_size
    return ContinuousSampler(
        model_cfg,
        num_slots=r.num_slots or sequences,
        harvest_every=r.harvest_every,
        group_size=r.group_size,
        prefill_chunk=r.prefill_chunk or None,
        **common,
    )


def build(config, log=lambda msg: None, *, warmup: bool = True) -> Components:
    """Builds data, model (with its cached warm-up), rollout engine, loss and optimizer.

    ``warmup=False`` leaves the parameters at their initialisation, for callers that restore a
    checkpoint over them (a resumed run, ``eval``): an uncached warm-up would be trained only to
    be overwritten.
    """
    devices = jax.devices()
    rollout_device = None
    if config.mesh.rollout_device >= 0:
        rollout_device = jax.local_devices()[config.mesh.rollout_device]
        devices = [d for d in devices if d != rollout_device]
    mesh = parallel.make_mesh(
        config.mesh.data,
        devices,
        fsdp=config.mesh.fsdp,
        expert=config.mesh.expert,
        tensor=config.mesh.tensor,
    )
    train_src, eval_src, task = build_sources(config.data)
    model_fields = config.model.to_dict()
    hf_path = os.path.expanduser(model_fields.pop("hf_path"))
    if config.data.tokenizer == "char":
        tokenizer = CharTokenizer()
    else:
        tokenizer = HFTokenizer(
            os.path.expanduser(config.data.tokenizer), eos_token=config.data.eos_token or None
        )
    check_data_rows(config, train_src, eval_src, tokenizer, task)
    if hf_path:
        model_cfg, graphdef, params = load_hf(
            hf_path,
            router_aux_loss_coef=model_fields["router_aux_loss_coef"],
            dtype=jnp.dtype(model_fields["dtype"]),
            param_dtype=jnp.dtype(model_fields["param_dtype"]),
            mesh=mesh,
            remat=model_fields["remat"],
            moe_impl=model_fields["moe_impl"],
            attention_chunk=model_fields["attention_chunk"],
        )
        if tokenizer.vocab_size > model_cfg.vocab_size:
            raise ValueError(
                f"the tokenizer's {tokenizer.vocab_size} ids exceed the model's "
                f"vocab_size {model_cfg.vocab_size}"
            )
        log(f"loaded {hf_path}")
    else:
        model_cfg = ModelConfig(vocab_size=tokenizer.vocab_size, **model_fields)
        check_mesh(model_cfg, mesh)
        graphdef, params = init_model(model_cfg, seed=config.seed)
    prompt_width, response_width = config.data.max_prompt_len, config.data.max_new_tokens
    sft_info: dict[str, float] = {}
    # The warm-up makes a weak base policy for the built-in tasks; a loaded checkpoint is one.
    if warmup and task is not None and config.sft.steps > 0 and not hf_path:
        t0 = time.perf_counter()
        params, sft_info = sft.warmup(
            graphdef,
            params,
            tokenizer,
            task,
            steps=config.sft.steps,
            batch_size=config.sft.batch_size,
            learning_rate=config.sft.learning_rate,
            seed=config.seed,
            prompt_width=prompt_width,
            response_width=response_width,
            cache_dir=config.sft.cache_dir,
            corrupt_share=config.sft.corrupt_share,
            schedule=config.sft.schedule,
            cache_spec={
                "model": config.model.to_dict(),
                "data": config.data.to_dict(),
                "vocab": tokenizer.vocab_size,
            },
            log=log,
        )
        sft_info["sft/seconds"] = time.perf_counter() - t0
        log(
            f"warm-up: {'cached' if sft_info.get('sft/cached') else 'trained'} "
            f"({sft_info['sft/seconds']:.1f}s)"
        )
    sampler = make_sampler(config, model_cfg, tokenizer)
    engine = RolloutEngine(
        sampler=sampler,
        tokenizer=tokenizer,
        reward_fn=train_src.reward,
        group_size=config.rollout.group_size,
        sampling=SamplingParams(
            config.rollout.temperature, config.rollout.top_p, config.rollout.top_k
        ),
        advantage=config.loss.advantage,
        prompt_format=user_prompt if config.data.chat_template else None,
    )
    total = schedule_updates(config)
    optimizer = trainer.make_optimizer(
        config.optim.learning_rate,
        b1=config.optim.b1,
        b2=config.optim.b2,
        grad_clip=config.optim.grad_clip,
        weight_decay=config.optim.weight_decay,
        warmup_steps=config.optim.warmup_steps,
        schedule=config.optim.schedule,
        total_steps=total,
    )
    # The largest evaluation's prefix; smaller evaluations read its first rows.
    rows = config.eval.num_prompts
    if full_eval_steps(config):
        rows = max(rows, config.eval.full_num_prompts)
    eval_examples = [eval_src[i] for i in range(min(rows, len(eval_src)))]
    return Components(
        mesh=mesh,
        tokenizer=tokenizer,
        model_cfg=model_cfg,
        graphdef=graphdef,
        params=jax.device_put(params, param_shardings(model_cfg, mesh)),
        engine=engine,
        train_src=train_src,
        eval_examples=eval_examples,
        spec=loss_spec(config),
        optimizer=optimizer,
        sft_info=sft_info,
        rollout_device=rollout_device,
    )


def schedule_updates(config) -> int:
    """Optimizer updates the learning-rate schedule spans: ``optim.decay_steps`` training steps
    (``num_steps`` when 0; a resumed run passes the horizon of its first start) times the
    updates of each step."""
    o = config.optim
    return (o.decay_steps or config.num_steps) * o.updates_per_batch * o.num_minibatches


#: Whether :func:`shared_train_step` reuses jitted steps across runs of one process. Off by
#: default (each run builds, and so compiles, its own step); ``sat-jax compare --grid`` turns it on
#: for the runs of a grid (``--share_compilation``).
SHARE_TRAIN_STEPS = False
#: Most jitted steps kept alive at once (each holds its compiled executables).
TRAIN_STEP_CACHE_SIZE = 8
_TRAIN_STEPS: collections.OrderedDict = collections.OrderedDict()


def train_step_key(config, parts: Components, *, donate: bool = True) -> tuple:
    """Everything that changes the trainer step's program: the model (``ModelConfig`` fixes the
    graph), the optimizer's settings (the learning rate is a constant in the program), the loss
    spec, the prompt width, the mesh and donation. Seed, lag, lag mode and the data order do not
    enter it, so the seeds and lags of one method share one compiled step."""
    # Every optimizer field (a field added later is in the key without anyone remembering to
    # add it here), and the update count where the schedule reads it (constant ones do not).
    o = config.optim
    total = schedule_updates(config)
    optim = (
        tuple(sorted((k, repr(v)) for k, v in o.to_dict().items())),
        None if o.schedule == "constant" else total,
    )
    return (
        parts.model_cfg,
        optim,
        parts.spec,
        int(config.data.max_prompt_len),
        parts.mesh,
        bool(donate),
    )


def shared_train_step(config, parts: Components, *, donate: bool = True):
    """``trainer.make_train_step`` for this run, reused from an earlier run of this process with
    the same :func:`train_step_key` (so jax.jit's cache, and the compiled program, are shared);
    a new step otherwise, or always when :data:`SHARE_TRAIN_STEPS` is False. The step is a pure
    function of its inputs, so a run stepping another run's jitted step computes the same
    updates (the optimizer it closes over was built from equal settings)."""

    def build_step():
        return trainer.make_train_step(
            parts.graphdef,
            parts.optimizer,
            parts.spec,
            prompt_width=config.data.max_prompt_len,
            mesh=parts.mesh,
            donate=donate,
        )

    if not SHARE_TRAIN_STEPS:
        return build_step()
    key = train_step_key(config, parts, donate=donate)
    if key in _TRAIN_STEPS:
        _TRAIN_STEPS.move_to_end(key)
        return _TRAIN_STEPS[key]
    step = _TRAIN_STEPS[key] = build_step()
    while len(_TRAIN_STEPS) > TRAIN_STEP_CACHE_SIZE:
        _TRAIN_STEPS.popitem(last=False)
    return step
