"""Prompt sources: random-access sequences of examples with a reward.

Every source is a `PromptSource`: ``len(source)``, ``source[i]`` (a dict with at least
``"prompt"`` and ``"answer"`` as str, plus ``"index"`` = i) and ``source.reward(completion,
example)``. Iterating a source yields its examples in order. Three kinds:

* `TaskSource`: one split of a built-in `Task` (exact-match reward of the task).
* `JsonlSource`: a JSONL file of ``{"prompt": ..., "answer": ...}`` records.
* `TfdsSource`: a TFDS dataset stored as ``array_record``, read without TensorFlow through
  ``tfds.data_source``. tensorflow-datasets is imported only when one is built.

File and TFDS sources score with `math_reward_fn` (numeric verification) unless given a
``reward_fn``.
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from sat_jax.data.math_verify import math_reward_fn
from sat_jax.data.tasks import Example, Task

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
        return value.decode("utf-8")
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
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
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
        if not examples:
            raise ValueError(f"JSONL file {path!r} contains no examples")
        super().__init__(examples, reward_fn, name=os.path.basename(path))


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
        example = {
            key: _as_text(value, f"{self.name} record {index}: field {key!r}")
            if isinstance(value, bytes | str | np.generic)
            else value
            for key, value in record.items()
        }
        example["prompt"] = _as_text(record[self.prompt_field], f"field {self.prompt_field!r}")
        answer = _as_text(record[self.answer_field], f"field {self.answer_field!r}")
        example["answer"] = self.answer_fn(answer) if self.answer_fn is not None else answer
        return example

    def reward(self, completion: str, example: Example) -> float:
        return self.reward_fn(completion, example)
