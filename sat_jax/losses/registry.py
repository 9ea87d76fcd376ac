"""Objectives and corrections by name, so that a config string selects them."""

from __future__ import annotations

from collections.abc import Callable

from sat_jax.losses import corrections, objectives

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
}
_CORRECTIONS: dict[str, Callable] = {
    "tis": corrections.tis,
    "icepop": corrections.icepop,
    "kpop": corrections.kpop,
}


def names(kind: str = "objective") -> tuple[str, ...]:
    """Registered names of ``kind`` ("objective" or "correction"), sorted."""
    table = {"objective": _OBJECTIVES, "correction": _CORRECTIONS}.get(kind)
    if table is None:
        raise ValueError(f"`kind` must be 'objective' or 'correction', got {kind!r}.")
    return tuple(sorted(table))


def get(name: str) -> Callable:
    """The objective or correction registered as ``name`` (e.g. ``get("sat_gspo")``)."""
    fn = _OBJECTIVES.get(name) or _CORRECTIONS.get(name)
    if fn is None:
        raise KeyError(
            f"unknown loss {name!r}; objectives: {names('objective')}, "
            f"corrections: {names('correction')}."
        )
    return fn


def register(name: str, fn: Callable, kind: str = "objective") -> None:
    """Adds a user objective (same signature as the built-ins) or correction under ``name``."""
    table = {"objective": _OBJECTIVES, "correction": _CORRECTIONS}.get(kind)
    if table is None:
        raise ValueError(f"`kind` must be 'objective' or 'correction', got {kind!r}.")
    if name in _OBJECTIVES or name in _CORRECTIONS:
        raise ValueError(f"a loss named {name!r} is already registered.")
    table[name] = fn
