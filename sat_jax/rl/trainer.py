"""The trainer step: one jitted update from a rollout batch on a (data, fsdp, expert, tensor) mesh.

The step recomputes log π_θ of the sampled tokens (with R3 routing replay and support replay when
enabled) under GSPMD with the parameters in the sharding table of ``sat_jax.models.sharding``,
then applies the configured objective from ``sat_jax.losses`` inside a ``jax.shard_map`` over the
batch axes (``data × fsdp``) with that axis name, so every batch statistic, SAT's quantile
included, is global through scalar collectives; optional corrections (TIS, IcePop, KPop;
``sat_jax.losses.registry.correction_weights``) and the low-variance KL to a reference policy
compose with it. A 1-D ``data`` mesh is plain data parallelism (parameters replicated).

Metrics, all global over the batch axes: the objective's own (``loss/...``: d̄_π, clip fractions
and the clip split by sign of A and side, SAT's Table 10 set), the shape of the ratio the loss
sees (``mismatch/p50``, ``p90``, ``p99``, ``max`` of |log r|, ``seq_sum_max``, ``ess``;
``losses.mismatch_shape``), the routing flip rate (``routing/flip_rate``: the share of
(response token, MoE layer) pairs whose trainer top-k set differs from the engine's recorded
one, with R3 on or off; ``routing_flip_share``), ``train/entropy``, ``optim/grad_norm`` and
``optim/update_norm``, d̄_π by the staleness of the tokens (``mismatch/lag_le2``,
``mismatch/lag_ge8`` and their ``_share`` of active tokens: :data:`LAG_BUCKETS`); with
``LossSpec.decompose_mismatch`` also ``mismatch/staleness*`` and ``mismatch/engine*``
(``losses.mismatch_decomposition``, relative to the engine's log μ).

The step is a pure function ``(TrainState, batch, extra_params) -> (TrainState, metrics)``, so it
can also be vmapped over a leading "run" axis of stacked states for many small studies at once
(``jax.vmap(step, in_axes=(0, 0, None))``; tested against each run alone, and
``benchmarks/runs.py`` measures what it buys).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sat_jax import losses, parallel
from sat_jax.models.logprobs import token_logprobs
from sat_jax.models.moe import routing_flips
from sat_jax.models.sharding import check_mesh
from sat_jax.models.transformer import abstract_params, param_shardings
from sat_jax.rl.batch import RolloutBatch, batch_axes


class TrainState(NamedTuple):
    params: Any  # nnx.State, float32
    opt_state: Any
    step: jax.Array  # int32: number of updates applied (= the parameter version)


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """Plain arguments of the policy loss (built from the config at the edge)."""

    objective: str = "sat_gspo"
    objective_kwargs: tuple[tuple[str, Any], ...] = ()
    aggregation: str = "token-mean"
    correction: str = "none"  # none | one of losses.names("correction")
    correction_kwargs: tuple[tuple[str, Any], ...] = ()
    ratio_denominator: str = "rollout"  # rollout | recompute
    kl_coef: float = 0.0
    # Entropy bonus: the loss subtracts this × the aggregated policy entropy of the sampled
    # positions (the full distribution's, over the replayed support), 0 = off.
    entropy_coef: float = 0.0
    r3: bool = True
    support_replay: bool = True
    temperature: float = 1.0
    router_aux: bool = False  # add the model's load-balancing loss (router_aux_loss_coef > 0)
    logprob_chunk: int | None = None  # token_logprobs(chunk_size=): None = full [B, T, V]
    # G > 1: the batch's rows are groups of G samples of one prompt, so a batch whose groups
    # share their prompt slots (``RolloutBatch.shares_prompt``) runs the model's blocks on
    # each prompt once (token_logprobs(shared_prefix=(G, prompt_width))).
    prompt_group: int = 1
    # Split log r into staleness log(π_θ/π_θv) and engine log(π_θv/μ) (one more forward, with
    # the behaviour version's parameters), each with the mismatch statistics.
    decompose_mismatch: bool = False
    # k > 1: the step runs the model on k micro-batches of whole groups (memory ~1/k of the
    # activations) and gives the update of the whole batch: every batch statistic of the
    # objective (SAT's quantile, M2PO's selection, BAPO's bounds, the token-mean denominator)
    # over the whole batch (``make_train_step``).
    micro_batches: int = 1

    @property
    def needs_old(self) -> bool:
        """Whether the trainer must recompute log μ̃ under the behaviour version's parameters."""
        return (
            self.ratio_denominator == "recompute"
            or self.decompose_mismatch
            or self.correction != "none"
            and losses.registry.correction_reference(self.correction) == "old"
        )

    @property
    def needs_ref(self) -> bool:
        return self.kl_coef > 0


