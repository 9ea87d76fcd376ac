"""Built-in tasks with a verifiable reward, small enough for a 1-5M parameter policy on a CPU.

A task owns two deterministic, disjoint splits of examples (``train`` for RL, ``eval`` held out),
an exact-match ``reward`` and ``supervised_pairs`` for a short supervised warm-up. An example is a
dict with at least ``"prompt"`` and ``"answer"`` (both str).

Arithmetic prompts look like ``"37+85="``; the expected completion is the answer digits followed
by EOS (``"122"``), so with the default tokenizer a 3-digit task needs 8 prompt tokens (BOS
included) and at most 5 response tokens (EOS included).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import numpy as np

Example = dict[str, Any]

# Enumerate the operand space outright below this size; above it, sample with rejection.
_ENUMERATE_LIMIT = 1 << 22


class Task(abc.ABC):
    """Interface of a task with a verifiable reward.

    Attributes:
      name: short identifier, e.g. ``"addition_2"``.
      train: sequence of training examples (random access, ``len`` defined).
      eval: held-out sequence of examples, disjoint from ``train``.
    """

    name: str
    train: Sequence[Example]
    eval: Sequence[Example]

    @abc.abstractmethod
    def reward(self, completion: str, example: Example) -> float:
        """1.0 if ``completion`` (decoded text, EOS already stripped) is correct, else 0.0."""

    def supervised_pairs(self, n: int, seed: int) -> list[tuple[str, str]]:
        """``n`` (prompt, target) pairs drawn from ``train`` for a supervised warm-up.

        The target is the answer text alone; the trainer appends EOS. Draws without replacement
        when ``n <= len(train)``, deterministic in ``seed``.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        rng = np.random.default_rng(seed)
        size = len(self.train)
        idx = rng.choice(size, size=n, replace=n > size)
        return [(self.train[int(i)]["prompt"], self.train[int(i)]["answer"]) for i in idx]


class _ArithmeticSplit(Sequence):
    """Lazy sequence of arithmetic examples built from operand arrays on access."""

    def __init__(self, a: np.ndarray, b: np.ndarray, op: str, split: str):
        self._a, self._b, self._op, self._split = a, b, op, split

    def __len__(self) -> int:
        return len(self._a)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {self._split} split of size {len(self)}")
        a, b = int(self._a[i]), int(self._b[i])
        answer = a + b if self._op == "+" else a * b
        return {"prompt": f"{a}{self._op}{b}=", "answer": str(answer), "a": a, "b": b}


def _sample_pairs(num_pairs: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` distinct indices in ``[0, num_pairs)``, in a seed-determined order."""
    if num_pairs <= _ENUMERATE_LIMIT:
        return rng.permutation(num_pairs)[:count]
    seen: set[int] = set()
    out: list[int] = []
    while len(out) < count:
        for x in rng.integers(0, num_pairs, size=count - len(out)).tolist():
            if x not in seen:
                seen.add(x)
                out.append(x)
    return np.asarray(out[:count], dtype=np.int64)


class ArithmeticTask(Task):
    """``a <op> b =`` with ``a, b`` uniform in ``[0, 10**num_digits)``; reward = exact answer.

    The operand pairs are drawn once, without replacement, from a seeded generator: the first
    ``eval_size`` form the held-out split, the next ``train_size`` the training split, so the two
    never share a prompt (``a+b`` and ``b+a`` are different prompts and may fall in different
    splits).

    Args:
      op: ``"+"`` or ``"*"``.
      num_digits: maximum digits per operand (1-7).
      train_size: training examples; None takes all remaining pairs, capped at 100_000.
      eval_size: held-out examples.
      seed: fixes both splits.
    """

    def __init__(
        self,
        op: str = "+",
        num_digits: int = 2,
        train_size: int | None = None,
        eval_size: int = 500,
        seed: int = 0,
    ):
        if op not in ("+", "*"):
            raise ValueError(f"op must be '+' or '*', got {op!r}")
        if not 1 <= num_digits <= 7:
            raise ValueError(f"num_digits must be in [1, 7], got {num_digits}")
        base = 10**num_digits
        num_pairs = base * base
        if eval_size < 1:
            raise ValueError(f"eval_size must be >= 1, got {eval_size}")
        if eval_size >= num_pairs:
            raise ValueError(
                f"eval_size={eval_size} leaves no training pairs: num_digits={num_digits} has "
                f"only {num_pairs} operand pairs"
            )
        if train_size is None:
            train_size = min(num_pairs - eval_size, 100_000)
        if train_size < 1:
            raise ValueError(f"train_size must be >= 1, got {train_size}")
        if train_size + eval_size > num_pairs:
            raise ValueError(
                f"train_size + eval_size = {train_size + eval_size} exceeds the {num_pairs} "
                f"operand pairs of num_digits={num_digits}"
            )
        self.op = op
        self.num_digits = num_digits
        self.seed = seed
        self.name = f"{'addition' if op == '+' else 'multiplication'}_{num_digits}"
        pairs = _sample_pairs(num_pairs, eval_size + train_size, np.random.default_rng(seed))
        a, b = np.divmod(pairs, base)
        self.eval = _ArithmeticSplit(a[:eval_size], b[:eval_size], op, "eval")
        self.train = _ArithmeticSplit(a[eval_size:], b[eval_size:], op, "train")

    @property
    def max_prompt_chars(self) -> int:
        """Longest prompt in characters (add 1 for BOS)."""
        return 2 * self.num_digits + 2

    @property
    def max_answer_chars(self) -> int:
        """Longest answer in characters (add 1 for EOS)."""
        return self.num_digits + 1 if self.op == "+" else 2 * self.num_digits

    def reward(self, completion: str, example: Example) -> float:
        """1.0 iff the completion, stripped of surrounding spaces, is exactly the answer digits.

        Exact string match (no leading zeros, no extra text) so the policy must learn to stop.
        """
        return float(completion.strip() == example["answer"])


class AdditionTask(ArithmeticTask):
    """Multi-digit addition, e.g. ``"37+85="`` -> ``"122"``. See `ArithmeticTask`."""

    def __init__(
        self,
        num_digits: int = 2,
        train_size: int | None = None,
        eval_size: int = 500,
        seed: int = 0,
    ):
        super().__init__("+", num_digits, train_size, eval_size, seed)


class MultiplicationTask(ArithmeticTask):
    """Multi-digit multiplication, e.g. ``"12*34="`` -> ``"408"``. See `ArithmeticTask`."""

    def __init__(
        self,
        num_digits: int = 2,
        train_size: int | None = None,
        eval_size: int = 500,
        seed: int = 0,
    ):
        super().__init__("*", num_digits, train_size, eval_size, seed)


TASKS = {"addition": AdditionTask, "multiplication": MultiplicationTask}


def make_task(name: str, **kwargs) -> Task:
    """Builds a built-in task by name (``"addition"`` or ``"multiplication"``)."""
    try:
        cls = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task name {name!r}; choose from {sorted(TASKS)}") from None
    return cls(**kwargs)
