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
import numpy as np

from sat_jax import advantages as advantage_lib
from sat_jax.data import decode_response
from sat_jax.data import evaluate as evaluate_generations
from sat_jax.rl.batch import RolloutBatch
from sat_jax.sampling import ContinuousSampler, DecodeState, SampleOutput, Sampler, SamplingParams

Example = dict[str, Any]

_log = logging.getLogger(__name__)


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

    Scoring and metrics are ``sat_jax.data.evaluate``'s; this supplies the generator. Batches keep
    the training shape (``prompts_per_batch`` × G), so evaluation reuses the compiled sampler; the
    last batch is padded with repeats whose completions are discarded. For 0/1 rewards pass@1 and
    avg@G are the same number (the mean reward).
    """
    g = engine.group_size
    calls = itertools.count()

    def generate(prompts: list[str]) -> list[list[str | None]]:
        batch = [{"prompt": p} for p in prompts]
        real = len(batch)
        batch += [batch[-1]] * (prompts_per_batch - real)
        out = engine.generate(params, batch, jax.random.fold_in(key, next(calls)), version)
        texts = engine.completions(out)
        return [texts[i * g : (i + 1) * g] for i in range(real)]

    res = evaluate_generations(
        generate, examples, g, batch_size=prompts_per_batch, reward_fn=engine.reward
    )
    keep = ("pass@1", f"avg@{g}", f"pass@{g}")
    return {name: float(v) for name, v in res.items() if name in keep or name.startswith("pass@1/")}