def make_optimizer(
    learning_rate: float,
    *,
    b1: float = 0.9,
    b2: float = 0.98,
    grad_clip: float = 0.0,
    weight_decay: float = 0.0,
    warmup_steps: int = 0,
    schedule: str = "constant",
    total_steps: int = 1,
) -> optax.GradientTransformation:
    """Adam (β = (0.9, 0.98) as in the paper) with optional clipping, decay and schedule."""
    if schedule == "constant":
        lr = (
            optax.linear_schedule(0.0, learning_rate, warmup_steps)
            if warmup_steps
            else learning_rate
        )
    elif schedule == "cosine":
        # optax needs at least one decay step after the (at least one) warm-up step.
        warmup = max(warmup_steps, 1)
        lr = optax.warmup_cosine_decay_schedule(
            0.0, learning_rate, warmup, max(total_steps, warmup + 1)
        )
    else:
        raise ValueError(f"schedule must be constant|cosine, got {schedule!r}")
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
    if weight_decay > 0:
        parts.append(optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay))
    else:
        parts.append(optax.adam(lr, b1=b1, b2=b2))
    return optax.chain(*parts)


def _logprobs(graphdef, params, batch, spec: LossSpec, prompt_width: int, share: bool = False):
    return token_logprobs(
        graphdef,
        params,
        batch.tokens,
        input_mask=batch.input_mask,
        response_start=prompt_width,
        routing=batch.routing if spec.r3 else None,
        cutoffs=batch.cutoffs if spec.support_replay else None,
        temperature=spec.temperature,
        chunk_size=spec.logprob_chunk,
        shared_prefix=(spec.prompt_group, prompt_width) if share else None,
    )


def policy_loss(
    params,
    batch: RolloutBatch,
    extra,
    *,
    graphdef,
    spec: LossSpec,
    prompt_width: int,
    share: bool = False,
    objective=None,
    version=None,
):
    """The training loss of ``params`` on ``batch`` and its metrics: the log-prob passes (of the
    behaviour ``extra["old"]`` and reference ``extra["ref"]`` policies under stop-gradient, when
    the spec needs them), the objective, the model's Switch loss and the total. ``share``: the
    batch's groups share their prompts (``make_train_step``).

    ``objective(local, fields) -> (loss, metrics)`` reduces the per-token ``local`` log-probs,
    entropies and routing flips with the batch's loss ``fields``: the step passes its
    ``shard_map`` over the batch axes; the default reduces the whole batch in place.
    ``version``: the parameter version of ``params`` (updates applied), from which each token's
    staleness is read (objectives that take ``staleness=``, the mismatch by staleness)."""
    if objective is None:
        objective = _batch_objective(spec, None)
    local = {}
    if spec.needs_old:
        local["old"] = jax.lax.stop_gradient(
            _logprobs(graphdef, extra["old"], batch, spec, prompt_width, share)[0]
        )
    if spec.needs_ref:
        local["ref"] = jax.lax.stop_gradient(
            _logprobs(graphdef, extra["ref"], batch, spec, prompt_width, share)[0]
        )
    local["logp"], local["entropy"], aux = _logprobs(
        graphdef, params, batch, spec, prompt_width, share
    )
    local["flips"] = routing_flip_share(aux["router_top_k"], batch.routing, prompt_width)
    loss, metrics = objective(local, _loss_fields(batch, spec, version))
    if spec.router_aux:  # the model's Switch loss, over the global batch
        loss = loss + aux["aux_loss"]
        metrics["loss/router_aux"] = aux["aux_loss"]
    metrics["loss/total"] = loss
    return loss, metrics


