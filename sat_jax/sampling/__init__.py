"""Jitted rollout engine: KV-cache decoding with temperature / top-p / top-k, recording behavior
log-probs, routing (R3), support cut-offs (Eq. 50) and per-token parameter versions. Two engines
with one output type: the static batch (``Sampler``, the reference) and continuous batching
(``ContinuousSampler``: decode slots refilled as responses finish)."""

from sat_jax.sampling.continuous import ContinuousSampler, FinishedGroup, Session, concat_outputs
from sat_jax.sampling.sampler import (
    DecodeState,
    SampleOutput,
    Sampler,
    SamplingParams,
    sequence_keys,
)
from sat_jax.sampling.truncation import support_cutoff

__all__ = [
    "ContinuousSampler",
    "DecodeState",
    "FinishedGroup",
    "SampleOutput",
    "Sampler",
    "SamplingParams",
    "Session",
    "concat_outputs",
    "sequence_keys",
    "support_cutoff",
]
