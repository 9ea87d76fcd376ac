"""SAT and the other objectives of :mod:`sat_jax.losses` as tunix policy-loss functions.

Importing this module registers, in tunix's own registry (``tunix.rl.function_registry``), one
policy-loss function per objective that :func:`sat_jax.losses.names` lists at that moment. A
tunix GRPO user then switches to SAT with one config value::

    import sat_jax.integrations.tunix  # registers "sat", "sat_gspo", ...
    config = GRPOConfig(policy_loss_fn="sat", num_iterations=2, ...)

Each objective is registered as ``"sat_jax/NAME"``, and also as plain ``"NAME"`` unless tunix
already has a function of that name (its own ``"grpo"`` and ``"ppo"`` are never replaced: ours are
then ``"sat_jax/grpo"`` and ``"sat_jax/ppo"``).

What the registered function does, step by step, mirrors tunix's ``grpo`` loss
(``tunix.rl.algo_core.grpo_loss_fn``) with the objective swapped:

* log π_θ of the completion tokens from ``tunix.rl.common.compute_per_token_logps`` (same
  temperature, packing segments and padding as tunix's loss);
* the ratio denominator is ``train_example.old_per_token_logps``, the policy that sampled the
  batch. tunix fills it only when ``num_iterations > 1``; with one update per batch it is the
  detached current policy, the ratio is 1 and no trust region (SAT's included) can act;
* advantages, the completion mask and tunix's optional ``sampler_is_weights`` (as
  ``token_weights``) go to the objective unchanged;
* ``loss_agg_mode`` maps to our ``aggregation`` by :data:`AGGREGATIONS` (same value, see
  docs/losses.md);
* tunix's clip fields feed the objectives that have the matching keyword: ``epsilon`` →
  ``eps_low``, ``epsilon_high`` (else ``epsilon``) → ``eps_high``, ``epsilon_c`` → ``dual_clip``;
* the KL penalty (``beta``, ``kl_loss_mode``, ``kl_clamp_value``) is tunix's own term, added to the
  objective's loss as in tunix's ``grpo``.

The aux dict holds tunix's ``kl``, ``kl_loss``, ``pg_loss`` and ``pg_clipfrac`` (our
``clip_frac``) plus every metric of the objective under its own name (``sat/q``,
``sat/binding_rate``, ...). Other hyper-parameters (SAT's ``alpha``, ``hill_exponent``, ...) take
the objective's defaults; :func:`register` adds a variant with others under a new name.

Batch statistics (SAT's quantile, the token-mean denominator) are over the micro-batch tunix
passes to the loss: set ``train_micro_batch_size`` equal to ``mini_batch_size`` for the statistic
of the whole mini-batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.rl import common, function_registry

from sat_jax import losses
from sat_jax.losses import registry as loss_registry

PREFIX = "sat_jax/"

#: tunix ``loss_agg_mode`` → our ``aggregation``, the same value with tunix's default ``norm``
#: (which tunix's GRPO loss never overrides): ``sequence-mean-token-scale`` divides by the padded
#: width per non-empty row, ``sequence-mean-token-sum-norm`` by the non-empty rows alone.
AGGREGATIONS = {
    "token-mean": "token-mean",
    "sequence-mean-token-mean": "seq-mean-token-mean",
    "seq-mean-token-sum": "seq-mean-token-sum",
    "sequence-mean-token-scale": "seq-mean-token-sum-norm-active",
    "sequence-mean-token-sum-norm": "seq-mean-token-sum",
}

_OWNED: dict[str, Callable] = {}


def _clip_settings(algo_config: Any, accepted: set[str]) -> dict[str, Any]:
    """Our clip keywords from tunix's clip fields, for the keywords the objective takes."""
    epsilon = algo_config.epsilon
    settings = {
        "eps_low": epsilon,
        "eps_high": getattr(algo_config, "epsilon_high", None) or epsilon,
    }
    epsilon_c = getattr(algo_config, "epsilon_c", None)
    if epsilon_c is not None:
        if "dual_clip" not in accepted:
            raise ValueError(
                f"`epsilon_c` is {epsilon_c!r}, but this objective has no dual clip; "
                "set epsilon_c=None."
            )
        settings["dual_clip"] = epsilon_c
    return {k: v for k, v in settings.items() if k in accepted}


def per_token_logps(model, train_example, algo_config, pad_id, eos_id, *, stop_gradient=False):
    """log π_θ of the completion tokens ``[B, T]``, float32, computed as tunix's GRPO loss does."""
    graphdef, state = nnx.split(model)
    logp = common.compute_per_token_logps(
        graphdef,
        state,
        prompt_tokens=train_example.prompt_ids,
        completion_tokens=train_example.completion_ids,
        pad_id=pad_id,
        eos_id=eos_id,
        stop_gradient=stop_gradient,
        segment_ids=getattr(train_example, "segment_ids", None),
        segment_positions=getattr(train_example, "segment_positions", None),
        temperature=getattr(algo_config, "temperature", 1.0),
    )
    return logp.astype(jnp.float32)


