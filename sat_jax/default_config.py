"""The built-in default run (SAT-GSPO w/ R3, broadcast lag 8, tiny MoE, 2-digit addition) and the
validation every config passes before any compute.

``configs/*.py`` start from :func:`get_config` and change a few fields; ``sat-jax train`` with no
``--config`` runs this file. Every field is overridable from the command line
(``--config.lag=1``); unknown keys are rejected by ml_collections before anything runs.
"""

from __future__ import annotations

import os

import ml_collections

from sat_jax import losses
from sat_jax.rl.lag import MODES


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "sat_gspo_r3"
    c.seed = 0
    c.workdir = ""  # default: runs/<name>-lag<lag>-seed<seed>
    c.num_steps = 400
    c.resume = True  # continue from the latest valid checkpoint in workdir

    # Data: a built-in task, a JSONL file or a TFDS array_record dataset.
    c.data = ml_collections.ConfigDict()
    c.data.source = "task"  # task | jsonl | tfds
    c.data.task = "addition"
    c.data.num_digits = 2
    c.data.eval_size = 256
    c.data.path = ""  # jsonl file
    c.data.eval_path = ""  # held-out jsonl file ("" evaluates on the first prompts of data.path)
    c.data.tfds_name = ""
    c.data.tfds_data_dir = ""
    c.data.split = "train"
    c.data.eval_split = "test"
    c.data.prompt_field = "prompt"
    c.data.answer_field = "answer"
    c.data.max_prompt_len = 8  # tokens, BOS included
    c.data.max_new_tokens = 5
    c.data.tokenizer = "char"  # "char" or a local directory with tokenizer.json
    c.data.eos_token = ""  # HF tokenizers: the token that ends a response (e.g. "<|im_end|>")
    c.data.chat_template = False  # wrap each prompt as one user turn (Qwen chat format)

    # Policy: ModelConfig fields (see sat_jax.models.ModelConfig); vocab comes from the tokenizer.
    c.model = ml_collections.ConfigDict()
    c.model.hf_path = ""  # a local Hugging Face Qwen3(-MoE) directory; "" builds from the fields
    c.model.hidden_size = 64
    c.model.num_layers = 2
    c.model.num_heads = 4
    c.model.num_kv_heads = 2
    c.model.head_dim = 16
    c.model.num_experts = 16
    c.model.num_experts_per_tok = 4
    c.model.moe_intermediate_size = 32
    c.model.norm_topk_prob = True
    c.model.router_aux_loss_coef = 0.0
    c.model.remat = False

    # Rollout engine: bfloat16 against the float32 trainer reproduces the engine mismatch.
    c.rollout = ml_collections.ConfigDict()
    c.rollout.dtype = "bfloat16"
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0
    c.rollout.group_size = 8  # G samples per prompt
    c.rollout.prompts_per_step = 16
    c.rollout.stream_chunk = 2  # decode steps between weight checks (stream mode)

    # Asynchrony (Section 4.4).
    c.lag_mode = "broadcast"  # fixed | broadcast | stream
    c.lag = 8
    c.snapshot_placement = "device"  # device | host

    # Objective (sat_jax.losses) and its hyper-parameters.
    c.loss = ml_collections.ConfigDict()
    c.loss.objective = "sat_gspo"
    c.loss.eps_low = 0.2
    c.loss.eps_high = 0.2
    c.loss.alpha = 0.9
    c.loss.hill_exponent = 2.0
    c.loss.dual_clip = 0.0  # 0 = off (ppo / sat)
    c.loss.delta = 0.0  # 0 = the objective's default (dppo / drpo)
    c.loss.divergence = "tv"  # dppo
    c.loss.spo_eps = 0.2
    c.loss.seqclip_low = 0.995
    c.loss.seqclip_high = 1.005
    c.loss.aggregation = "token-mean"
    c.loss.advantage = "grpo"  # grpo | dr_grpo | rloo
    c.loss.correction = "none"  # none | tis | icepop
    c.loss.tis_cap = 2.0
    c.loss.icepop_low = 0.5
    c.loss.icepop_high = 5.0
    c.loss.kl_coef = 0.0  # low-variance KL to the initial policy (paper: 1e-3)
    c.loss.ratio_denominator = "rollout"  # rollout (Eq. 51) | recompute
    c.loss.r3 = True  # replay rollout routing in the trainer (Eq. 40)
    c.loss.support_replay = True  # replay top-p/top-k cut-offs (Eq. 50)

    # Optimizer (Adam β = (0.9, 0.98) as in the paper).
    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-4
    c.optim.b1 = 0.9
    c.optim.b2 = 0.98
    c.optim.grad_clip = 1.0  # 0 = off
    c.optim.weight_decay = 0.0
    c.optim.warmup_steps = 0
    c.optim.schedule = "constant"  # constant | cosine
    c.optim.num_minibatches = 1
    c.optim.updates_per_batch = 1

    # Supervised warm-up to a weak base policy (cached by content hash).
    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 400
    c.sft.batch_size = 64
    c.sft.learning_rate = 3e-3
    c.sft.cache_dir = os.path.join("~", ".cache", "sat_jax")

    c.eval = ml_collections.ConfigDict()
    c.eval.every = 50
    c.eval.num_prompts = 128
    c.eval.k = 4

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 100
    c.checkpoint.max_to_keep = 2

    c.log = ml_collections.ConfigDict()
    c.log.plots = True
    c.log.tensorboard = True
    c.log.progress = True

    # Parallelism: data-parallel devices (-1: all); multi-host set up by the CLI flags.
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1
    # Rollout device set: -1 shares the trainer's devices (each process samples from its own
    # replica); k >= 0 reserves local device k for the rollout engine, and the trainer mesh takes
    # the others (a rollout mesh and a trainer mesh, as in the paper's split GPU pools).
    c.mesh.rollout_device = -1
    return c


