"""Jitted rollout engine: KV-cache decoding with temperature / top-p / top-k, recording behavior
log-probs, routing (R3), support cut-offs (Eq. 50) and per-token parameter versions."""

from sat_jax.sampling.sampler import DecodeState, SampleOutput, Sampler, SamplingParams
from sat_jax.sampling.truncation import support_cutoff

__all__ = ["DecodeState", "SampleOutput", "Sampler", "SamplingParams", "support_cutoff"]
