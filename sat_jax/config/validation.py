"""From a run config (``sat_jax.config``) to checked, plain arguments.

* :func:`validate` rejects an impossible config before any compute, asking each owner: lag modes
  and their bounds from ``sat_jax.rl.lag``, objectives, corrections and their hyper-parameters from
  the loss registry (each loss's own checks run under ``jax.eval_shape``, nothing compiles),
  advantage estimators from ``sat_jax.advantages``, model fields from ``ModelConfig``, sampling,
  router noise and decode slots from the samplers, snapshot placements from the store, the data
  from its sources. It returns what it built on the way (:class:`Checked`: the loss spec, the lag
  schedule, the prompt sources), which the run uses instead of building them again.
* :func:`loss_kwargs` maps ``config.loss`` onto a loss's keywords, which the registry reads from
  its signature: keyword ``h`` of loss ``name`` comes from ``loss.<name>_<h>`` if the config has
  that field (``loss.spo_eps``, ``loss.tis_cap``), else from ``loss.<h>`` (shared by every loss
  taking it: ``loss.eps_low``), else the loss's default. For :data:`ZERO_MEANS_DEFAULT` fields a 0
  means "the loss's default" (``dual_clip`` off, ``delta`` the objective's own).
* :func:`loss_spec` builds the trainer's ``LossSpec``: configuration stops there.
* :func:`changed_fields` compares a stored run's config with a new one for resuming.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import os
import re
from typing import Any

import jax

from sat_jax import advantages, losses
from sat_jax.losses import registry
from sat_jax.rl import lag as lag_lib
from sat_jax.rl import trainer
from sat_jax.rl.sft import SCHEDULES as SFT_SCHEDULES
from sat_jax.rl.snapshots import PLACEMENTS
from sat_jax.sampling.continuous import check_slots
from sat_jax.sampling.sampler import check_router_noise, check_sampling

#: The rollout engine's compute dtypes (``rollout.dtype``).
ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")

#: config.loss fields where 0 stands for the loss's own default.
ZERO_MEANS_DEFAULT = ("dual_clip", "delta")

#: Fields a resumed run may change: they decide how long and how visibly a run goes, not what
#: it learns.
RESUMABLE = (
    "num_steps",
    "resume",
    "workdir",
    "log",
    "checkpoint",
    "eval.every",
    "mesh",
    "sft.cache_dir",
    "optim.max_nonfinite_steps",
    "rollout.stream_timeout_s",
    "rollout.prefetch",
    "rollout.decode_devices",
)

_CORRECTION_OFF = "none"


class ConfigError(ValueError):
    """An impossible config; the message starts with ``invalid config:``."""

    def __init__(self, msg: str):
        super().__init__(f"invalid config: {msg}")


@dataclasses.dataclass(frozen=True)
class Checked:
    """The plain arguments a run is built from, as :func:`validate` built them while checking.

    Attributes:
      spec: the trainer's loss arguments (:func:`loss_spec`).
      schedule: the lag schedule (:func:`lag_schedule`).
      sources: ``(train, held-out, task or None)`` of ``config.data``, or None where the run builds
        them (TFDS and file sources read with a tokenizer validation does not load).
      rows_checked: the sources' rows were checked against the run's tokenizer
        (:func:`check_data_rows`), so the run need not check them again.
    """

    spec: trainer.LossSpec
    schedule: lag_lib.LagSchedule
    sources: tuple | None = None
    rows_checked: bool = False


def unchecked(config) -> Checked:
    """:class:`Checked` for a config the caller vouches for (validated elsewhere, or a test's):
    the spec and schedule, no sources."""
    return Checked(spec=loss_spec(config), schedule=lag_schedule(config))


def _config_key(loss_config, name: str, hparam: str) -> str | None:
    for key in (f"{name}_{hparam}", hparam):
        if key in loss_config:
            return key
    return None


def loss_kwargs(loss_config, name: str, *, required: bool = True) -> dict[str, Any]:
    """The keywords of objective or correction ``name`` that ``loss_config`` sets (without the
    ones the loss requires, i.e. has no default for, when ``required=False``)."""
    out = {}
    for hparam, default in registry.hyperparameters(name).items():
        key = _config_key(loss_config, name, hparam)
        if key is None or (not required and default is inspect.Parameter.empty):
            continue
        value = loss_config[key]
        if key in ZERO_MEANS_DEFAULT and value == 0:
            continue
        out[hparam] = value
    return out


def loss_spec(config) -> trainer.LossSpec:
    """The trainer's plain loss arguments from the config."""
    c = config.loss
    correction = c.correction
    corr = {} if correction == _CORRECTION_OFF else loss_kwargs(c, correction)
    return trainer.LossSpec(
        objective=c.objective,
        objective_kwargs=tuple(sorted(loss_kwargs(c, c.objective).items())),
        aggregation=c.aggregation,
        correction=correction,
        correction_kwargs=tuple(sorted(corr.items())),
        ratio_denominator=c.ratio_denominator,
        kl_coef=float(c.kl_coef),
        entropy_coef=float(c.entropy_coef),
        r3=bool(c.r3),
        support_replay=bool(c.support_replay),
        temperature=float(config.rollout.temperature),
        router_aux=config.model.router_aux_loss_coef > 0,
        logprob_chunk=int(c.logprob_chunk) or None,
        prompt_group=int(config.rollout.group_size) if c.share_prompt else 1,
        decompose_mismatch=bool(config.log.decompose_mismatch),
        micro_batches=int(config.optim.micro_batches),
    )


def _fail(msg: str):
    raise ConfigError(msg)


def _named(error: Exception) -> list[str]:
    return re.findall(r"`(\w+)`", str(error))


def _check_loss(config) -> None:
    c = config.loss
    objectives, corrections = registry.names("objective"), registry.names("correction")
    if c.objective not in objectives:
        _fail(f"loss.objective {c.objective!r} is not one of {objectives}")
    if c.correction != _CORRECTION_OFF and c.correction not in corrections:
        _fail(
            f"loss.correction must be {_CORRECTION_OFF!r} or one of {corrections}, got "
            f"{c.correction!r}"
        )
    if c.aggregation not in losses.AGGREGATIONS:
        _fail(f"loss.aggregation must be one of {losses.AGGREGATIONS}, got {c.aggregation!r}")
    # The configured objective and correction, then every other config field some loss takes,
    # checked by the first loss that takes it (a bad loss.dual_clip fails even while SAT-GSPO
    # ignores it). A hyper-parameter a loss requires (KPop's phi) is checked when it is chosen.
    checks = [(c.objective, loss_kwargs(c, c.objective))]
    if c.correction != _CORRECTION_OFF:
        checks.append((c.correction, loss_kwargs(c, c.correction)))
    covered = {_config_key(c, name, h) for name, kw in checks for h in kw}  # config keys
    for name in objectives + corrections:
        extra = {
            h: v
            for h, v in loss_kwargs(c, name, required=False).items()
            if _config_key(c, name, h) not in covered
        }
        if extra:
            checks.append((name, extra))
            covered |= {_config_key(c, name, h) for h in extra}
    for name, kwargs in checks:
        try:
            registry.check(name, kwargs, aggregation=c.aggregation)
        except (ValueError, TypeError) as e:
            keys = [
                f"loss.{_config_key(c, name, h)}={kwargs[h]!r}" for h in _named(e) if h in kwargs
            ] or [f"loss.{_config_key(c, name, h)}" for h in kwargs]
            _fail(f"{', '.join(keys)} (checked by {name!r}): {e}")
    if not (c.kl_coef >= 0 and math.isfinite(c.kl_coef)):
        _fail(f"loss.kl_coef must be >= 0, got {c.kl_coef}")
    if not (c.entropy_coef >= 0 and math.isfinite(c.entropy_coef)):
        _fail(f"loss.entropy_coef must be >= 0, got {c.entropy_coef}")
    if c.ratio_denominator not in ("rollout", "recompute"):
        _fail(f"loss.ratio_denominator must be rollout|recompute, got {c.ratio_denominator!r}")
    if c.advantage not in advantages.names():
        _fail(f"loss.advantage must be one of {advantages.names()}, got {c.advantage!r}")
    g = config.rollout.group_size
    try:
        jax.eval_shape(advantages.get(c.advantage), jax.ShapeDtypeStruct((1, g), "float32"))
    except (ValueError, TypeError) as e:
        _fail(f"rollout.group_size={g} with loss.advantage={c.advantage!r}: {e}")


def _check_model(config) -> None:
    from sat_jax.models import ModelConfig

    fields = config.model.to_dict()
    if fields.pop("hf_path"):
        return  # the checkpoint's config.json decides (checked when it loads)
    try:
        ModelConfig(vocab_size=64, **fields)  # the tokenizer fixes vocab_size later
    except (ValueError, TypeError) as e:
        _fail(f"model: {e}")
    if config.model.router_aux_loss_coef < 0:
        _fail(f"model.router_aux_loss_coef must be >= 0, got {config.model.router_aux_loss_coef}")


def _check_optim(config) -> None:
    o = config.optim
    if not (o.learning_rate > 0 and math.isfinite(o.learning_rate)):
        _fail(f"optim.learning_rate must be > 0, got {o.learning_rate}")
    for name in ("b1", "b2"):
        if not 0 <= o[name] < 1:
            _fail(f"optim.{name} must be in [0, 1), got {o[name]}")
    for name in ("grad_clip", "weight_decay", "warmup_steps"):
        # NaN compares false with everything: "< 0" would let it through and the optimizer
        # would then silently skip clipping or decay.
        if not (o[name] >= 0 and math.isfinite(o[name])):
            _fail(f"optim.{name} must be a finite number >= 0, got {o[name]}")
    try:
        trainer.make_optimizer(o.learning_rate, schedule=o.schedule)
    except ValueError as e:
        _fail(f"optim.schedule: {e}")
    if o.updates_per_batch < 1:
        _fail(f"optim.updates_per_batch must be >= 1, got {o.updates_per_batch}")
    d = o.decay_steps
    if not isinstance(d, int) or isinstance(d, bool) or d < 0:
        _fail(f"optim.decay_steps must be an int >= 0 (0: num_steps), got {d!r}")
    if o.schedule == "cosine" and 0 < d < config.num_steps:
        _fail(
            f"optim.decay_steps={d} is below num_steps={config.num_steps}: the cosine "
            "schedule's rate is 0 past its horizon"
        )
    n = o.max_nonfinite_steps
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        _fail(f"optim.max_nonfinite_steps must be an int >= 1, got {n!r}")


def _check_data(config) -> tuple | None:
    """The data settings; returns the built-in task's sources (built here once), else None."""
    d = config.data
    if d.source not in ("task", "jsonl", "tfds", "reasoning_gym"):
        _fail(f"data.source must be task|jsonl|tfds|reasoning_gym, got {d.source!r}")
    for name in ("max_prompt_len", "max_new_tokens"):
        if d[name] < 1:
            _fail(f"data.{name} must be >= 1, got {d[name]}")
    sources = _task_sources(config) if d.source == "task" else None
    if d.source == "jsonl":
        for what, path in (("data.path", d.path), ("data.eval_path", d.eval_path)):
            if (path or what == "data.path") and not os.path.isfile(os.path.expanduser(path)):
                _fail(f"{what} {path!r} does not exist (data.source=jsonl)")
    if d.source == "reasoning_gym":
        from sat_jax.data.reasoning_gym_source import check_data_config

        try:
            check_data_config(d)
        except (ValueError, ImportError) as e:
            _fail(str(e))
    if d.source == "tfds" and not d.tfds_name:
        _fail("data.tfds_name is required for data.source=tfds")
    for what, path in (
        ("model.hf_path", config.model.hf_path),
        ("data.tokenizer", "" if d.tokenizer == "char" else d.tokenizer),
    ):
        if path and not os.path.exists(os.path.expanduser(path)):
            _fail(f"{what} {path!r} does not exist")
    if config.model.hf_path and d.tokenizer == "char":
        _fail("model.hf_path needs the checkpoint's tokenizer: set data.tokenizer to its directory")
    if d.chat_template:
        _check_chat_eos(d)
    return sources


def _check_chat_eos(d) -> None:
    """The chat format ends a reply with ``<|im_end|>``; a response must end there too."""
    from sat_jax.data.tokenizer import IM_END, HFTokenizer

    if d.tokenizer == "char":
        _fail(
            "data.chat_template=True needs a Hugging Face tokenizer (data.tokenizer=<directory>): "
            "the character tokenizer cannot encode the chat format's markers"
        )
    if d.eos_token:
        return
    # The tokenizer's own default (its tokenizer_config.json): a base checkpoint names
    # <|endoftext|>, which a chat reply never writes, so every response would run to
    # data.max_new_tokens.
    eos = HFTokenizer(os.path.expanduser(d.tokenizer)).eos_token
    if eos != IM_END:
        _fail(
            f"data.chat_template=True with data.eos_token='' ends responses at the tokenizer's "
            f"default {eos!r} (a base checkpoint's), but a chat reply ends with {IM_END!r}: set "
            f"data.eos_token={IM_END!r}"
        )


def _check_mesh_divides(config, sizes: dict[str, int]) -> None:
    """The model's split dimensions against the mesh, asked of the sharding table's owner."""
    import types

    from sat_jax.data.tokenizer import CharTokenizer
    from sat_jax.models import ModelConfig, check_mesh
    from sat_jax.models.hf_config import config_from_hf

    fields = config.model.to_dict()
    hf_path = os.path.expanduser(fields.pop("hf_path"))
    if hf_path:
        try:
            with open(os.path.join(hf_path, "config.json")) as f:
                model = config_from_hf(json.load(f))
        except (OSError, ValueError) as e:
            _fail(f"model.hf_path={config.model.hf_path!r}: {e}")
    else:
        # The character tokenizer's vocabulary is known here; another tokenizer's is checked
        # against the mesh when it is loaded (a vocab of the tensor size always divides).
        vocab = CharTokenizer().vocab_size if config.data.tokenizer == "char" else sizes["tensor"]
        model = ModelConfig(vocab_size=vocab, **fields)
    try:
        check_mesh(model, types.SimpleNamespace(shape=sizes))
    except ValueError as e:
        axes = ", ".join(f"{k}={v}" for k, v in sizes.items())
        _fail(f"mesh ({axes}) does not fit the model: {e}")


def _task_sources(config) -> tuple:
    """The built-in task's sources: the task builds, and its longest prompt (with BOS) and longest
    supervised response (with EOS) fit data.max_prompt_len and data.max_new_tokens under the
    character tokenizer (one token per character); other tokenizers are checked when the run
    loads them."""
    from sat_jax.data import build_sources

    d = config.data
    try:
        sources = build_sources(d)
    except (ValueError, KeyError, TypeError) as e:
        where = f"data.task={d.task!r}" + (f", data.mixture={d.mixture!r}" if d.mixture else "")
        _fail(f"{where}: {e}")
    task = sources[2]
    if d.tokenizer != "char":
        return sources
    for field, need, what in (
        ("max_prompt_len", task.max_prompt_chars + 1, "prompt (BOS included)"),
        ("max_new_tokens", task.max_target_chars + 1, "response (EOS included)"),
    ):
        if d[field] < need:
            _fail(
                f"data.{field}={d[field]} is shorter than task {task.name!r}'s longest {what}, "
                f"{need} tokens: set data.{field} >= {need}"
            )
    return sources


def _check_rollout(config, num_devices: int, num_processes: int) -> None:
    r = config.rollout
    g, p = r.group_size, r.prompts_per_step
    if g < 1 or p < 1:
        _fail(f"rollout.group_size and rollout.prompts_per_step must be >= 1, got {g}, {p}")
    if p % num_processes:
        _fail(f"rollout.prompts_per_step={p} (global) must divide over {num_processes} processes")
    if r.dtype not in ROLLOUT_DTYPES:
        _fail(f"rollout.dtype must be one of {ROLLOUT_DTYPES}, got {r.dtype!r}")
    try:  # the samplers' own rules, named by their config fields
        check_router_noise(r.router_noise, prefix="rollout.")
        check_sampling(r.temperature, r.top_p, prefix="rollout.")
    except ValueError as e:
        _fail(str(e))
    t = r.stream_timeout_s
    if isinstance(t, bool) or not isinstance(t, int | float) or not (t > 0 and math.isfinite(t)):
        _fail(f"rollout.stream_timeout_s must be a finite number of seconds > 0, got {t!r}")
    if r.top_k < 0 or r.stream_chunk < 1:
        _fail(
            f"rollout.top_k must be >= 0 and rollout.stream_chunk >= 1, got {r.top_k}, "
            f"{r.stream_chunk}"
        )
    if r.engine not in ("static", "continuous"):
        _fail(f"rollout.engine must be static|continuous, got {r.engine!r}")
    if r.num_slots < 0 or r.harvest_every < 1:
        _fail(
            f"rollout.num_slots must be >= 0 and rollout.harvest_every >= 1, got {r.num_slots}, "
            f"{r.harvest_every}"
        )
    chunk = r.prefill_chunk
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
        _fail(f"rollout.prefill_chunk must be an int >= 0 (0: one call), got {chunk!r}")
    if not isinstance(r.prefetch, bool):
        _fail(f"rollout.prefetch must be True or False, got {r.prefetch!r}")
    k = r.decode_devices
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_devices:
        _fail(
            f"rollout.decode_devices must be an int in [1, {num_devices}] (the devices), got {k!r}"
        )
    if k > 1 and (config.lag_mode != "sampled" or config.mesh.rollout_device >= 0):
        _fail(
            f"rollout.decode_devices={k} spreads a sampled-lag batch's versions over devices: it "
            "needs lag_mode=sampled and mesh.rollout_device=-1"
        )
    if r.prefetch and config.lag_mode == "stream":
        _fail(
            "rollout.prefetch=True needs lag_mode fixed, broadcast or sampled: stream mode "
            "already decodes on its own thread"
        )
    if r.engine == "continuous" and r.router_noise:
        _fail(
            f"rollout.router_noise={r.router_noise} needs rollout.engine=static: the noise is "
            "drawn per batch, not per sequence"
        )
    if r.engine == "continuous" and r.num_slots > 0:  # 0: one slot per sequence of a step
        try:
            check_slots(r.num_slots, g, prefix="rollout.")
        except ValueError as e:
            _fail(str(e))
    m = config.mesh
    if m.rollout_device >= 0 and num_processes > 1:
        _fail(
            "mesh.rollout_device is a single-host option; multi-host runs sample on each "
            "process's own replica (mesh.rollout_device=-1)"
        )
    if m.rollout_device >= num_devices:
        _fail(f"mesh.rollout_device={m.rollout_device} is not one of the {num_devices} devices")
    available = num_devices - (1 if m.rollout_device >= 0 else 0)
    for axis in ("fsdp", "expert", "tensor"):
        if not isinstance(m[axis], int) or m[axis] < 1:
            _fail(f"mesh.{axis} must be a positive int, got {m[axis]!r}")
    inner = m.fsdp * m.expert * m.tensor
    data = available // inner if m.data == -1 else m.data
    if data < 1 or data * inner > available:
        _fail(
            f"mesh (data={m.data}, fsdp={m.fsdp}, expert={m.expert}, tensor={m.tensor}) needs "
            f"{max(data, 1) * inner} trainer devices, {available} available"
        )
    _check_mesh_divides(
        config, {"data": data, "fsdp": m.fsdp, "expert": m.expert, "tensor": m.tensor}
    )
    n_dev = data * m.fsdp  # the batch is split over data x fsdp
    batch, mb = g * p, config.optim.num_minibatches
    if mb < 1 or batch % mb:
        _fail(
            f"the rollout batch ({p} prompts x {g} samples = {batch}) must split into "
            f"optim.num_minibatches={mb} equal minibatches"
        )
    if (batch // mb) % n_dev:
        _fail(
            f"each minibatch ({batch // mb} sequences) must divide evenly over {n_dev} "
            "batch shards (mesh data x fsdp)"
        )
    k = config.optim.micro_batches
    group = g if config.loss.share_prompt else 1
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        _fail(f"optim.micro_batches must be an int >= 1 (1: off), got {k!r}")
    if k > 1 and ((batch // mb) % (k * group) or (batch // mb // k) % n_dev):
        _fail(
            f"optim.micro_batches={k}: each minibatch ({batch // mb} sequences) must split into "
            f"{k} micro-batches of whole groups of {group}, each dividing evenly over {n_dev} "
            "batch shards (mesh data x fsdp)"
        )


def lag_schedule(config) -> lag_lib.LagSchedule:
    """The run's lag schedule (mode, lag and, for ``sampled``, distribution and cap)."""
    return lag_lib.LagSchedule(config.lag_mode, config.lag, config.lag_dist, config.lag_cap)


def _check_lag(config, spec: trainer.LossSpec) -> lag_lib.LagSchedule:
    """The lag schedule (its own checks) and the lag modes the loss ``spec`` allows."""
    if config.lag_dist not in lag_lib.DISTRIBUTIONS:
        _fail(f"lag_dist must be one of {lag_lib.DISTRIBUTIONS}, got {config.lag_dist!r}")
    try:
        schedule = lag_schedule(config)
    except (ValueError, TypeError) as e:
        extra = f", lag_cap={config.lag_cap}" if config.lag_mode == "sampled" else ""
        _fail(f"lag_mode={config.lag_mode!r}, lag={config.lag}{extra}: {e}")
    if config.lag_mode == "sampled" and spec.needs_old:
        _fail(
            "lag_mode='sampled' mixes behaviour versions within a batch, but the loss recomputes "
            "one behaviour version (loss.ratio_denominator=recompute, a correction comparing "
            "with it, or log.decompose_mismatch); use fixed or broadcast for those"
        )
    if config.log.decompose_mismatch and config.lag_mode not in ("fixed", "broadcast"):
        _fail(
            f"log.decompose_mismatch needs one behaviour version per batch (lag_mode fixed or "
            f"broadcast), got lag_mode={config.lag_mode!r}"
        )
    return schedule


def validate(config, *, num_devices: int = 1, num_processes: int = 1) -> Checked:
    """Rejects impossible settings with one :class:`ConfigError`, before any compute; returns
    what it built on the way, for the run (``sat_jax.train``) to use."""
    if config.num_steps < 1:
        _fail(f"num_steps must be >= 1, got {config.num_steps}")
    seed = config.seed
    # The data order (numpy) and every PRNG key (jax.random.key, a signed 64-bit seed) take it.
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        _fail(f"seed must be an int in [0, 2**63), got {seed!r}")
    chunk = config.loss.logprob_chunk
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
        _fail(f"loss.logprob_chunk must be an int >= 0 (0: no chunking), got {chunk!r}")
    if not isinstance(config.loss.share_prompt, bool):
        _fail(f"loss.share_prompt must be a bool, got {config.loss.share_prompt!r}")
    if config.snapshot_placement not in PLACEMENTS:
        _fail(f"snapshot_placement must be one of {PLACEMENTS}, got {config.snapshot_placement!r}")
    _check_loss(config)
    spec = loss_spec(config)
    # After the loss: which lag modes fit depends on what the loss recomputes.
    schedule = _check_lag(config, spec)
    _check_model(config)
    _check_optim(config)
    sources = _check_data(config)
    _check_rollout(config, num_devices, num_processes)
    s = config.sft
    if (
        s.steps < 0
        or s.batch_size < 1
        or not (s.learning_rate > 0 and math.isfinite(s.learning_rate))
    ):
        _fail(
            f"sft.steps must be >= 0, sft.batch_size >= 1 and sft.learning_rate > 0, got "
            f"{s.steps}, {s.batch_size}, {s.learning_rate}"
        )
    if not 0.0 <= s.corrupt_share <= 1.0:
        _fail(f"sft.corrupt_share must be in [0, 1], got {s.corrupt_share}")
    if s.schedule not in SFT_SCHEDULES:
        _fail(f"sft.schedule must be one of {SFT_SCHEDULES}, got {s.schedule!r}")
    if config.eval.every < 0 or config.checkpoint.every < 0:
        _fail("eval.every and checkpoint.every must be >= 0 (0 disables)")
    if config.eval.num_prompts < 1:
        _fail(f"eval.num_prompts must be >= 1, got {config.eval.num_prompts}")
    full = full_eval_steps(config)  # raises ConfigError on a malformed list
    if full and config.eval.full_num_prompts < config.eval.num_prompts:
        _fail(
            f"eval.full_num_prompts={config.eval.full_num_prompts} must be >= eval.num_prompts="
            f"{config.eval.num_prompts}"
        )
    every = config.eval.every
    missed = [
        s for s in full if not (s == 0 or s == config.num_steps or (every and s % every == 0))
    ]
    if missed or (full and not every):
        _fail(
            f"eval.full_at={config.eval.full_at!r}: steps {missed or sorted(full)} are not "
            f"evaluation steps (0, multiples of eval.every={every}, or num_steps="
            f"{config.num_steps})"
        )
    if config.checkpoint.max_to_keep < 1:
        _fail(f"checkpoint.max_to_keep must be >= 1, got {config.checkpoint.max_to_keep}")
    d = config.data
    if d.source == "jsonl" and d.tokenizer == "char":
        from sat_jax.data import build_sources

        sources = build_sources(d)
    rows_checked = sources is not None and d.tokenizer == "char"
    if rows_checked:
        # The run's own tokenizer: the rows are checked once, here. TFDS sources and other
        # tokenizers' rows are checked when the run builds and loads them.
        from sat_jax.data.tokenizer import CharTokenizer

        check_data_rows(config, *sources[:2], CharTokenizer(), sources[2])
    elif sources is not None:
        _check_batch_rows(config, sources[0])
    return Checked(spec=spec, schedule=schedule, sources=sources, rows_checked=rows_checked)


def _check_batch_rows(config, train_src) -> None:
    from sat_jax.data import PromptIterator

    p = config.rollout.prompts_per_step
    try:  # the iterator's own rules for its batch against the rows (it draws nothing here)
        PromptIterator(train_src, p, seed=config.seed)
    except (ValueError, TypeError) as e:
        _fail(f"rollout.prompts_per_step={p}: {e}")


def check_data_rows(config, train_src, eval_src, tokenizer, task=None) -> None:
    """The built data against the tokenizer and the slots, one :class:`ConfigError`.

    Every training prompt (and the held-out prompts an evaluation reads) must encode within
    ``data.max_prompt_len``; with a supervised warm-up (a built-in ``task``) every target plus EOS
    within ``data.max_new_tokens``; ``rollout.prompts_per_step`` must not exceed the training
    rows. Runs on any source and tokenizer, so a new task or dataset is checked without code of
    its own.
    """
    from sat_jax.data import check_prompts, user_prompt

    _check_batch_rows(config, train_src)
    d = config.data
    fmt = user_prompt if d.chat_template else None
    warmup = task is not None and config.sft.steps > 0 and not config.model.hf_path
    what = f"data.max_prompt_len={d.max_prompt_len}"
    if warmup:
        what += f", data.max_new_tokens={d.max_new_tokens} (the warm-up's targets)"
    what += f" with data.tokenizer={d.tokenizer!r}"
    try:
        check_prompts(
            train_src,
            tokenizer,
            d.max_prompt_len,
            prompt_format=fmt,
            max_answer_len=d.max_new_tokens if warmup else None,
        )
        if eval_src is not train_src:
            check_prompts(
                eval_src,
                tokenizer,
                d.max_prompt_len,
                prompt_format=fmt,
                rows=config.eval.num_prompts,
            )
    except ValueError as e:
        _fail(f"{what}: {e}")


def full_eval_steps(config) -> frozenset[int]:
    """The steps of ``eval.full_at`` (comma-separated ints in [0, num_steps]) as a set."""
    text = str(config.eval.full_at).strip()
    if not text:
        return frozenset()
    try:
        steps = frozenset(int(t) for t in text.split(","))
    except ValueError:
        _fail(f"eval.full_at must be comma-separated steps like '0,250,300', got {text!r}")
    bad = sorted(s for s in steps if not 0 <= s <= config.num_steps)
    if bad:
        _fail(f"eval.full_at={text!r}: steps {bad} lie outside [0, num_steps={config.num_steps}]")
    return steps


def plain(config) -> dict[str, Any]:
    """The config as JSON types (what checkpoints and ``config.json`` store)."""
    return json.loads(json.dumps(config.to_dict(), default=str))


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def changed_fields(stored: dict[str, Any], config) -> list[str]:
    """``"key: stored -> new"`` for each field (outside :data:`RESUMABLE`) that differs. A field
    the stored config lacks (added to the defaults after that run started) counts as unchanged
    while the new config keeps its default."""
    from sat_jax.config import defaults

    old, new = _flatten(stored), _flatten(plain(config))
    default = _flatten(plain(defaults.get_config()))

    def resumable(key):
        return any(key == r or key.startswith(r + ".") for r in RESUMABLE)

    def same(key):
        if key not in old and key in default:
            return new.get(key) == default[key]
        return old.get(key) == new.get(key)

    return [
        f"{k}: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}"
        for k in sorted(set(old) | set(new))
        if not resumable(k) and not same(k)
    ]
