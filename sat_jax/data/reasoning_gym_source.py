"""Prompts from reasoning-gym's procedural generators, scored by each generator's own scorer.

``pip install "sat-jax[tasks]"`` installs `reasoning-gym`. A run names one generator or a weighted
list (``"countdown"``, ``"chain_sum:2,number_sorting:1"``) and, per generator, the fields of its
config dataclass; `reasoning_gym_splits` builds two disjoint splits of stated sizes:

* **Seeded and deterministic.** Example ``i`` of a split picks its generator with a random stream
  keyed by ``(seed, split, i)`` and the weights, then draws generator item
  ``2 * (i * RETRIES + r) + split`` for ``r = 0, 1, ...`` (reasoning-gym items are themselves fixed
  by the generator's seed and index), so the two splits never read the same item and any example
  can be built alone, in any order.
* **Disjoint by content.** A question belongs to the held-out split iff a hash of its text falls
  in the held-out half; each split keeps the first draw whose question is its own. Two draws that
  happen to produce the same question therefore land in the same split: no held-out question is
  ever a training question, however small the generator's space.
* **Reward: the generator's scorer, binarised.** The answer is what the completion marks
  (``answer_format="tags"``: the last ``<answer>...</answer>``, as reasoning-gym's prompts ask;
  ``"plain"``: the whole completion, for tiny policies that write the answer alone). The score of
  ``generator.score_answer(answer, entry)`` counts 1 only when it is full (1.0), else 0; with
  ``partial_credit=True`` the score itself (clipped to [0, 1]). Scoring runs in
  `sat_jax.data.grading.Grader`'s worker with a deadline (Countdown's scorer evaluates the
  expression it is given, so ``9**9**9**9`` would otherwise stall a rollout).

Prompts are the generator's question (plus, with ``"tags"``, one sentence asking for the tags);
``data.chat_template`` wraps them in the chat format as for every source. Examples are generated on
first access and kept.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Mapping
from typing import Any

from sat_jax.data.grading import Grader, default_grader
from sat_jax.data.prompt_sources import PromptSource
from sat_jax.data.tasks import Example, Task

ANSWER_FORMATS = ("tags", "plain")
TAGS_INSTRUCTION = "\nGive your final answer between <answer> and </answer>."
# Draws per example before a split gives up: each draw lands in its split with probability 1/2
# on a generator of more than a few questions.
RETRIES = 64


def _import_rg():
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(
            'data.source="reasoning_gym" needs reasoning-gym: pip install "sat-jax[tasks]"'
        ) from e
    return reasoning_gym


def parse_datasets(spec: str) -> list[tuple[str, float]]:
    """``"name"`` or ``"name:weight,name:weight"`` (a missing weight is 1) as (name, weight)s."""
    out: list[tuple[str, float]] = []
    for part in str(spec).split(","):
        name, _, weight = part.strip().partition(":")
        name = name.strip()
        try:
            w = float(weight) if weight.strip() else 1.0
        except ValueError:
            w = float("nan")
        if not name or not w > 0 or w == float("inf"):
            raise ValueError(
                f"data.rg.datasets={spec!r}: each entry must be NAME or NAME:WEIGHT with a "
                f"positive weight, got {part.strip()!r}"
            )
        if name in (n for n, _ in out):
            raise ValueError(f"data.rg.datasets={spec!r} names {name!r} twice")
        out.append((name, w))
    return out


def check_reasoning_gym(
    datasets: str,
    configs: Mapping[str, Mapping[str, Any]] | None,
    train_size: int,
    eval_size: int,
    answer_format: str = "tags",
) -> list[tuple[str, float, dict[str, Any]]]:
    """Checks a reasoning-gym source's arguments; returns (name, weight, generator config)s.

    Raises:
      ImportError: reasoning-gym is not installed.
      ValueError: one message naming the field and the value: an unknown generator (with the
        known names), a config for a generator not in the list, an unknown config field, a
        ``seed`` or ``size`` field (the source sets them), a config the generator's own check
        rejects, a split size < 1 or an unknown answer format.
    """
    for what, size in (("data.rg.train_size", train_size), ("data.eval_size", eval_size)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{what} must be an int >= 1, got {size!r}")
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(
            f"data.rg.answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}"
        )
    rg = _import_rg()
    from reasoning_gym.factory import DATASETS

    entries = parse_datasets(datasets)
    configs = {k: dict(v) for k, v in (configs or {}).items()}
    names = [n for n, _ in entries]
    for name in configs:
        if name not in names:
            raise ValueError(
                f"data.rg.config.{name} configures a generator not in data.rg.datasets={datasets!r}"
            )
    out = []
    for name, weight in entries:
        if name not in DATASETS:
            raise ValueError(
                f"data.rg.datasets: unknown reasoning-gym generator {name!r}; known: "
                f"{', '.join(sorted(DATASETS))}"
            )
        fields = {f.name for f in dataclasses.fields(DATASETS[name][1])}
        config = configs.get(name, {})
        for key in config:
            if key in ("seed", "size"):
                raise ValueError(
                    f"data.rg.config.{name}.{key} is set by the source (data.rg.seed and the "
                    "split sizes); remove it"
                )
            if key not in fields:
                raise ValueError(
                    f"data.rg.config.{name}.{key}: not a field of {name}'s config; fields: "
                    f"{', '.join(sorted(fields - {'seed', 'size'}))}"
                )
        try:
            rg.create_dataset(name, seed=0, size=1, **config)
        except (AssertionError, ValueError, TypeError) as e:
            raise ValueError(
                f"data.rg.config.{name}={config!r} is rejected by {name}: {e}"
            ) from None
        out.append((name, weight, config))
    return out


def _held_out(question: str) -> int:
    """1 if ``question`` belongs to the held-out split, else 0 (a fixed hash of its text)."""
    return hashlib.blake2b(question.encode("utf-8"), digest_size=1).digest()[0] & 1


class _Generators:
    """The generators of one run, shared by its two splits."""

    def __init__(self, entries, seed: int, max_size: int, answer_format: str):
        rg = _import_rg()
        self.names = [n for n, _, _ in entries]
        self.weights = [w for _, w, _ in entries]
        self.configs = {n: c for n, _, c in entries}
        self.seed = int(seed)
        self.answer_format = answer_format
        # Items are indexed up to 2 * max_size * RETRIES; some generators precompute per index.
        size = 2 * max_size * RETRIES + 2
        self.datasets = {
            n: rg.create_dataset(n, seed=self.seed, size=size, **c) for n, _, c in entries
        }

    def example(self, split: int, i: int) -> Example:
        pick = random.Random(f"{self.seed}:{split}:{i}")
        name = pick.choices(self.names, weights=self.weights)[0]
        dataset = self.datasets[name]
        for r in range(RETRIES):
            entry = dataset[2 * (i * RETRIES + r) + split]
            if _held_out(entry["question"]) == split:
                break
        else:
            raise ValueError(
                f"reasoning-gym generator {name!r} (config {self.configs[name]!r}) drew no "
                f"question for the {('train', 'held-out')[split]} split in {RETRIES} tries: its "
                "space is too small for two disjoint splits; widen its config"
            )
        answer = str(entry["answer"])
        tags = self.answer_format == "tags"
        return {
            "prompt": entry["question"] + (TAGS_INSTRUCTION if tags else ""),
            "answer": answer,
            "target": f"<answer>{answer}</answer>" if tags else answer,
            "dataset": name,
            "entry": entry,
        }


class ReasoningGymSource(PromptSource):
    """One split of a reasoning-gym run (build both with `reasoning_gym_splits`)."""

    def __init__(
        self,
        generators: _Generators,
        split: str,
        size: int,
        *,
        partial_credit: bool = False,
        grader: Grader | None = None,
    ):
        self._gen = generators
        self._split = ("train", "eval").index(split)
        self._size = int(size)
        self._cache: dict[int, Example] = {}
        self.partial_credit = bool(partial_credit)
        self.grader = grader
        self.name = f"reasoning_gym:{'+'.join(generators.names)}/{split}"

    def __len__(self) -> int:
        return self._size

    def _get(self, index: int) -> Example:
        if index not in self._cache:
            self._cache[index] = self._gen.example(self._split, index)
        return dict(self._cache[index])

    def answer(self, completion: str) -> str | None:
        """The answer ``completion`` marks in this source's format, or None."""
        if self._gen.answer_format == "plain":
            return completion.strip()
        from reasoning_gym.utils import extract_answer

        return extract_answer(completion)

    def reward(self, completion: str, example: Example) -> float:
        answer = self.answer(completion)
        grader = self.grader or default_grader()
        if not answer or not grader.fits(answer):
            return 0.0
        name = example["dataset"]
        ok, score = grader.call(
            "reasoning_gym", name, self._gen.configs[name], answer, example["entry"]
        )
        if not ok:
            return 0.0
        score = min(max(float(score), 0.0), 1.0)
        return score if self.partial_credit else float(score >= 1.0)