def policy_loss_fn(objective: str, **hyperparameters: Any) -> Callable:
    """A tunix policy-loss function computing ``sat_jax.losses.get(objective)``.

    ``hyperparameters`` fix keywords of the objective (e.g. ``alpha=0.8`` for ``"sat"``); they
    take precedence over tunix's clip fields. Unknown keywords and bad values raise here.
    """
    fn = losses.get(objective)
    accepted = set(loss_registry.hyperparameters(objective))
    unknown = sorted(set(hyperparameters) - accepted)
    if unknown:
        raise ValueError(
            f"`hyperparameters` {unknown} are not keywords of {objective!r}; "
            f"it takes {sorted(accepted)}."
        )
    if hyperparameters:
        loss_registry.check(objective, hyperparameters)

    def loss_fn(model, train_example, algo_config, pad_id, eos_id, **kwargs):
        del kwargs
        loss_algo = getattr(algo_config, "loss_algo", "grpo")
        if loss_algo != "grpo":
            raise ValueError(
                f"`loss_algo` is {loss_algo!r}, but policy_loss_fn={objective!r} is the whole "
                "objective: leave loss_algo='grpo' (use 'sat_gspo' or 'gspo_token' for the "
                "sequence ratio)."
            )
        mode = getattr(algo_config, "loss_agg_mode", "token-mean")
        if mode not in AGGREGATIONS:
            raise ValueError(
                f"`loss_agg_mode` must be one of {sorted(AGGREGATIONS)}, got {mode!r}."
            )
        mask = train_example.completion_mask
        logp = per_token_logps(model, train_example, algo_config, pad_id, eos_id)
        behavior_logp = train_example.old_per_token_logps
        if behavior_logp is None:
            behavior_logp = jax.lax.stop_gradient(logp)
        out = fn(
            logp,
            behavior_logp,
            train_example.advantages,
            mask,
            aggregation=AGGREGATIONS[mode],
            token_weights=getattr(train_example, "sampler_is_weights", None),
            **{**_clip_settings(algo_config, accepted), **hyperparameters},
        )
        loss = out.loss
        aux = dict(out.metrics)
        aux.update(pg_loss=loss, pg_clipfrac=out.metrics.get("clip_frac", 0.0), kl=0.0, kl_loss=0.0)
        if train_example.ref_per_token_logps is not None:
            # tunix's own KL term, so that beta means what it means in tunix's grpo loss.
            kl = common.compute_kl_divergence(
                logp,
                train_example.ref_per_token_logps,
                getattr(algo_config, "kl_loss_mode", "kl"),
                clamp_value=getattr(algo_config, "kl_clamp_value", None),
            )
            aux["kl"] = common.aggregate_loss(kl, mask, "token-mean")
            aux["kl_loss"] = common.aggregate_loss(kl, mask, mode)
            beta = getattr(algo_config, "beta", 0.0)
            if beta:
                loss = loss + beta * aux["kl_loss"]
        return loss, aux

    loss_fn.__name__ = f"sat_jax_{objective}"
    loss_fn.__doc__ = f"tunix policy loss: sat_jax.losses.{objective}.\n\n" + (
        inspect.getdoc(fn) or ""
    )
    return loss_fn


def register(name: str, objective: str, **hyperparameters: Any) -> Callable:
    """Registers ``objective`` with fixed ``hyperparameters`` as tunix policy loss ``name``.

    Example: ``register("sat_a80", "sat", alpha=0.8)``, then ``policy_loss_fn="sat_a80"``.
    Refuses a name tunix or another caller already registered.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"`name` must be a non-empty string, got {name!r}.")
    if name in function_registry.default_registry.list_functions("policy_loss_fn"):
        raise ValueError(f"`name` {name!r} is already a tunix policy loss.")
    fn = policy_loss_fn(objective, **hyperparameters)
    function_registry.register_policy_loss_fn(name)(fn)
    _OWNED[name] = fn
    return fn


def register_all() -> tuple[str, ...]:
    """Registers every objective of :func:`sat_jax.losses.names` not yet registered here.

    Runs at import; call it again after adding an objective to ``sat_jax.losses``. Returns the
    tunix names added.
    """
    taken = set(function_registry.default_registry.list_functions("policy_loss_fn"))
    added = []
    for objective in losses.names():
        for name in (PREFIX + objective, objective):
            if name not in taken:
                register(name, objective)
                taken.add(name)
                added.append(name)
    return tuple(added)


def registered() -> tuple[str, ...]:
    """The tunix policy-loss names this module registered, sorted."""
    return tuple(sorted(_OWNED))


register_all()
