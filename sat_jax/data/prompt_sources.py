"""Prompt sources: random-access sequences of examples with a reward.

Every source is a `PromptSource`: ``len(source)``, ``source[i]`` (a dict with at least
``"prompt"`` and ``"answer"`` as str, plus ``"index"`` = i) and ``source.reward(completion,
example)``. Iterating a source yields its examples in order. Four kinds:

* `TaskSource`: one split of a built-in `Task` (exact-match reward of the task).
* `JsonlSource`: a JSONL file of ``{"prompt": ..., "answer": ...}`` records.
* `TfdsSource`: a TFDS dataset stored as ``array_record``, read without TensorFlow through
  ``tfds.data_source``. tensorflow-datasets is imported only when one is built.
* `ReasoningGymSource` (``sat_jax.data.reasoning_gym_source``): one split of reasoning-gym
  generators, scored by each generator's own scorer.

File and TFDS sources score with `math_reward_fn` (marked answers only: numbers exactly,
anything else by math-verify) unless given a ``reward_fn``.

`check_prompts` encodes every prompt of any source as the rollout engine will and raises one
error naming the row when one does not fit the prompt slots or the tokenizer, so bad data stops
a run when its source is built rather than at the step that first draws the row.
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from sat_jax.data.math_verify import math_reward_fn
from sat_jax.data.tasks import Example, Task, task_from_config

RewardFn = Callable[[str, Example], float]


class PromptSource(abc.ABC):
    """A finite, random-access sequence of examples plus the reward that scores them."""

    name: str

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of examples."""

    @abc.abstractmethod
    def _get(self, index: int) -> Example:
        """Example ``index`` (0 <= index < len), without the ``"index"`` key."""

    @abc.abstractmethod
    def reward(self, completion: str, example: Example) -> float:
        """Reward of ``completion`` (decoded text) for ``example``, in [0, 1]."""

    def __getitem__(self, index: int) -> Example:
        index = int(index)
        size = len(self)
        if not -size <= index < size:
            raise IndexError(f"index {index} out of range for source {self.name!r} of size {size}")
        index %= size
        return dict(self._get(index), index=index)

    def __iter__(self) -> Iterator[Example]:
        for i in range(len(self)):
            yield self[i]

    def where(self, index: int) -> str:
        """Where example ``index`` comes from, for error messages (a file source: file:line)."""
        return f"row {index} of {self.name!r}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, size={len(self)})"


class TaskSource(PromptSource):
    """One split (``"train"`` or ``"eval"``) of a built-in task."""

    def __init__(self, task: Task, split: str = "train"):
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        self.task = task
        self.split = split
        self._examples = task.train if split == "train" else task.eval
        self.name = f"{task.name}/{split}"

    def __len__(self) -> int:
        return len(self._examples)

    def _get(self, index: int) -> Example:
        return dict(self._examples[index])

    def reward(self, completion: str, example: Example) -> float:
        return self.task.reward(completion, example)


class ListSource(PromptSource):
    """In-memory examples (each a mapping with ``"prompt"`` and ``"answer"``)."""

    def __init__(
        self,
        examples: Sequence[Mapping[str, Any]],
        reward_fn: RewardFn | None = None,
        name: str = "list",
    ):
        if len(examples) == 0:
            raise ValueError("examples is empty; a source needs at least one example")
        self._examples = []
        for i, ex in enumerate(examples):
            for key in ("prompt", "answer"):
                if key not in ex:
                    raise ValueError(f"examples[{i}] has no {key!r} key: {dict(ex)!r}")
            self._examples.append(dict(ex, prompt=str(ex["prompt"]), answer=str(ex["answer"])))
        self.reward_fn = reward_fn or math_reward_fn
        self.name = name

    def __len__(self) -> int:
        return len(self._examples)

    def _get(self, index: int) -> Example:
        return dict(self._examples[index])

    def reward(self, completion: str, example: Example) -> float:
        return self.reward_fn(completion, example)