class ReasoningGymTask(Task):
    """The two splits as a `Task`, so that the supervised warm-up can read a tiny policy's
    targets from them (``"target"``: the answer in the source's format)."""

    def __init__(self, train: ReasoningGymSource, eval: ReasoningGymSource):
        self.train, self.eval = train, eval
        self.name = train.name.rsplit("/", 1)[0]

    def reward(self, completion: str, example: Example) -> float:
        return self.train.reward(completion, example)

    def corrupt(self, target: str, rng) -> str:
        """``target`` with the digits of its answer redrawn (a wrong answer in the same format),
        conditioned on differing from the original."""
        digits = [k for k, ch in enumerate(target) if ch.isdigit()]
        if not digits:
            raise ValueError(
                f"target {target!r} has no digits to corrupt (set sft.corrupt_share=0)"
            )
        while True:
            chars = list(target)
            for k, d in zip(digits, rng.integers(0, 10, size=len(digits)), strict=True):
                chars[k] = str(d)
            wrong = "".join(chars)
            if wrong != target:
                return wrong

    @property
    def max_prompt_chars(self) -> int:
        return max(len(ex["prompt"]) for ex in (*self.train, *self.eval))

    @property
    def max_target_chars(self) -> int:
        return max(len(ex["target"]) for ex in (*self.train, *self.eval))


