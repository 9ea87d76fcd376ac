"""Named base runs that configs and study grids start from.

``default``: the built-in default run (:func:`sat_jax.config.defaults.get_config`).

``stale``: The staleness testbed's base run: long multiplication with its working, a 4-block MoE of
64 experts (top-4, 3,389,824 parameters), a weak warm-up, GRPO at lag 1.

Why this shape: long responses (the ratio noise of a sequence grows with its length) and many
small experts (near-ties between the k-th and (k+1)-th router logit, so a bfloat16 engine flips
routing against the float32 trainer and R3 has something to remove). The warm-up (4000 steps
on clean traces, its learning rate cosine-decayed) stops at a weak base policy with reward to
gain: held-out pass@1 0.20 on seed 0 (docs/results/stale/README.md); ``data.mixture`` keeps
held-out pass@1 away from 0 and 1 so groups rarely score all-equal
(``benchmarks/routing.py`` measures the routing flip rate).

``stale_sort``: the same run on ``sort_digits`` (lists of 16, 24 and 32 digits), whose response
length is the list length, so length varies without the arithmetic. Its warm-up trains on
traces of which ``sft.corrupt_share`` have a wrong final answer.

Methods and lags come from the command line, e.g. ``--config.loss.objective=sat --config.lag=8``
or ``--config.data.task=sort_digits --config.data.mixture=16:1,32:1`` (each task's lengths must
fit ``data.max_prompt_len`` / ``data.max_new_tokens``, checked before any compute).
"""

from __future__ import annotations

import ml_collections

from sat_jax.config.defaults import get_config


def stale_base() -> ml_collections.ConfigDict:
    """The staleness testbed's base run (see the module docstring)."""
    c = get_config()
    c.name = "stale_base"
    c.loss.objective = "ppo"
    c.loss.r3 = False
    c.loss.correction = "none"
    c.lag = 1
    d = c.data
    d.task = "long_multiplication"
    d.mixture = "3x2:1,3x3:1,4x3:1"
    d.eval_size = 512
    d.max_prompt_len = 12  # "1234*567=" with BOS: 10; room for a 5x3 level
    d.max_new_tokens = 36  # 4x3's longest trace with EOS: 29; room for a 4x4 level (39 fails)
    m = c.model
    m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim = 128, 4, 4, 2, 32
    m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size = 64, 4, 32
    m.rope_theta = 1e6
    c.rollout.group_size = 8
    c.rollout.prompts_per_step = 8
    c.sft.steps = 4000
    c.sft.batch_size = 64
    c.sft.schedule = "cosine"
    c.sft.corrupt_share = 0.0
    c.optim.learning_rate = 1e-4
    c.eval.every = 50
    c.eval.num_prompts = 128
    return c


def stale_sort() -> ml_collections.ConfigDict:
    """:func:`stale_base` on digit sorting (see the module docstring)."""
    c = stale_base()
    c.name = "stale_sort"
    c.data.task = "sort_digits"
    c.data.mixture = "16:1,24:1,32:1"
    c.data.max_prompt_len = 34  # 32 digits, "=" and BOS
    c.data.max_new_tokens = 34  # 32 digits and EOS, one spare
    c.sft.steps = 600
    c.sft.schedule = "constant"
    c.sft.corrupt_share = 0.3
    return c


#: Preset name -> function returning a fresh config.
PRESETS = {"default": get_config, "stale": stale_base, "stale_sort": stale_sort}
