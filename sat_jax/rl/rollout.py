"""Rollouts: prompts → G samples each from a parameter snapshot → rewards → group advantages.

The result is a host-side (NumPy) :class:`sat_jax.rl.batch.RolloutBatch`: the sampler's
``tokens`` [B, P + N], ``input_mask``, per-response-token ``response_mask``, ``behavior_logp``,
``cutoffs`` and ``versions`` [B, N], ``routing`` [L, B, P + N − 1, k], plus ``advantages`` [B] and
``rewards`` [B] (B = prompts × G, the G samples of a prompt contiguous).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sat_jax import advantages as advantage_lib
from sat_jax.data import decode_response
from sat_jax.data import evaluate as evaluate_generations
from sat_jax.rl.batch import RolloutBatch
from sat_jax.sampling import (
    ContinuousSampler,
    DecodeState,
    SampleOutput,
    Sampler,
    SamplingParams,
    sequence_keys,
)

Example = dict[str, Any]

_log = logging.getLogger(__name__)

#: How evaluation and ``sampled``-lag rollouts are laid out in decode calls: ``"merged"`` (rows
#: from many training-shaped batches in large calls of one compiled shape; the behaviour
#: versions of a batch in one ``vmap``'d call) or ``"per_call"`` (one call per training-shaped
#: batch and per version). Both draw every row with the same key, so they sample the same
#: tokens up to float rounding; ``per_call`` is the reference that the equality test and
#: ``benchmarks/study_run.py`` run beside ``merged``.
DECODE_LAYOUT = "merged"
#: How a ``sampled``-lag batch's behaviour versions are decoded: ``"per_version"`` (one call per
#: version, its groups padded to a power of two) or ``"vmapped"`` (one ``vmap``'d call on an
#: engine that ``merges_rows``: every version's groups padded to the largest and the version axis
#: to a power of two). Both draw every row with the same key. ``per_version`` decodes fewer
#: rows; on a CPU the padding makes ``vmapped`` slower (``benchmarks/study_run.py``).
VERSIONS_LAYOUT = "per_version"
#: Rows per merged evaluation call (rounded down to whole groups; one compiled shape).
EVAL_ROWS_PER_CALL = 1024


@dataclasses.dataclass
class RolloutEngine:
    """Turns prompt examples into scored, grouped training batches with one rollout engine.

    Args:
      sampler: the rollout engine, static (``Sampler``) or continuous (``ContinuousSampler``,
        built for ``group_size``); its dtype may differ from the trainer's.
      tokenizer: ``batch_encode(texts, pad_to) -> (ids, lengths)`` and ``decode(ids) -> str``.
      reward_fn: ``(completion, example) -> float``.
      group_size: G samples per prompt.
      sampling: temperature / top-p / top-k.
      advantage: ``"grpo"``, ``"dr_grpo"`` or ``"rloo"`` (``sat_jax.advantages``).
      prompt_format: maps a prompt to the text the policy reads (e.g. a chat template).
    """

    sampler: Sampler | ContinuousSampler
    tokenizer: Any
    reward_fn: Callable[[str, Example], float]
    group_size: int
    sampling: SamplingParams
    advantage: str = "grpo"
    prompt_format: Callable[[str], str] | None = None  # e.g. a chat template

    def encode(self, examples: Sequence[Example]) -> tuple[np.ndarray, np.ndarray]:
        fmt = self.prompt_format or (lambda text: text)
        texts = [fmt(ex["prompt"]) for ex in examples for _ in range(self.group_size)]
        return self.tokenizer.batch_encode(texts, pad_to=self.sampler.max_prompt_len)

    def start(self, params, examples: Sequence[Example], key: jax.Array) -> DecodeState:
        """The static engine's resumable decode state of ``examples`` (stream mode's chunks)."""
        ids, lengths = self.encode(examples)
        # The G copies of each prompt are prefilled once (Sampler.init(group_size=)).
        return self.sampler.init(
            params, ids, lengths, key, self.sampling, group_size=self.group_size
        )

    def generate(self, params, examples, key, version: int) -> SampleOutput:
        """G samples of every example with one parameter version, rows in example order."""
        ids, lengths = self.encode(examples)
        return self.sampler.generate(
            params, ids, lengths, key, self.sampling, version, group_size=self.group_size
        )

    @property
    def merges_rows(self) -> bool:
        """Whether the engine decodes rows with per-row keys and batches with their own
        parameters (``DECODE_LAYOUT == "merged"`` on the static engine without router noise)."""
        sampler = self.sampler
        return (
            DECODE_LAYOUT == "merged" and isinstance(sampler, Sampler) and not sampler.router_noise
        )

    @property
    def vmaps_versions(self) -> bool:
        """Whether a sampled-lag batch's versions are decoded in one ``vmap``'d call
        (``VERSIONS_LAYOUT == "vmapped"`` on an engine that ``merges_rows``)."""
        return VERSIONS_LAYOUT == "vmapped" and self.merges_rows

    def generate_versions(self, params, example_sets, keys, versions) -> list[SampleOutput]:
        """``generate(params[i], example_sets[i], keys[i], versions[i])`` for every i, as one
        decode (``Sampler.generate_versions``); the sets hold equally many examples."""
        ids, lengths = self.encode([ex for examples in example_sets for ex in examples])
        v = len(example_sets)
        out = self.sampler.generate_versions(
            params,
            ids.reshape(v, -1, ids.shape[-1]),
            lengths.reshape(v, -1),
            jnp.stack(keys),
            self.sampling,
            versions,
            group_size=self.group_size,
        )
        return [jax.tree.map(lambda a, i=i: a[i], out) for i in range(v)]

    def completions(self, out: SampleOutput) -> list[str | None]:
        """Each row's response text; None for a malformed one (`decode_response`)."""
        response = np.asarray(out.tokens)[:, self.sampler.max_prompt_len :]
        return [decode_response(self.tokenizer, row) for row in response]

    def reward(self, completion: str | None, example: Example) -> float:
        """``reward_fn``'s score, 0 for a malformed response: the one rule of rollouts and
        evaluation."""
        return 0.0 if completion is None else self.reward_fn(completion, example)

    def score(self, examples: Sequence[Example], out: SampleOutput) -> RolloutBatch:
        """Rewards, group advantages and the trainer's fields, all as NumPy arrays."""
        texts = self.completions(out)
        g = self.group_size
        rewards = np.array(
            [self.reward(texts[i], examples[i // g]) for i in range(len(texts))], np.float32
        )
        for i in np.flatnonzero(~np.isfinite(rewards)):
            # Its group's advantages are then non-finite too, and the trainer step skips the
            # update; the warning says which example and completion produced it.
            _log.warning(
                "non-finite reward %s for completion %r of example %r",
                rewards[i],
                texts[i],
                examples[i // g],
            )
        adv = np.asarray(advantage_lib.get(self.advantage)(rewards.reshape(-1, g))).reshape(-1)
        return RolloutBatch.from_sample(out, adv, rewards)


def batch_stats(batch: RolloutBatch, group_size: int) -> dict[str, float]:
    """Reward and length statistics of a scored batch, for logging.

    ``rollout/finished_row_share`` is the share of the batch's [rows × longest response] decode
    grid that lies after a row's EOS: the static engine decodes every row until the longest one
    ends, so it is that engine's decode work spent on rows that had already finished (the
    continuous engine refills those slots; for its batches it is what a static batch would have
    spent)."""
    rewards = np.asarray(batch.rewards)
    groups = rewards.reshape(-1, group_size)
    mask = np.asarray(batch.response_mask)
    lengths = mask.sum(axis=1)
    grid = lengths.size * int(lengths.max(initial=0))
    return {
        "rollout/finished_row_share": float(1.0 - lengths.sum() / grid) if grid else 0.0,
        "train/reward_mean": float(rewards.mean()),
        "train/reward_std": float(rewards.std()),
        "train/solved_groups": float((groups.max(axis=1) > 0.5).mean()),
        "train/zero_variance_groups": float((groups.std(axis=1) == 0).mean()),
        "train/response_len": float(mask.sum(axis=1).mean()),
        "train/tokens": float(mask.sum()),
        "train/nonfinite_rewards": float((~np.isfinite(rewards)).sum()),
    }


def evaluate(
    engine: RolloutEngine,
    params,
    examples: Sequence[Example],
    prompts_per_batch: int,
    key,
    version: int = 0,
) -> dict[str, float]:
    """pass@1, avg@G and unbiased pass@G on held-out prompts (G = the engine's group size), and
    pass@1 per difficulty level (``pass@1/LEVEL``) when the examples carry one.

    Scoring and metrics are ``sat_jax.data.evaluate``'s; this supplies the completions. The
    prompts are taken in batches of the training shape (``prompts_per_batch`` × G rows), batch c
    keyed ``fold_in(key, c)`` and its rows numbered from 0 (``sat_jax.sampling.token_keys``); the
    last batch is padded with repeats whose completions are discarded. On an engine that
    ``merges_rows`` the rows of all batches are decoded in calls of ``EVAL_ROWS_PER_CALL`` rows
    (prompts of similar length together, so a call stops when its longest response ends), each
    row with its own batch's key: the same samples, in fewer and larger calls. For 0/1 rewards
    pass@1 and avg@G are the same number (the mean reward).
    """
    g = engine.group_size
    if engine.merges_rows:
        texts = _merged_completions(engine, params, examples, prompts_per_batch, key, version)
        generate, batch_size = (lambda prompts: texts), len(examples)
    else:
        calls = itertools.count()

        def generate(prompts: list[str]) -> list[list[str | None]]:
            batch = [{"prompt": p} for p in prompts]
            real = len(batch)
            batch += [batch[-1]] * (prompts_per_batch - real)
            out = engine.generate(params, batch, jax.random.fold_in(key, next(calls)), version)
            texts = engine.completions(out)
            return [texts[i * g : (i + 1) * g] for i in range(real)]

        batch_size = prompts_per_batch
    res = evaluate_generations(
        generate, examples, g, batch_size=batch_size, reward_fn=engine.reward
    )
    keep = ("pass@1", f"avg@{g}", f"pass@{g}")
    return {name: float(v) for name, v in res.items() if name in keep or name.startswith("pass@1/")}


def _merged_completions(
    engine: RolloutEngine, params, examples, prompts_per_batch: int, key, version: int
) -> list[list[str]]:
    """The G completions of every example, in example order, decoded in large calls with the keys
    of the training-shaped batches (``evaluate``)."""
    g, n = engine.group_size, len(examples)
    ids, lengths = engine.encode(examples)
    prompt = np.arange(n)
    # Prompt p is group p % prompts_per_batch of batch p // prompts_per_batch.
    batch_keys = sequence_keys(key, np.repeat(prompt // prompts_per_batch, g))
    row_ids = (prompt % prompts_per_batch)[:, None] * g + np.arange(g)[None, :]
    keys = sequence_keys(batch_keys, row_ids.ravel())
    per_call = max(1, min(EVAL_ROWS_PER_CALL // g, n))
    order = np.argsort(lengths[::g], kind="stable")
    texts: list[list[str]] = [[] for _ in range(n)]
    for start in range(0, n, per_call):
        chosen = order[start : start + per_call]
        # Padded with repeats of the last prompt (discarded): one compiled shape for every call.
        chosen = np.concatenate([chosen, np.repeat(chosen[-1:], per_call - len(chosen))])
        rows = (chosen[:, None] * g + np.arange(g)[None, :]).ravel()
        out = engine.sampler.generate(
            params,
            ids[rows],
            lengths[rows],
            keys[rows],
            engine.sampling,
            version,
            group_size=g,
        )
        done = engine.completions(out)
        for i, p in enumerate(chosen[: min(per_call, n - start)]):
            texts[p] = done[i * g : (i + 1) * g]
    return texts
