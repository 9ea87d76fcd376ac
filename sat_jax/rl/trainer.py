"""The trainer step: one jitted, data-parallel update from a rollout batch.

Inside ``jax.shard_map`` over the mesh's ``data`` axis (batch sharded, parameters replicated) the
step recomputes log π_θ of the sampled tokens (with R3 routing replay and support replay when
enabled), applies the configured objective from ``sat_jax.losses`` with ``axis_name="data"`` (so
every batch statistic, SAT's quantile included, is global), optional corrections (TIS, IcePop,
KPop; ``sat_jax.losses.registry.correction_weights``) and
the low-variance KL to a reference policy. Replicated parameters make the gradient of the global
loss exact per device; the optax update runs on the replicated result.

The step is a pure function ``(TrainState, batch, extra_params) -> (TrainState, metrics)``, so it
can also be vmapped over a leading "run" axis of stacked states for many small studies at once
(``jax.vmap(step, in_axes=(0, 0, None))``; tested against each run alone, and
``benchmarks/runs.py`` measures what it buys).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from sat_jax import losses
from sat_jax.models.logprobs import token_logprobs
from sat_jax.rl.batch import BATCH_AXES, RolloutBatch, axis_name


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
    r3: bool = True
    support_replay: bool = True
    temperature: float = 1.0
    router_aux: bool = False  # add the model's load-balancing loss (router_aux_loss_coef > 0)

    @property
    def needs_old(self) -> bool:
        """Whether the trainer must recompute log μ̃ under the behaviour version's parameters."""
        return (self.ratio_denominator == "recompute" or self.correction != "none"
                and losses.registry.correction_reference(self.correction) == "old")

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
        lr = optax.warmup_cosine_decay_schedule(
            0.0, learning_rate, max(warmup_steps, 1), max(total_steps, warmup_steps + 1)
        )
    else:
        raise ValueError(f"schedule must be constant|cosine, got {schedule!r}")
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
    if weight_decay > 0:
        parts.append(optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay))
    else:
        parts.append(optax.adam(lr, b1=b1, b2=b2))
    return optax.chain(*parts)


def _logprobs(graphdef, params, batch, spec: LossSpec, prompt_width: int):
    return token_logprobs(
        graphdef,
        params,
        batch.tokens,
        input_mask=batch.input_mask,
        response_start=prompt_width,
        routing=batch.routing if spec.r3 else None,
        cutoffs=batch.cutoffs if spec.support_replay else None,
        temperature=spec.temperature,
    )


def policy_loss(params, batch: RolloutBatch, extra, *, graphdef, spec: LossSpec, prompt_width: int,
                axis_name):
    """Loss and metrics on one (local) shard of a batch; global over ``axis_name``."""
    mask = batch.response_mask
    behavior = batch.behavior_logp
    old_logp = ref_logp = None
    if spec.needs_old:
        old_logp = jax.lax.stop_gradient(
            _logprobs(graphdef, extra["old"], batch, spec, prompt_width)[0]
        )
    if spec.needs_ref:
        ref_logp = jax.lax.stop_gradient(
            _logprobs(graphdef, extra["ref"], batch, spec, prompt_width)[0]
        )
    logp, entropy, aux = _logprobs(graphdef, params, batch, spec, prompt_width)
    denominator = behavior if spec.ratio_denominator == "rollout" else old_logp
    weights = None
    if spec.correction != "none":
        weights = losses.registry.correction_weights(
            spec.correction, logp=logp, old_logp=old_logp, behavior_logp=behavior, mask=mask,
            **dict(spec.correction_kwargs),
        )
    out = losses.get(spec.objective)(
        logp,
        denominator,
        batch.advantages,
        mask,
        aggregation=spec.aggregation,
        token_weights=weights,
        axis_name=axis_name,
        **dict(spec.objective_kwargs),
    )
    loss = out.loss
    metrics = {f"loss/{k}": v for k, v in out.metrics.items()}
    metrics["loss/policy"] = out.loss
    if spec.needs_ref:
        kl = losses.low_var_kl(logp, ref_logp, mask, aggregation=spec.aggregation,
                               axis_name=axis_name)
        loss = loss + spec.kl_coef * kl.loss
        metrics["loss/kl_ref"] = kl.metrics["kl"]
    if spec.needs_old:
        # Engine mismatch alone: trainer recompute vs engine log-probs of the same version.
        engine = losses.mismatch_metrics(old_logp, behavior, mask, axis_name=axis_name)
        metrics["mismatch/engine"] = engine["mismatch"]
    if spec.router_aux:
        aux_loss = aux["aux_loss"] if axis_name is None else jax.lax.pmean(aux["aux_loss"],
                                                                             axis_name)
        loss = loss + aux_loss
        metrics["loss/router_aux"] = aux_loss
    metrics["train/entropy"] = losses.aggregate(entropy, mask, "token-mean", axis_name)
    metrics["loss/total"] = loss
    return loss, metrics


def make_train_step(graphdef, optimizer, spec: LossSpec, *, prompt_width: int, mesh):
    """Builds the jitted update ``step(state, batch, extra) -> (state, metrics)``.

    ``batch`` is a :class:`~sat_jax.rl.batch.RolloutBatch` sharded over ``mesh``'s batch axes
    (:data:`~sat_jax.rl.batch.BATCH_AXES`); ``extra`` is a dict with ``"old"`` (behaviour-version
    parameters, when the spec needs a recompute) and ``"ref"`` (reference parameters, when
    ``kl_coef > 0``), replicated.
    """

    def grads_and_metrics(params, batch, extra):
        def loss_fn(p):
            return policy_loss(
                p, batch, extra, graphdef=graphdef, spec=spec, prompt_width=prompt_width,
                axis_name=axis_name(BATCH_AXES),
            )

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return grads, metrics

    sharded = jax.shard_map(
        grads_and_metrics,
        mesh=mesh,
        in_specs=(P(), RolloutBatch.specs(BATCH_AXES), P()),
        out_specs=(P(), P()),
    )

    def step(state: TrainState, batch: RolloutBatch, extra):
        grads, metrics = sharded(state.params, batch, extra)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics["optim/grad_norm"] = optax.tree.norm(grads)
        metrics["optim/update_norm"] = optax.tree.norm(updates)
        return TrainState(params, opt_state, state.step + 1), metrics

    # No buffer donation: the snapshot store keeps references to earlier parameter versions.
    return jax.jit(step)


def init_train_state(params: nnx.State, optimizer) -> TrainState:
    return TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32))