def _as_text(value: Any, what: str) -> str:
    """A record field as str: bytes decoded as UTF-8, numbers formatted, others rejected."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} must be a string or a number, got {type(value).__name__}")
    return str(value)


class JsonlSource(ListSource):
    """Examples from a JSON-lines file, one object per line; blank lines are skipped.

    Args:
      path: the ``.jsonl`` file.
      prompt_field, answer_field: keys of the prompt and the answer in each record; they become
        ``"prompt"`` and ``"answer"`` of the example (other keys are kept as they are).
      reward_fn: ``(completion, example) -> float``; default `math_reward_fn`.
      answer_fn: optional map of the raw answer string to the final answer (e.g. keep what
        follows ``####``).

    Raises:
      FileNotFoundError: the file does not exist.
      ValueError: an empty file, or a malformed line (the message names file and line number).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        reward_fn: RewardFn | None = None,
        answer_fn: Callable[[str], str] | None = None,
    ):
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"JSONL file {path!r} does not exist")
        self.path = path
        examples: list[Example] = []
        self._lines: list[int] = []
        # Read as bytes and decode line by line, so a bad byte is reported at its file:line
        # (a text-mode read fails with a byte offset into the whole file).
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(
                        f"{where}: not valid UTF-8 (byte {raw[e.start : e.start + 1]!r} at "
                        f"column {e.start + 1})"
                    ) from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: malformed JSON ({e.msg})") from None
                if not isinstance(record, dict):
                    raise ValueError(
                        f"{where}: expected a JSON object, got {type(record).__name__}"
                    )
                for field in (prompt_field, answer_field):
                    if field not in record:
                        raise ValueError(
                            f"{where}: missing field {field!r} (keys: {sorted(record)})"
                        )
                prompt = _as_text(record[prompt_field], f"{where}: field {prompt_field!r}")
                answer = _as_text(record[answer_field], f"{where}: field {answer_field!r}")
                if answer_fn is not None:
                    answer = answer_fn(answer)
                examples.append(dict(record, prompt=prompt, answer=answer))
                self._lines.append(lineno)
        if not examples:
            raise ValueError(f"JSONL file {path!r} contains no examples")
        super().__init__(examples, reward_fn, name=os.path.basename(path))

    def where(self, index: int) -> str:
        return f"{self.path}:{self._lines[index]}"


def _import_tfds():
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError(
            "TfdsSource needs tensorflow-datasets and array-record (TensorFlow is not needed): "
            "pip install tensorflow-datasets array-record (tested: 4.9.10 and 0.8.6)"
        ) from e
    return tfds


class TfdsSource(PromptSource):
    """A TFDS split in ``array_record`` format, read with ``tfds.data_source`` (no TensorFlow).

    Args:
      dataset: a registered dataset name (``"gsm8k"``, ``"my_ds:1.0.0"``) or a built
        ``tfds.core.DatasetBuilder``.
      split: e.g. ``"train"``, ``"test[:100]"``.
      data_dir: where the prepared dataset lives (default: TFDS's own).
      prompt_field, answer_field: record keys of prompt and answer (GSM8K: question / answer).
      reward_fn: default `math_reward_fn`.
      answer_fn: optional map of the raw answer string to the final answer.
      download: let TFDS download and prepare a missing dataset (needs network); default off.

    The dataset must already be prepared with ``file_format="array_record"``; tfrecord datasets
    do not support random access.
    """

    def __init__(
        self,
        dataset: Any,
        split: str = "train",
        data_dir: str | os.PathLike | None = None,
        prompt_field: str = "question",
        answer_field: str = "answer",
        reward_fn: RewardFn | None = None,
        answer_fn: Callable[[str], str] | None = None,
        download: bool = False,
    ):
        tfds = _import_tfds()
        if isinstance(dataset, str):
            self._data = tfds.data_source(
                dataset, split=split, data_dir=data_dir, download=download
            )
            self.name = f"{dataset}/{split}"
        elif hasattr(dataset, "as_data_source"):
            self._data = dataset.as_data_source(split=split)
            self.name = f"{dataset.name}/{split}"
        else:
            raise TypeError(
                f"dataset must be a TFDS name or a DatasetBuilder, got {type(dataset).__name__}"
            )
        if len(self._data) == 0:
            raise ValueError(f"TFDS split {self.name!r} contains no examples")
        self.prompt_field = prompt_field
        self.answer_field = answer_field
        self.reward_fn = reward_fn or math_reward_fn
        self.answer_fn = answer_fn

    def __len__(self) -> int:
        return len(self._data)

    def _get(self, index: int) -> Example:
        record = self._data[index]
        for field in (self.prompt_field, self.answer_field):
            if field not in record:
                raise ValueError(
                    f"{self.name} record {index}: missing field {field!r} (keys: {sorted(record)})"
                )
        # Only the prompt and the answer are decoded: other features (images, flags, binary
        # blobs) stay as TFDS returns them, so one of another kind cannot break every record.
        example = dict(record)
        where = f"{self.name} record {index}: field"
        example["prompt"] = _as_text(record[self.prompt_field], f"{where} {self.prompt_field!r}")
        answer = _as_text(record[self.answer_field], f"{where} {self.answer_field!r}")
        example["answer"] = self.answer_fn(answer) if self.answer_fn is not None else answer
        return example

    def reward(self, completion: str, example: Example) -> float:
        return self.reward_fn(completion, example)


def _where(source, index: int) -> str:
    where = getattr(source, "where", None)
    return where(index) if where is not None else f"row {index}"