def run_dir(config) -> str:
    return config.workdir or os.path.join(
        "runs", f"{config.name}-{config.lag_mode}{config.lag}-seed{config.seed}"
    )


def run_paths(config) -> tuple[str, str]:
    """(local directory for logs and plots, checkpoint directory).

    A URL workdir (``gs://bucket/runs/x``) keeps the checkpoints there, where every host of a
    slice writes its part and a preempted VM loses nothing, and the metrics, TensorBoard files and
    plots in ``runs/x`` on the primary host (``launch/fetch.sh`` copies them back).
    """
    workdir = run_dir(config)
    if "://" in workdir:
        return os.path.abspath(os.path.join("runs", workdir.rstrip("/").rsplit("/", 1)[-1])), (
            workdir.rstrip("/") + "/checkpoints"
        )
    workdir = os.path.abspath(workdir)
    return workdir, os.path.join(workdir, "checkpoints")


def validate(config, *, num_devices: int = 1, num_processes: int = 1) -> None:
    """Rejects impossible settings with one clear error, before any compute."""

    def fail(msg):
        raise ValueError(f"invalid config: {msg}")

    if config.num_steps < 1:
        fail(f"num_steps must be >= 1, got {config.num_steps}")
    if config.lag_mode not in MODES:
        fail(f"lag_mode must be one of {MODES}, got {config.lag_mode!r}")
    if config.lag < (1 if config.lag_mode == "broadcast" else 0):
        fail(f"lag={config.lag} is impossible for lag_mode={config.lag_mode!r}")
    if config.loss.objective not in losses.names():
        fail(f"loss.objective {config.loss.objective!r} is not one of {losses.names()}")
    if config.loss.correction not in ("none", "tis", "icepop"):
        fail(f"loss.correction must be none|tis|icepop, got {config.loss.correction!r}")
    if config.loss.ratio_denominator not in ("rollout", "recompute"):
        fail(f"loss.ratio_denominator must be rollout|recompute, got "
             f"{config.loss.ratio_denominator!r}")
    if config.loss.aggregation not in losses.AGGREGATIONS:
        fail(f"loss.aggregation must be one of {losses.AGGREGATIONS}")
    if config.loss.advantage not in ("grpo", "dr_grpo", "rloo"):
        fail(f"loss.advantage must be grpo|dr_grpo|rloo, got {config.loss.advantage!r}")
    g, p = config.rollout.group_size, config.rollout.prompts_per_step
    if g < 2 and config.loss.advantage != "dr_grpo":
        fail(f"rollout.group_size must be >= 2 for {config.loss.advantage} advantages, got {g}")
    if p < 1:
        fail(f"rollout.prompts_per_step must be >= 1, got {p}")
    if p % num_processes:
        fail(f"rollout.prompts_per_step={p} (global) must divide over {num_processes} processes")
    batch = g * p
    available = num_devices - (1 if config.mesh.rollout_device >= 0 else 0)
    if config.mesh.rollout_device >= 0 and num_processes > 1:
        fail("mesh.rollout_device is a single-host option; multi-host runs sample on each "
             "process's own replica (mesh.rollout_device=-1)")
    if config.mesh.rollout_device >= num_devices:
        fail(f"mesh.rollout_device={config.mesh.rollout_device} is not one of the "
             f"{num_devices} devices")
    n_dev = available if config.mesh.data == -1 else config.mesh.data
    if not 1 <= n_dev <= available:
        fail(f"mesh.data={config.mesh.data} needs {n_dev} trainer devices, {available} available")
    mb = config.optim.num_minibatches
    if mb < 1 or batch % mb:
        fail(f"the rollout batch ({p} prompts x {g} samples = {batch}) must split into "
             f"optim.num_minibatches={mb} equal minibatches")
    if (batch // mb) % n_dev:
        fail(f"each minibatch ({batch // mb} sequences) must divide evenly over {n_dev} "
             "data-parallel devices")
    if config.optim.updates_per_batch < 1:
        fail("optim.updates_per_batch must be >= 1")
    if config.rollout.dtype not in ("float32", "bfloat16"):
        fail(f"rollout.dtype must be float32|bfloat16, got {config.rollout.dtype!r}")
    if not 0 < config.rollout.top_p <= 1 or config.rollout.temperature <= 0:
        fail("rollout.top_p must be in (0, 1] and rollout.temperature > 0")
    if config.data.source not in ("task", "jsonl", "tfds"):
        fail(f"data.source must be task|jsonl|tfds, got {config.data.source!r}")
    if config.data.source == "jsonl":
        for what, path in (("data.path", config.data.path), ("data.eval_path",
                                                             config.data.eval_path)):
            if (path or what == "data.path") and not os.path.isfile(os.path.expanduser(path)):
                fail(f"{what} {path!r} does not exist (data.source=jsonl)")
    for what, path in (("model.hf_path", config.model.hf_path),
                       ("data.tokenizer", "" if config.data.tokenizer == "char"
                        else config.data.tokenizer)):
        if path and not os.path.exists(os.path.expanduser(path)):
            fail(f"{what} {path!r} does not exist")
    if config.model.hf_path and config.data.tokenizer == "char":
        fail("model.hf_path needs the checkpoint's tokenizer: set data.tokenizer to its directory")
    if config.data.source == "tfds" and not config.data.tfds_name:
        fail("data.tfds_name is required for data.source=tfds")
    if config.eval.every < 0 or config.checkpoint.every < 0:
        fail("eval.every and checkpoint.every must be >= 0 (0 disables)")
    if config.eval.k < 1:
        fail("eval.k must be >= 1")


def method_config(name: str, objective: str, *, r3: bool, correction: str = "none", **loss):
    """The default run with one method of the paper's grid (Table 1) swapped in."""
    c = get_config()
    c.name = name
    c.loss.objective = objective
    c.loss.r3 = r3
    c.loss.correction = correction
    for k, v in loss.items():
        setattr(c.loss, k, v)
    return c
