"""sat_jax.losses: SAT and the baselines of "Stale but Stable" as pure, jittable JAX functions.

Depends on jax, numpy and chex only. Every objective takes log-prob arrays (not a model), returns a
:class:`LossOutput`, and is exact under data-parallel sharding when given ``axis_name``.
"""

from sat_jax.losses._base import AGGREGATIONS, LOG_RATIO_CLAMP, LossOutput, aggregate
from sat_jax.losses.corrections import geo_rs, icepop, kpop, opsm, seq_mis, tis
from sat_jax.losses.diagnostics import (
    clip_split,
    low_var_kl,
    mismatch_decomposition,
    mismatch_metrics,
    mismatch_shape,
)
from sat_jax.losses.objectives import (
    bernoulli_kl,
    dppo,
    drpo,
    gspo,
    gspo_token,
    hill_kernel,
    ppo,
    sat,
    sat_gspo,
    seqclip,
    spo,
    tis_pg,
)
from sat_jax.losses.quantile import quantile
from sat_jax.losses.registry import get, names, register
from sat_jax.losses.stabilizers import (
    age_clip,
    age_clip_gspo,
    bapo,
    bapo_gspo,
    cispo,
    decoupled_ppo,
    m2po,
    m2po_gspo,
    sapo,
)

__all__ = [
    "AGGREGATIONS",
    "LOG_RATIO_CLAMP",
    "LossOutput",
    "age_clip",
    "age_clip_gspo",
    "aggregate",
    "bapo",
    "bapo_gspo",
    "bernoulli_kl",
    "cispo",
    "decoupled_ppo",
    "clip_split",
    "dppo",
    "drpo",
    "geo_rs",
    "get",
    "gspo",
    "gspo_token",
    "hill_kernel",
    "icepop",
    "kpop",
    "low_var_kl",
    "m2po",
    "m2po_gspo",
    "mismatch_decomposition",
    "mismatch_metrics",
    "mismatch_shape",
    "names",
    "opsm",
    "ppo",
    "quantile",
    "register",
    "sapo",
    "sat",
    "sat_gspo",
    "seq_mis",
    "seqclip",
    "spo",
    "tis",
    "tis_pg",
]