def check_prompts(
    source: PromptSource | Sequence[Mapping[str, Any]],
    tokenizer: Any,
    max_prompt_len: int,
    *,
    prompt_format: Callable[[str], str] | None = None,
    max_answer_len: int | None = None,
    rows: int | None = None,
    chunk: int = 1024,
) -> int:
    """Checks that every prompt of ``source`` fits the tokenizer and ``max_prompt_len`` tokens.

    Each prompt is encoded as the rollout engine encodes it: ``prompt_format`` applied (a chat
    template, say), then ``tokenizer.batch_encode`` (with the character tokenizer, BOS
    included). Works for any `PromptSource` or sequence of example dicts.

    Args:
      source: the examples.
      tokenizer: ``batch_encode(texts, pad_to=None) -> (ids, lengths)`` (the sampler's layout).
      max_prompt_len: prompt slots of the sampler.
      prompt_format: maps a prompt to the text the policy reads.
      max_answer_len: if given, every supervised target plus EOS must also fit this many response
        slots (a warm-up's: the example's ``"target"`` if it has one, else its ``"answer"``, as
        `Task.supervised_pairs`; the tokenizer's ``batch_encode`` then takes ``add_bos`` /
        ``add_eos``, as `CharTokenizer`'s does).
      rows: check only the first ``rows`` examples (those an evaluation reads); default all.
      chunk: prompts encoded per call.

    Returns:
      The number of examples checked.

    Raises:
      ValueError: naming the row (``source.where``) and the text, for a prompt with a character
        the tokenizer cannot encode; naming how many prompts are too long and the longest one
        (row, text, token count), for prompts over ``max_prompt_len``; likewise for targets.
    """
    fmt = prompt_format or (lambda text: text)
    n = len(source) if rows is None else min(int(rows), len(source))
    # The rows without the "index" key and its copy: the check reads every row once.
    get = source._get if isinstance(source, PromptSource) else source.__getitem__
    checks = [("prompt", max_prompt_len, {})]
    if max_answer_len is not None:
        checks.append(("target", max_answer_len, {"add_eos": True}))
    too_long = {what: 0 for what, _, _ in checks}
    worst = {what: (0, -1, "") for what, _, _ in checks}  # (tokens, row, text): the longest
    for lo in range(0, n, chunk):
        examples = [get(i) for i in range(lo, min(lo + chunk, n))]
        for what, limit, extra in checks:
            texts = [
                fmt(ex["prompt"]) if what == "prompt" else ex.get("target", ex["answer"])
                for ex in examples
            ]
            try:
                _, lengths = _encode(tokenizer, texts, extra)
            except ValueError:
                for j, text in enumerate(texts):  # find the row that does not encode
                    try:
                        _encode(tokenizer, [text], extra)
                    except ValueError as e:
                        raise ValueError(f"{_where(source, lo + j)}: {what} {e}") from None
                raise
            over = np.flatnonzero(lengths > limit)
            too_long[what] += len(over)
            for j in over.tolist():
                if lengths[j] > worst[what][0]:
                    worst[what] = (int(lengths[j]), lo + j, texts[j])
    for what, limit, _ in checks:
        if too_long[what]:
            tokens, row, text = worst[what]
            slots = "prompt slots (max_prompt_len)" if what == "prompt" else "response slots"
            raise ValueError(
                f"{too_long[what]} of {n} {what}s take more than {limit} {slots}; the longest, "
                f"{_where(source, row)} ({text!r}), takes {tokens} tokens"
            )
    return n


def _encode(tokenizer, texts: list[str], extra: dict[str, Any]):
    if extra:  # targets: EOS appended, no BOS
        return tokenizer.batch_encode(texts, pad_to=None, add_bos=False, **extra)
    return tokenizer.batch_encode(texts, pad_to=None)


def build_sources(data) -> tuple[PromptSource, PromptSource, Task | None]:
    """(train source, held-out source, task or None) from a run's ``data`` settings
    (``config.data``: ``source`` and the fields that source reads)."""
    d = data
    if d.source == "task":
        task = task_from_config(d)
        return TaskSource(task, "train"), TaskSource(task, "eval"), task
    if d.source == "reasoning_gym":
        from sat_jax.data.reasoning_gym_source import reasoning_gym_sources

        return reasoning_gym_sources(d)
    if d.source == "jsonl":

        def jsonl(path):
            return JsonlSource(
                os.path.expanduser(path), prompt_field=d.prompt_field, answer_field=d.answer_field
            )

        src = jsonl(d.path)
        return src, jsonl(d.eval_path) if d.eval_path else src, None
    kwargs = dict(
        data_dir=d.tfds_data_dir or None, prompt_field=d.prompt_field, answer_field=d.answer_field
    )
    return (
        TfdsSource(d.tfds_name, split=d.split, **kwargs),
        TfdsSource(d.tfds_name, split=d.eval_split, **kwargs),
        None,
    )
