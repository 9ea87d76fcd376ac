"""The built-in default run (SAT-GSPO w/ R3, broadcast lag 8, tiny MoE, 2-digit addition).

A plain file of defaults: ``configs/*.py`` start from :func:`get_config` and change a few fields;
``sat-jax train`` with no ``--config`` runs this file, and ``sat-jax config`` prints it. Every
field is overridable from the command line (``--config.lag=1``); unknown keys are rejected by
ml_collections, impossible values by ``sat_jax.config.validate`` (``validation.py``), before
anything runs.

Loss hyper-parameters: keyword ``h`` of the chosen objective or correction ``name`` is read from
``loss.<name>_<h>`` if that field exists (``loss.spo_eps``, ``loss.tis_cap``), else from
``loss.<h>`` (``loss.eps_low`` serves every objective that takes ``eps_low``); see
``sat_jax.config``. A loss keyword without a field keeps the loss's default.
"""

from __future__ import annotations

import os

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "sat_gspo_r3"
    c.seed = 0
    c.workdir = ""  # default: runs/<name>-lag<lag>-seed<seed>
    c.num_steps = 400
    # Continue from the latest valid checkpoint in workdir (refused if that run's config differs);
    # False moves an earlier run in workdir aside and starts over.
    c.resume = True

    # Data: a built-in task, a JSONL file or a TFDS array_record dataset.
    c.data = ml_collections.ConfigDict()
    c.data.source = "task"  # task | jsonl | tfds | reasoning_gym
    c.data.task = "addition"
    c.data.num_digits = 2
    # Difficulty mixture of long_multiplication ("AxB" operand digits) and sort_digits ("N"
    # digits) as "LEVEL:WEIGHT,..." (e.g. "3x3:2,4x3:1"); "" takes the task's default. Ignored
    # (and must stay "") for addition and multiplication, which use num_digits.
    c.data.mixture = ""
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
    # data.source=reasoning_gym (pip install "sat-jax[tasks]";
    # sat_jax/data/reasoning_gym_source.py): generators "NAME" or "NAME:WEIGHT,...", each one's
    # config fields under rg.config.NAME (e.g. rg.config.countdown.max_numbers), a train split of
    # rg.train_size and a held-out split of data.eval_size examples, disjoint, fixed by rg.seed.
    # The reward is the generator's scorer: 1 for a full score, else 0 (rg.partial_credit: the
    # score). rg.answer_format: "tags" (<answer>...</answer>) or "plain" (the whole completion).
    c.data.rg = ml_collections.ConfigDict()
    c.data.rg.datasets = ""
    c.data.rg.config = ml_collections.ConfigDict()
    c.data.rg.train_size = 10000
    c.data.rg.seed = 0
    c.data.rg.partial_credit = False
    c.data.rg.answer_format = "tags"

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
    # Mixed precision: compute dtype of the trainer's model and the dtype of its master parameters
    # (and so of gradients and Adam moments); the rollout engine's dtype is rollout.dtype.
    c.model.dtype = "float32"
    c.model.param_dtype = "float32"
    # Routed experts: auto (fastest on the backend: ragged_dot on TPU/GPU, blocked on CPU) | dense
    # (the reference, every expert for every token) | ragged | blocked (sat_jax/models/moe.py).
    c.model.moe_impl = "auto"
    # Blocks per iteration of the scan over stacked blocks (ModelConfig.scan_unroll): 2 makes the
    # 2-block default straight-line code, with no per-layer loop costs; 1 = one compiled body.
    c.model.scan_unroll = 2
    # Queries per attention chunk (ModelConfig.attention_chunk): 0 = all at once; c > 0 keeps at
    # most [rows, heads, c, keys] scores live (long sequences; same values).
    c.model.attention_chunk = 0

    # Rollout engine: bfloat16 against the float32 trainer reproduces the engine mismatch.
    c.rollout = ml_collections.ConfigDict()
    c.rollout.dtype = "bfloat16"  # float32 | bfloat16 | float16: the engine's compute dtype
    # Std of Gaussian noise on the engine's router logits before its top-k (the gates keep the
    # clean logits; the trainer never sees it): routing mismatch at unchanged precision, seeded
    # by the rollout key. 0 = off; must be >= 0.
    c.rollout.router_noise = 0.0
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0
    c.rollout.group_size = 8  # G samples per prompt
    c.rollout.prompts_per_step = 16
    c.rollout.stream_chunk = 2  # decode steps between weight checks (stream mode)
    # static: each batch decodes to its longest response (the reference) | continuous: decode
    # slots refilled as responses finish (sat_jax.sampling.continuous), weight swaps at harvests.
    c.rollout.engine = "static"
    # Continuous engine: decode slots (0: one per sequence of a step, prompts_per_step / processes
    # × group_size) and decode steps between admissions / harvests (and stream-mode weight swaps).
    c.rollout.num_slots = 0
    c.rollout.harvest_every = 4
    # Continuous engine: prompt tokens per prefill model call (0: a prompt's whole prefix in one
    # call); bounds the prefill's activations and attention scores per call (same outputs to
    # float rounding). Must be >= 0; the static engine ignores it.
    c.rollout.prefill_chunk = 0
    # Seconds the trainer waits for the stream worker's next batch before it fails (the first
    # wait includes the worker's compilation).
    c.rollout.stream_timeout_s = 600.0
    # fixed / broadcast / sampled lag: roll out batch s + 1 while the trainer runs step s, when
    # batch s + 1 reads only versions published before that step (every lag >= 1). The same
    # batches, keys and updates as without it; with mesh.rollout_device on another device than
    # the trainer (on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2) the rollout and
    # the train step run at the same time, on one device only the host's scoring overlaps.
    c.rollout.prefetch = False
    # sampled lag: the behaviour versions of a batch are decoded in turn on this many local
    # devices (1: all on the engine's), every decode dispatched before any is read. The same
    # program on another device: the same samples. On a CPU the devices are
    # XLA_FLAGS=--xla_force_host_platform_device_count=N, with mesh.data=1 for the trainer.
    c.rollout.decode_devices = 1

    # Asynchrony (Section 4.4).
    c.lag_mode = "broadcast"  # fixed | broadcast | sampled | stream
    c.lag = 8
    # lag_mode=sampled: every group draws its own lag from lag_dist on 1..lag_cap with mean `lag`
    # (1 <= lag <= lag_cap): geometric (light tail) or zipf (power law, heavy tail); see
    # sat_jax/rl/lag.py.
    c.lag_dist = "geometric"  # geometric | zipf
    c.lag_cap = 16
    c.snapshot_placement = "device"  # device | host (pinned host memory, sharding kept)

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
    c.loss.tis_pg_cap = 2.0  # tis_pg: the truncation C of its importance weight min(r, C)
    c.loss.seqclip_low = 0.995
    c.loss.seqclip_high = 1.005
    c.loss.aggregation = "token-mean"
    c.loss.advantage = "grpo"  # grpo | dr_grpo | rloo
    c.loss.correction = "none"  # none | tis | icepop | kpop
    c.loss.tis_cap = 2.0
    c.loss.icepop_low = 0.5
    c.loss.icepop_high = 5.0
    c.loss.kpop_phi = 0.0  # KPop's threshold φ > 0: required with correction=kpop (no default)
    c.loss.kl_coef = 0.0  # low-variance KL to the initial policy (paper: 1e-3)
    # Entropy bonus: loss −= entropy_coef × the policy's entropy at the sampled positions,
    # aggregated like the objective (paper: 0). A knob of the staleness testbed.
    c.loss.entropy_coef = 0.0
    c.loss.ratio_denominator = "rollout"  # rollout (Eq. 51) | recompute
    c.loss.r3 = True  # replay rollout routing in the trainer (Eq. 40)
    c.loss.support_replay = True  # replay top-p/top-k cut-offs (Eq. 50)
    # Training log-probs in chunks of this many positions (0: the whole [B, T, V] at once); the
    # LM head's logits then take O(B * chunk * V) memory instead of O(B * T * V).
    c.loss.logprob_chunk = 0
    # The G samples of a prompt share its prompt slots: the trainer's log-prob passes run every
    # block on each prompt once (same values and gradients; a batch whose groups differ there,
    # checked on the host, gets the plain program). False: every row computes its own.
    c.loss.share_prompt = True

    # Optimizer (Adam β = (0.9, 0.98) as in the paper).
    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-4
    c.optim.b1 = 0.9
    c.optim.b2 = 0.98
    c.optim.grad_clip = 1.0  # 0 = off
    c.optim.weight_decay = 0.0
    c.optim.warmup_steps = 0
    c.optim.schedule = "constant"  # constant | cosine
    # Training steps the cosine schedule decays over, to a rate of 0; 0 = num_steps at the run's
    # first start. The horizon is stored with the run: resuming with a larger num_steps keeps
    # it (and is refused past it, where the rate is 0).
    c.optim.decay_steps = 0
    c.optim.num_minibatches = 1
    c.optim.updates_per_batch = 1
    # Gradient accumulation: each update runs the model on this many micro-batches (memory for
    # 1/k of the activations) and applies the update of the whole minibatch, every batch
    # statistic of the objective over the whole minibatch (one more forward pass per
    # micro-batch). 1 = off.
    c.optim.micro_batches = 1
    # An update whose loss, gradient or step is NaN or infinite is not applied (logged as
    # optim/nonfinite_updates); this many training steps in a row with one stop the run.
    c.optim.max_nonfinite_steps = 3

    # Supervised warm-up to a weak base policy (cached by content hash).
    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 400
    c.sft.batch_size = 64
    c.sft.learning_rate = 3e-3
    c.sft.schedule = "constant"  # or "cosine": learning_rate decayed to 0 over sft.steps
    # Share of warm-up traces whose final answer is redrawn wrong (exactly round(share * pairs),
    # chosen by the seed): a weak base policy with reward to gain, at a stated corruption.
    c.sft.corrupt_share = 0.0
    c.sft.cache_dir = os.path.join("~", ".cache", "sat_jax")

    c.eval = ml_collections.ConfigDict()
    c.eval.every = 50
    c.eval.num_prompts = 128  # pass@G / avg@G use the rollout group size G
    # Steps whose evaluation reads the first eval.full_num_prompts held-out prompts instead
    # (comma-separated, e.g. "0,250,275,300": a cheap curve with full-size end points); each must
    # be an evaluation step (0, a multiple of eval.every, or num_steps). "" uses num_prompts always.
    c.eval.full_at = ""
    c.eval.full_num_prompts = 512

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every = 100
    c.checkpoint.max_to_keep = 2

    c.log = ml_collections.ConfigDict()
    c.log.plots = True
    c.log.tensorboard = True
    c.log.progress = True
    # Split log r into staleness log(pi_theta/pi_theta_v) and engine log(pi_theta_v/mu), each with
    # the mismatch statistics: one more forward per step, with the behaviour version's parameters
    # (fixed and broadcast lag modes, where a batch has one behaviour version).
    c.log.decompose_mismatch = False

    # Parallelism: data-parallel devices (-1: all); multi-host set up by the CLI flags.
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1
    # Model-parallel axes (sat_jax.models.sharding): FSDP shards parameters, gradients and optimizer
    # state; experts split over `expert`; heads and MLP widths over `tensor`. The batch is split
    # over data x fsdp; mesh.data = -1 takes the devices the other axes leave.
    c.mesh.fsdp = 1
    c.mesh.expert = 1
    c.mesh.tensor = 1
    # Rollout device set: -1 shares the trainer's devices (each process samples from its own
    # replica); k >= 0 reserves local device k for the rollout engine, and the trainer mesh takes
    # the others (a rollout mesh and a trainer mesh, as in the paper's split GPU pools).
    c.mesh.rollout_device = -1
    return c


def method_config(
    name: str, objective: str, *, r3: bool, correction: str = "none", base=None, **loss
):
    """A base run (``base()``, default :func:`get_config`) with one method of the paper's grid
    (Table 1) swapped in."""
    c = (base or get_config)()
    c.name = name
    c.loss.objective = objective
    c.loss.r3 = r3
    c.loss.correction = correction
    for k, v in loss.items():
        setattr(c.loss, k, v)
    return c