def _split_micro(batch: RolloutBatch, k: int, group: int) -> RolloutBatch:
    """``batch`` as k micro-batches stacked on a new leading axis: micro-batch i holds group
    slots i, i + k, i + 2k, ... of ``group`` consecutive rows each (so a row-sharded batch gives
    every device an equal share of every micro-batch, and groups stay whole)."""
    b = batch.size
    if b % (k * group):
        raise ValueError(
            f"micro_batches={k}: the batch of {b} sequences must split into {k} micro-batches "
            f"of whole groups of {group}"
        )

    def split(field, x):
        axis = RolloutBatch.batch_axis(field)  # [k, ...] with the rows at their own axis
        return jnp.moveaxis(_split_rows(jnp.moveaxis(x, axis, 0), k, group), 1, axis + 1)

    return RolloutBatch(**{f: split(f, getattr(batch, f)) for f in RolloutBatch.fields()})


def _merge_micro(x: jax.Array, group: int) -> jax.Array:
    """The inverse of :func:`_split_micro` for a per-row array ``[k, B/k, ...]`` -> ``[B, ...]``
    in the batch's row order."""
    k, rows = x.shape[:2]
    x = x.reshape((k, rows // group, group) + x.shape[2:])
    return jnp.moveaxis(x, 0, 1).reshape((k * rows,) + x.shape[3:])


def micro_batched_loss(
    params,
    batch: RolloutBatch,
    extra,
    *,
    graphdef,
    spec: LossSpec,
    prompt_width: int,
    share: bool = False,
    objective=None,
    version=None,
):
    """``(loss, metrics), grads`` of :func:`policy_loss` over ``spec.micro_batches`` micro-batches
    (:func:`_split_micro`), in two passes:

    1. the model's per-token outputs (log π_θ, entropies, the behaviour and reference log-probs
       when needed, routing flips) of each micro-batch in turn, without gradients;
    2. the objective on the whole batch's per-token arrays, so that every batch statistic is the
       whole batch's, and its gradient with respect to the per-token log-probs and entropies;
       then, micro-batch by micro-batch, the model's vector-Jacobian product with those
       cotangents, summed.

    The loss, metrics and gradient of the objective are those of one batch (to float rounding);
    the cost is one more forward pass of the policy per micro-batch. The model's Switch loss
    (``spec.router_aux``) is the mean of the micro-batches' own, as other trainers that
    accumulate gradients compute it."""
    k, group = spec.micro_batches, max(spec.prompt_group, 1)
    if objective is None:
        objective = _batch_objective(spec, None)
    micro = _split_micro(batch, k, group)

    def outputs(p, mb):
        logp, entropy, aux = _logprobs(graphdef, p, mb, spec, prompt_width, share)
        return (logp, entropy, aux["aux_loss"]), aux["router_top_k"]

    def first_pass(_, mb):
        out = {}
        (out["logp"], out["entropy"], out["aux_loss"]), top_k = outputs(params, mb)
        out["flips"] = routing_flip_share(top_k, mb.routing, prompt_width)
        if spec.needs_old:
            out["old"] = _logprobs(graphdef, extra["old"], mb, spec, prompt_width, share)[0]
        if spec.needs_ref:
            out["ref"] = _logprobs(graphdef, extra["ref"], mb, spec, prompt_width, share)[0]
        return None, jax.lax.stop_gradient(out)

    _, per_micro = jax.lax.scan(first_pass, None, micro)
    aux_loss = jnp.mean(per_micro.pop("aux_loss"))
    local = {name: _merge_micro(v, group) for name, v in per_micro.items()}
    fields = _loss_fields(batch, spec, version)

    def whole(logp, entropy):
        return objective({**local, "logp": logp, "entropy": entropy}, fields)

    (loss, metrics), (g_logp, g_entropy) = jax.value_and_grad(whole, argnums=(0, 1), has_aux=True)(
        local["logp"], local["entropy"]
    )
    cotangents = (_split_rows(g_logp, k, group), _split_rows(g_entropy, k, group))

    def second_pass(total, inputs):
        mb, ct_logp, ct_entropy = inputs
        out, vjp, _ = jax.vjp(lambda p: outputs(p, mb), params, has_aux=True)
        # The Switch loss enters the total as the mean over micro-batches.
        ct_aux = jnp.asarray(1.0 / k if spec.router_aux else 0.0, out[2].dtype)
        (grads,) = vjp((ct_logp, ct_entropy, ct_aux))
        return jax.tree.map(jnp.add, total, grads), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, _ = jax.lax.scan(second_pass, zeros, (micro, *cotangents))
    if spec.router_aux:
        loss = loss + aux_loss
        metrics["loss/router_aux"] = aux_loss
    metrics["loss/total"] = loss
    return (loss, metrics), grads


def _split_rows(x: jax.Array, k: int, group: int) -> jax.Array:
    """A per-row array ``[B, ...]`` as :func:`_split_micro` splits a batch: ``[k, B/k, ...]``."""
    b = x.shape[0]
    x = x.reshape((b // (k * group), k, group) + x.shape[1:])
    return jnp.moveaxis(x, 1, 0).reshape((k, b // k) + x.shape[3:])


def _batch_objective(spec: LossSpec, axis_name):
    """The objective on per-token log-probs (``policy_loss``'s ``local``), global over
    ``axis_name``."""

    def objective(local, fields):
        return _objective(
            local["logp"],
            local["entropy"],
            local.get("old"),
            local.get("ref"),
            fields,
            spec,
            axis_name,
            local["flips"],
        )

    return objective


def routing_flip_share(router_top_k, routing, prompt_width: int) -> jax.Array:
    """Per response token, the share of MoE layers whose trainer top-k set differs from the
    engine's recorded one, ``[B, N]`` float32 (``moe.routing_flips``).

    Column j of the response is predicted at fed slot ``prompt_width − 1 + j``, so the routing of
    that slot is the token's; averaged over active tokens this is the batch's routing flip rate.
    Both inputs are ``[L, B, P + N − 1, k]``; with no MoE layer the share is 0.
    """
    top, rec = router_top_k[:, :, prompt_width - 1 :], routing[:, :, prompt_width - 1 :]
    if top.shape[0] == 0:
        return jnp.zeros(top.shape[1:3], jnp.float32)
    return jnp.mean(routing_flips(top, rec).astype(jnp.float32), axis=0)


def _loss_fields(batch: RolloutBatch, spec: LossSpec, version=None) -> dict[str, jax.Array]:
    """The per-sequence / per-token fields the objective reads (all with the batch on axis 0).

    With ``version`` (the parameters' version, in the numbering of ``batch.versions``) it also
    holds each token's versions behind the policy being trained, ``staleness = version −
    batch.versions``: the mismatch by staleness bucket reads it for every objective, and an
    objective that takes ``staleness=`` gets it."""
    fields = {
        "response_mask": batch.response_mask,
        "behavior_logp": batch.behavior_logp,
        "advantages": batch.advantages,
    }
    if version is None and losses.registry.takes_staleness(spec.objective):
        raise ValueError(
            f"objective {spec.objective!r} takes `staleness`: pass the parameters' version"
        )
    if version is not None:
        fields["staleness"] = (version - batch.versions).astype(jnp.int32)
    return fields


#: Staleness buckets of the mismatch metrics, in versions behind: (name, lowest, highest).
LAG_BUCKETS = (("lag_le2", 0, 2), ("lag_ge8", 8, None))


def _mismatch_by_lag(logp, denominator, mask, lag, axis_name) -> dict[str, jax.Array]:
    """d̄_π over the active tokens of each :data:`LAG_BUCKETS` bucket (``mismatch/<bucket>``,
    0 when the bucket is empty) and the bucket's share of active tokens (``<bucket>_share``):
    whether the mismatch of a batch that mixes fresh and stale groups grows with their age."""
    log_ratio = jnp.where(mask, logp - denominator, 0.0)
    out = {}
    for name, lo, hi in LAG_BUCKETS:
        inside = (lag >= lo) if hi is None else ((lag >= lo) & (lag <= hi))
        inside = inside & (mask != 0)
        out[f"mismatch/{name}"] = losses.aggregate(
            jnp.abs(log_ratio), inside, "token-mean", axis_name
        )
        out[f"mismatch/{name}_share"] = losses.aggregate(
            inside.astype(jnp.float32), mask, "token-mean", axis_name
        )
    return out


def _objective(logp, entropy, old_logp, ref_logp, batch, spec: LossSpec, axis_name, flips=None):
    """The policy objective (+ corrections, KL, metrics) from per-token log-probs [B, N] of a
    (local) batch shard; every batch statistic is global over ``axis_name``. ``flips``: the
    per-token routing flip share [B, N] (``routing_flip_share``), or None."""
    mask = batch["response_mask"]
    behavior = batch["behavior_logp"]
    denominator = behavior if spec.ratio_denominator == "rollout" else old_logp
    weights = None
    if spec.correction != "none":
        weights = losses.registry.correction_weights(
            spec.correction,
            logp=logp,
            old_logp=old_logp,
            behavior_logp=behavior,
            mask=mask,
            **dict(spec.correction_kwargs),
        )
    takes = "staleness" in batch and losses.registry.takes_staleness(spec.objective)
    extra = {"staleness": batch["staleness"]} if takes else {}
    out = losses.get(spec.objective)(
        logp,
        denominator,
        batch["advantages"],
        mask,
        aggregation=spec.aggregation,
        token_weights=weights,
        axis_name=axis_name,
        **extra,
        **dict(spec.objective_kwargs),
    )
    loss = out.loss
    metrics = {f"loss/{k}": v for k, v in out.metrics.items()}
    metrics["loss/policy"] = out.loss
    if spec.needs_ref:
        kl = losses.low_var_kl(
            logp, ref_logp, mask, aggregation=spec.aggregation, axis_name=axis_name
        )
        loss = loss + spec.kl_coef * kl.loss
        metrics["loss/kl_ref"] = kl.metrics["kl"]
    # The shape of the ratio the loss sees: percentiles of |log r|, sequence maximum, ESS.
    for name, value in losses.mismatch_shape(logp, denominator, mask, axis_name).items():
        metrics[f"mismatch/{name}"] = value
    if "staleness" in batch:
        metrics.update(_mismatch_by_lag(logp, denominator, mask, batch["staleness"], axis_name))
    if spec.decompose_mismatch:
        parts = losses.mismatch_decomposition(logp, old_logp, behavior, mask, axis_name)
        for key, value in parts.items():
            part, stat = key.split("/")
            metrics[f"mismatch/{part}" + ("" if stat == "mean" else f"_{stat}")] = value
    elif spec.needs_old:
        # Engine mismatch alone: trainer recompute vs engine log-probs of the same version.
        engine = losses.mismatch_metrics(old_logp, behavior, mask, axis_name=axis_name)
        metrics["mismatch/engine"] = engine["mismatch"]
    if flips is not None:
        metrics["routing/flip_rate"] = losses.aggregate(flips, mask, "token-mean", axis_name)
    metrics["train/entropy"] = losses.aggregate(entropy, mask, "token-mean", axis_name)
    if spec.entropy_coef > 0:
        bonus = losses.aggregate(entropy, mask, spec.aggregation, axis_name)
        loss = loss - spec.entropy_coef * bonus
        metrics["loss/entropy_bonus"] = spec.entropy_coef * bonus
    return loss, metrics


def opt_state_shardings(optimizer, opt_state, param_shardings, scalars=None):
    """Shardings of an optimizer state: leaves shaped like the parameters (Adam's moments) take
    their parameter's sharding, the rest (step counts) ``scalars`` (None: left to the
    compiler)."""
    return optax.tree_map_params(
        optimizer,
        lambda _, s: s,
        opt_state,
        param_shardings,
        transform_non_params=lambda _: scalars,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def _constrain(tree, shardings):
    def put(x, s):
        return x if s is None else jax.lax.with_sharding_constraint(x, s)

    return jax.tree.map(
        put, tree, shardings, is_leaf=lambda x: x is None or isinstance(x, NamedSharding)
    )


def make_train_step(
    graphdef, optimizer, spec: LossSpec, *, prompt_width: int, mesh, donate: bool = False
):
    """Builds the update ``step(state, batch, extra) -> (state, metrics)``.

    Layout on ``mesh`` (``sat_jax.parallel.make_mesh``: axes data, fsdp, expert, tensor):

    * Parameters, gradients and optimizer state in the table of ``sat_jax.models.sharding``
      (``param_shardings``; the optimizer moments take their parameter's sharding); the step's
      outputs are constrained to it, so the state keeps its layout step after step.
    * The batch split over ``data × fsdp`` (``BATCH_AXES``). The model (log π_θ, the recomputed
      log μ̃ and the reference) runs under GSPMD: ``jax.jit`` inserts the FSDP all-gathers,
      expert- and tensor-parallel collectives.
    * The policy objective runs inside ``jax.shard_map`` over ``data × fsdp`` with
      ``axis_name=("data", "fsdp")``, on each device's own rows of the [B, N] per-token arrays:
      its batch statistics (means, counts, SAT's quantile) are global through scalar ``psum``s,
      and no token-sized array is all-gathered.

    A 1-D data mesh (fsdp = expert = tensor = 1) is plain data parallelism: parameters
    replicated (every spec is ``P()``), the batch split over ``data``.

    ``batch`` is a :class:`~sat_jax.rl.batch.RolloutBatch` (batch axis first; ``routing``
    second);
    ``extra`` is a dict with ``"old"`` (behaviour-version parameters, when the spec needs a
    recompute) and ``"ref"`` (reference parameters, when ``kl_coef > 0``).

    Staleness: each token's versions behind the trained parameters is ``version −
    batch.versions`` (objectives that take ``staleness=``, the mismatch-by-staleness metrics).
    ``step(..., version=)`` is the parameters' version in the caller's numbering, the numbering of
    ``batch.versions`` (the learner passes its step: the version it publishes after the previous
    step); without it, the count of applied updates (``state.step``), which is the same only with
    one update per version and no refused update.

    Non-finite updates: when the loss, the gradient's norm or the update's norm is not finite,
    the step returns the input parameters, optimizer state and count unchanged, with
    ``metrics["optim/nonfinite"] = 1`` (0 otherwise).

    Donation: with ``donate`` the optimizer state's buffers are donated (updated in place, no
    second copy of the moments at the step's peak); the caller must then not reuse the input
    state's optimizer state (the learner does not: it replaces the state by the step's output,
    and checkpoints copy to host before returning). The parameters are never donated: the
    snapshot store keeps earlier parameter versions (the behaviour policy of stale rollouts) by
    reference, so the input parameters must survive the step. Off by default so that callers
    that step one state twice (tests, studies) keep working.

    Shared prompts: with ``spec.prompt_group`` G > 1 the rows are taken as groups of G samples
    of one prompt (the layout of ``RolloutBatch``). ``step(state, batch, extra, share=None)``
    then checks the batch (``batch.shares_prompt``: each group's prompt slots, masks and, with
    R3, replayed routing identical; a device batch is fetched for it, so a caller with the host
    batch at hand checks that and passes ``share``; a traced batch, as under ``jax.vmap``, or
    one spread over several processes is taken as not sharing unless ``share`` says so; the
    learner checks its host batch with ``shares_prompt`` and agrees across processes) and, when
    it holds, runs the program whose log-prob passes compute each group's prompt once in every
    block (``token_logprobs(shared_prefix=(G, prompt_width))``: same values and gradients to
    float rounding, about (P + G·N)/(G·(P + N)) of the per-token work); otherwise the plain
    program, compiled on first need.

    Raises (while tracing, before anything compiles):
      ValueError: the mesh does not divide the model or the batch, naming the axis and the
        dimension.
    """
    axes = batch_axes(mesh)
    objective = _batch_objective(spec, axes if axes else None)

    def train(share, params, opt_state, count, batch, extra, version):
        model_cfg = nnx.merge(graphdef, params).config
        check_mesh(model_cfg, mesh, batch=batch.size)
        shardings = param_shardings(model_cfg, mesh)
        batch = jax.tree.map(
            lambda v, s: jax.lax.with_sharding_constraint(v, NamedSharding(mesh, s)),
            batch,
            RolloutBatch.specs(axes),
        )
        smap = jax.shard_map(objective, mesh=mesh, in_specs=P(axes), out_specs=(P(), P()))

        how = dict(
            graphdef=graphdef,
            spec=spec,
            prompt_width=prompt_width,
            share=share,
            objective=smap,
            version=version,
        )
        if spec.micro_batches > 1:
            shards = math.prod(mesh.shape[a] for a in axes)
            if (batch.size // spec.micro_batches) % shards:
                raise ValueError(
                    f"micro_batches={spec.micro_batches}: each micro-batch "
                    f"({batch.size // spec.micro_batches} sequences) must divide evenly over "
                    f"{shards} batch shards (mesh data x fsdp)"
                )
            (loss, metrics), grads = micro_batched_loss(params, batch, extra, **how)
        else:
            (loss, metrics), grads = jax.value_and_grad(
                lambda p: policy_loss(p, batch, extra, **how), has_aux=True
            )(params)
        grads = _constrain(grads, shardings)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        grad_norm, update_norm = optax.tree.norm(grads), optax.tree.norm(updates)
        # An update with a non-finite loss, gradient or step is not applied: parameters,
        # optimizer state and count stay as they were (the learner counts such steps).
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)

        def keep(new, old):
            return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

        params = _constrain(keep(optax.apply_updates(params, updates), params), shardings)
        opt_state = keep(new_opt_state, opt_state)
        opt_state = _constrain(opt_state, opt_state_shardings(optimizer, opt_state, shardings))
        metrics["optim/grad_norm"] = grad_norm
        metrics["optim/update_norm"] = update_norm
        metrics["optim/nonfinite"] = 1.0 - finite.astype(jnp.float32)
        return params, opt_state, count + finite.astype(count.dtype), metrics

    def on_mesh(share):
        def train_on_mesh(*args):
            # The model's activation constraints (sharding.constrain) read the mesh from here.
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return train(share, *args)

        return jax.jit(train_on_mesh, donate_argnums=(1,) if donate else ())

    # The spec's own program, and (compiled only if a batch ever needs it) the one that runs
    # every row's prompt: a batch whose groups do not share their prompt slots.
    grouped = spec.prompt_group > 1
    jitted = on_mesh(grouped)
    unshared = on_mesh(False) if grouped else jitted

    def step(state: TrainState, batch, extra, *, share: bool | None = None, version=None):
        if share is None:
            # A traced batch (the step under vmap) cannot be checked, nor, without the other
            # processes agreeing, a batch spread over them: those run the plain program.
            checkable = not any(
                isinstance(x, jax.core.Tracer)
                or (isinstance(x, jax.Array) and not x.is_fully_addressable)
                for x in jax.tree.leaves(batch)
            )
            share = checkable and shares_prompt(batch, spec, prompt_width)
        if share and not grouped:
            raise ValueError("share=True needs a LossSpec with prompt_group > 1")
        fn = jitted if share else unshared
        step.calls["shared" if share else "plain"] += 1
        # A host value, placed like the step count: replicated on the mesh as one global array
        # (every process passes the same version), so the program's input types do not change.
        if version is None:
            version = state.step
        elif not isinstance(version, jax.Array):
            version = parallel.replicate(np.asarray(version, state.step.dtype), mesh)
        params, opt_state, count, metrics = fn(
            state.params, state.opt_state, state.step, batch, extra, version
        )
        return TrainState(params, opt_state, count), metrics

    # The compiled program's handles, for tests and ahead-of-time compilation (``jitted`` is
    # the spec's program: prompts shared when ``prompt_group > 1``).
    # How many times each program ran (shared prompts / plain), for tests and logs.
    step.calls = {"shared": 0, "plain": 0}
    step._cache_size = lambda: jitted._cache_size() + (unshared._cache_size() if grouped else 0)
    step.jitted = jitted
    step.unshared = unshared
    step.args = lambda state, batch, extra: (
        state.params,
        state.opt_state,
        state.step,
        batch,
        extra,
        state.step,
    )
    step.lower = lambda state, batch, extra: jitted.lower(
        state.params, state.opt_state, state.step, batch, extra, state.step
    )
    return step


def shares_prompt(batch: RolloutBatch, spec: LossSpec, prompt_width: int) -> bool:
    """Whether the step may run its shared-prompt program on ``batch``: ``spec.prompt_group`` > 1
    and every group's prompt slots identical (``RolloutBatch.shares_prompt``, with routing under
    R3) in this process's host ``batch``, agreed by every process (each holds its own rows, and
    all must run the same program). Pass the result as ``step(..., share=)``."""
    if spec.prompt_group <= 1:
        return False
    ok = batch.shares_prompt(spec.prompt_group, prompt_width, routing=spec.r3)
    if jax.process_count() > 1:
        ok = bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))
    return ok


def init_train_state(params: nnx.State, optimizer, mesh=None, *, config=None) -> TrainState:
    """The state before the first update: ``params``, ``optimizer.init(params)`` and step 0.

    With ``mesh``, parameters are placed in ``param_shardings(config, mesh)`` (a no-op for
    parameters already there, e.g. from ``init_model(config, mesh=mesh)`` or ``load_hf(...,
    mesh=mesh)``; without ``config`` the parameters' own shardings are kept) and the optimizer
    state is created directly sharded (``jax.jit(optimizer.init)`` with the moments' output
    shardings those of their parameters), so no full-size moment exists on one device.
    """
    if mesh is None:
        return TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32))
    if config is not None:
        shardings = param_shardings(config, mesh)
        params = jax.device_put(params, shardings)
    else:
        shardings = jax.tree.map(lambda x: x.sharding, params)
    replicated = NamedSharding(mesh, P())
    opt_sh = opt_state_shardings(
        optimizer, jax.eval_shape(optimizer.init, params), shardings, replicated
    )
    opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
    return TrainState(params, opt_state, step)


def abstract_train_state(config, optimizer, mesh) -> TrainState:
    """The state ``init_train_state`` would place on ``mesh``, as sharded ``jax.ShapeDtypeStruct``
    leaves (nothing allocated): what ahead-of-time lowering of the step takes."""

    def spec(tree, shardings):
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
        )

    shardings = param_shardings(config, mesh)
    params = spec(abstract_params(config), shardings)
    opt = jax.eval_shape(optimizer.init, params)
    replicated = NamedSharding(mesh, P())
    opt = spec(opt, opt_state_shardings(optimizer, opt, shardings, replicated))
    return TrainState(params, opt, jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated))