def reasoning_gym_splits(
    datasets: str,
    configs: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    train_size: int,
    eval_size: int,
    seed: int = 0,
    partial_credit: bool = False,
    answer_format: str = "tags",
    grader: Grader | None = None,
) -> tuple[ReasoningGymSource, ReasoningGymSource]:
    """(train, held-out) sources of ``train_size`` and ``eval_size`` examples; arguments are
    checked first by `check_reasoning_gym` (one clear error)."""
    entries = check_reasoning_gym(datasets, configs, train_size, eval_size, answer_format)
    gen = _Generators(entries, seed, max(train_size, eval_size), answer_format)
    kw = dict(partial_credit=partial_credit, grader=grader)
    return (
        ReasoningGymSource(gen, "train", train_size, **kw),
        ReasoningGymSource(gen, "eval", eval_size, **kw),
    )


def check_data_config(data_config) -> None:
    """`check_reasoning_gym` on a run's ``data`` config (what the config validation calls)."""
    rg = data_config.rg
    config = rg.config.to_dict() if hasattr(rg.config, "to_dict") else rg.config
    check_reasoning_gym(rg.datasets, config, rg.train_size, data_config.eval_size, rg.answer_format)


def reasoning_gym_sources(data_config):
    """``build_sources``'s triple for ``data.source="reasoning_gym"`` from a run's ``data``
    config: (train source, held-out source, task). The task (the splits as a `Task`, whose
    targets a supervised warm-up reads) is given with the character tokenizer only, the one
    the warm-up encodes with; otherwise it is None and no warm-up runs."""
    rg = data_config.rg
    train, held_out = reasoning_gym_splits(
        rg.datasets,
        rg.config.to_dict() if hasattr(rg.config, "to_dict") else rg.config,
        train_size=rg.train_size,
        eval_size=data_config.eval_size,
        seed=rg.seed,
        partial_credit=rg.partial_credit,
        answer_format=rg.answer_format,
    )
    task = ReasoningGymTask(train, held_out) if data_config.tokenizer == "char" else None
    return train, held_out, task


__all__ = [
    "ReasoningGymSource",
    "ReasoningGymTask",
    "check_data_config",
    "check_reasoning_gym",
    "parse_datasets",
    "reasoning_gym_sources",
    "reasoning_gym_splits",
]
