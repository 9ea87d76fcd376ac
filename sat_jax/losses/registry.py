"""Objectives and corrections by name, so that a config string selects them, and what each takes.

* :func:`get` / :func:`names` / :func:`register`: the tables.
* :func:`hyperparameters`: an objective's or correction's hyper-parameters with their defaults,
  read from its signature (so a new keyword of an objective appears here without an edit).
* :func:`correction_weights`: every correction behind one signature
  ``(logp, old_logp, behavior_logp, mask, **hyper-parameters)``; each correction compares the
  rollout engine's log μ with either the trainer's recomputation of the behaviour version
  (``"old"``: TIS, IcePop) or the current policy (``"current"``: KPop), see
  :func:`correction_reference`.
* :func:`check`: runs a loss's own argument checks on its configured hyper-parameters under
  ``jax.eval_shape`` (tracing on tiny abstract inputs, no compilation), so a bad value fails at
  configuration time with the loss's message.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sat_jax.losses import corrections, objectives, stabilizers

_OBJECTIVES: dict[str, Callable] = {
    "ppo": objectives.ppo,
    "grpo": objectives.ppo,  # GRPO's policy loss is PPO's token clip (Eq. 11).
    "sat": objectives.sat,
    "sat_grpo": objectives.sat,
    "gspo": objectives.gspo,
    "gspo_token": objectives.gspo_token,
    "sat_gspo": objectives.sat_gspo,
    "seqclip": objectives.seqclip,
    "dppo": objectives.dppo,
    "spo": objectives.spo,
    "drpo": objectives.drpo,
    "tis_pg": objectives.tis_pg,
    "m2po": stabilizers.m2po,
    "m2po_gspo": stabilizers.m2po_gspo,
    "bapo": stabilizers.bapo,
    "bapo_gspo": stabilizers.bapo_gspo,
    "age_clip": stabilizers.age_clip,
    "age_clip_gspo": stabilizers.age_clip_gspo,
    "cispo": stabilizers.cispo,
    "sapo": stabilizers.sapo,
    "decoupled_ppo": stabilizers.decoupled_ppo,
}
_CORRECTIONS: dict[str, Callable] = {
    "tis": corrections.tis,
    "icepop": corrections.icepop,
    "kpop": corrections.kpop,
    "seq_mis": corrections.seq_mis,
    "geo_rs": corrections.geo_rs,
}
# Which trainer log-prob a correction compares with the engine's: "old" (the behaviour version,
# recomputed by the trainer) or "current" (the policy being trained, detached).
_REFERENCE: dict[str, str] = {
    "tis": "old",
    "icepop": "old",
    "kpop": "current",
    "seq_mis": "old",
    "geo_rs": "old",
}
REFERENCES = ("old", "current")

# Objective keywords that are inputs of the trainer, not hyper-parameters of a config.
_NOT_HYPERPARAMETERS = frozenset(
    {"aggregation", "token_weights", "axis_name", "kernel", "staleness", "prox_logp"}
)
_REQUIRED = inspect.Parameter.empty


def _table(kind: str) -> dict[str, Callable]:
    table = {"objective": _OBJECTIVES, "correction": _CORRECTIONS}.get(kind)
    if table is None:
        raise ValueError(f"`kind` must be 'objective' or 'correction', got {kind!r}.")
    return table


def names(kind: str = "objective") -> tuple[str, ...]:
    """Registered names of ``kind`` ("objective" or "correction"), sorted."""
    return tuple(sorted(_table(kind)))


def get(name: str) -> Callable:
    """The objective or correction registered as ``name`` (e.g. ``get("sat_gspo")``)."""
    fn = _OBJECTIVES.get(name) or _CORRECTIONS.get(name)
    if fn is None:
        raise KeyError(
            f"unknown loss {name!r}; objectives: {names('objective')}, "
            f"corrections: {names('correction')}."
        )
    return fn


def register(name: str, fn: Callable, kind: str = "objective", *, reference: str = "old") -> None:
    """Adds a user objective (same signature as the built-ins) or correction under ``name``.

    A correction takes ``(reference_logp, behavior_logp, mask, **hyper-parameters)``; ``reference``
    says whether its first input is the behaviour version's recomputation (``"old"``) or the
    current policy (``"current"``).
    """
    table = _table(kind)
    if name in _OBJECTIVES or name in _CORRECTIONS:
        raise ValueError(f"a loss named {name!r} is already registered.")
    if kind == "correction":
        if reference not in REFERENCES:
            raise ValueError(f"`reference` must be one of {REFERENCES}, got {reference!r}.")
        _REFERENCE[name] = reference
    table[name] = fn


def hyperparameters(name: str) -> dict[str, Any]:
    """``{keyword: default}`` of the objective or correction ``name``.

    Objectives: their keyword-only arguments except the trainer's inputs (``aggregation``,
    ``token_weights``, ``axis_name``, ``kernel``). Corrections: every argument after the three
    log-prob / mask inputs. A required argument (KPop's ``phi``) has the default
    ``inspect.Parameter.empty``.
    """
    fn = get(name)
    params = list(inspect.signature(fn).parameters.values())
    if name in _CORRECTIONS:
        return {p.name: p.default for p in params[3:]}
    return {
        p.name: p.default
        for p in params
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in _NOT_HYPERPARAMETERS
    }


def takes_staleness(name: str) -> bool:
    """Whether objective ``name`` takes ``staleness=`` (``[B, T]`` versions behind), which the
    trainer then fills from the batch's per-token versions."""
    return "staleness" in inspect.signature(get(name)).parameters


def correction_reference(name: str) -> str:
    """``"old"`` or ``"current"``: which trainer log-prob correction ``name`` compares."""
    if name not in _CORRECTIONS:
        raise KeyError(f"unknown correction {name!r}; corrections: {names('correction')}.")
    return _REFERENCE.get(name, "old")


def correction_weights(name: str, *, logp, old_logp, behavior_logp, mask, **hparams) -> jax.Array:
    """Token weights of correction ``name`` under the one signature all corrections share.

    ``logp`` is the current policy's log-prob, ``old_logp`` the trainer's recomputation of the
    behaviour version (``None`` when the correction compares with the current policy),
    ``behavior_logp`` the rollout engine's.
    """
    first = old_logp if correction_reference(name) == "old" else logp
    if first is None:
        raise ValueError(
            f"correction {name!r} needs `old_logp` (the behaviour version's recomputed log-probs)"
        )
    return get(name)(first, behavior_logp, mask, **hparams)


def check(name: str, hparams: dict[str, Any], *, aggregation: str = "token-mean") -> None:
    """Runs objective or correction ``name`` with ``hparams`` on tiny abstract inputs.

    Uses ``jax.eval_shape``: the loss's own Python checks run (and raise ``ValueError`` /
    ``TypeError`` naming the argument) while nothing is compiled or computed.
    """
    logp = jax.ShapeDtypeStruct((1, 2), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, 2), jnp.bool_)
    if name in _CORRECTIONS:
        fn = get(name)
        jax.eval_shape(lambda a, b, m: fn(a, b, m, **hparams), logp, logp, mask)
        return
    fn = get(name)
    adv = jax.ShapeDtypeStruct((1,), jnp.float32)
    extra = {}
    if takes_staleness(name):
        extra["staleness"] = jax.ShapeDtypeStruct((1, 2), jnp.int32)
    jax.eval_shape(
        lambda a, b, c, m, x: fn(a, b, c, m, aggregation=aggregation, **x, **hparams),
        logp,
        logp,
        adv,
        mask,
        extra,
    )
