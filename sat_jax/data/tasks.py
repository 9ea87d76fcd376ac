"""Built-in tasks with a verifiable reward, small enough for a 1-5M parameter policy on a CPU.

A task owns two deterministic, disjoint splits of examples (``train`` for RL, ``eval`` held out),
an exact ``reward`` and ``supervised_pairs`` for a short supervised warm-up. An example is a
dict with at least ``"prompt"`` and ``"answer"`` (both str); a task whose response shows its
working also stores the whole supervised response as ``"target"``.

Arithmetic prompts look like ``"37+85="``; the expected completion is the answer digits followed
by EOS (``"122"``), so with the default tokenizer a 3-digit task needs 8 prompt tokens (BOS
included) and at most 5 response tokens (EOS included).

Long-response tasks (responses of tens of tokens, where token-level ratio noise accumulates over
a sequence) draw each example from a difficulty *mixture* of levels with weights:

* `LongMultiplicationTask`: ``"1234*567="`` -> ``"8638+74040+617000=699678"``, the partial
  products written out before their sum (levels ``"AxB"``: operand digit counts); as
  ``long_multiplication_lsb`` every number of the response least significant digit first;
* `SortDigitsTask`: ``"5914="`` -> ``"1459"`` (levels ``"N"``: list lengths), so that response
  length varies on its own, without the arithmetic.

A mixture is written ``"LEVEL:WEIGHT,LEVEL:WEIGHT,..."`` (``"3x3:2,4x3:1"``; a missing weight is
1). Each level gets a fixed share of each split (largest remainder of ``size * weight / total``),
so the level counts are exact, not sampled. The held-out split is ordered so that every prefix
(an evaluation on ``eval.num_prompts`` < ``eval_size`` prompts) holds each level within one
example of its share.
"""

from __future__ import annotations

import abc
import functools
import math
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
        """1.0 if ``completion`` (decoded text, EOS already stripped) is correct, else 0.0.

        A sampled response with a PAD, BOS or unknown id before its EOS never reaches a task's
        reward: it scores 0 (`sat_jax.data.decode_response`).
        """

    @property
    @abc.abstractmethod
    def max_prompt_chars(self) -> int:
        """Longest prompt in characters (add 1 for BOS)."""

    @property
    @abc.abstractmethod
    def max_target_chars(self) -> int:
        """Longest supervised response in characters (add 1 for EOS)."""

    def supervised_pairs(self, n: int, seed: int) -> list[tuple[str, str]]:
        """``n`` (prompt, target) pairs drawn from ``train`` for a supervised warm-up.

        The target is the example's ``"target"`` (the response with its working) if it has one,
        else its ``"answer"``; the trainer appends EOS. Draws without replacement when
        ``n <= len(train)``, deterministic in ``seed``.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        rng = np.random.default_rng(seed)
        size = len(self.train)
        idx = rng.choice(size, size=n, replace=n > size)
        out = []
        for i in idx:
            ex = self.train[int(i)]
            out.append((ex["prompt"], ex.get("target", ex["answer"])))
        return out

    def corrupt(self, target: str, rng: np.random.Generator) -> str:
        """``target`` with its final answer wrong: the digits after the last ``"="`` (all of
        ``target`` if it has none) redrawn uniformly, conditioned on differing from the original.

        The working before the answer is kept, so a corrupted trace stays well formed and scores
        0 under `reward` (a warm-up on a stated share of them gives a weak base policy).
        """
        cut = target.rfind("=") + 1
        answer = target[cut:]
        if not answer.isdigit():
            raise ValueError(f"target {target!r} has no digits after its last '=' to corrupt")
        while True:
            wrong = "".join(str(d) for d in rng.integers(0, 10, size=len(answer)))
            if wrong != answer:
                return target[:cut] + wrong


class _LazySplit(Sequence):
    """A split whose examples are built on access: ``_example(i)`` for 0 <= i < ``_size``."""

    _split: str
    _size: int

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {self._split} split of size {len(self)}")
        return self._example(i)

    @abc.abstractmethod
    def _example(self, i: int) -> Example: ...


class _ArithmeticSplit(_LazySplit):
    """Lazy sequence of arithmetic examples built from operand arrays on access."""

    def __init__(self, a: np.ndarray, b: np.ndarray, op: str, split: str):
        self._a, self._b, self._op, self._split = a, b, op, split
        self._size = len(a)

    def _example(self, i: int) -> Example:
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

    @property
    def max_target_chars(self) -> int:
        """The answer is the whole response."""
        return self.max_answer_chars

    def reward(self, completion: str, example: Example) -> float:
        """1.0 iff the completion is exactly the answer in ASCII decimal digits.

        Exact string match: no leading zeros, spaces or other text (so the policy must learn to
        stop), and no other script's digits.
        """
        return float(completion == example["answer"])


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


Level = tuple[int, ...]


def parse_mixture(spec: str, parts: int) -> tuple[tuple[Level, float], ...]:
    """``"3x3:2,4x3:1"`` -> ``(((3, 3), 2.0), ((4, 3), 1.0))``: levels of ``parts`` positive
    counts joined by ``"x"``, each with a weight > 0 after ``":"`` (1 when omitted).

    Raises:
      ValueError: an empty spec, a malformed or repeated level, or a weight that is not > 0.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"mixture must be a non-empty string like '3x3:2,4x3:1', got {spec!r}")
    out: list[tuple[Level, float]] = []
    for entry in spec.split(","):
        level_text, _, weight_text = entry.strip().partition(":")
        fields = level_text.split("x")
        if len(fields) != parts or not all(f.isdigit() and int(f) > 0 for f in fields):
            shape = "x".join(["N"] * parts)
            raise ValueError(
                f"mixture entry {entry.strip()!r} of {spec!r}: the level must be {shape} "
                "with positive integers"
            )
        try:
            weight = float(weight_text) if weight_text else 1.0
        except ValueError:
            weight = float("nan")
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"mixture entry {entry.strip()!r} of {spec!r}: weight must be > 0")
        level = tuple(int(f) for f in fields)
        if any(level == seen for seen, _ in out):
            raise ValueError(f"mixture {spec!r} repeats level {level_text!r}")
        out.append((level, weight))
    return tuple(out)


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """Integer counts summing to ``total`` in proportion to ``weights`` (largest remainder;
    ties go to the earlier level)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = total * w / w.sum()
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: total - int(counts.sum())]] += 1
    return [int(c) for c in counts]


def _stratified_order(levels: np.ndarray, num_levels: int) -> np.ndarray:
    """An order of ``levels`` (shuffled level ids) in which every prefix holds each level within
    one example of its share: the i-th example of a level of n is placed at (i + 1/2) / n, ties
    to the earlier position. Within a level the shuffled order is kept."""
    counts = np.bincount(levels, minlength=num_levels)
    rank = np.zeros(len(levels), dtype=np.int64)
    seen = np.zeros(num_levels, dtype=np.int64)
    for i, k in enumerate(levels):
        rank[i], seen[k] = seen[k], seen[k] + 1
    return np.lexsort((np.arange(len(levels)), (rank + 0.5) / counts[levels]))


class _MixtureSplit(_LazySplit):
    """Lazy sequence of examples: entry ``i`` is instance ``rows[i]`` of level ``levels[i]``."""

    def __init__(self, task: _MixtureTask, levels: np.ndarray, rows: np.ndarray, split: str):
        self._task, self._levels, self._rows, self._split = task, levels, rows, split
        self._size = len(levels)

    def _example(self, i: int) -> Example:
        return self._task.example(int(self._levels[i]), int(self._rows[i]))


class _MixtureTask(Task):
    """Examples from a weighted mixture of difficulty levels (see the module docstring).

    Each level's instances are drawn once, distinct, from a generator seeded by ``(seed, level
    index)``: its first ``eval`` count form its share of the held-out split, the next ``train``
    count its share of the training split, so the splits never share a prompt. Each split is
    then shuffled (seeded), so consecutive examples mix the levels.

    Subclasses set ``task_name``, ``level_parts`` and ``default_mixture`` and define
    ``_check_level``, ``_draw`` (distinct instances of a level), ``example`` and the bounds.
    """

    task_name: str
    level_parts: int
    default_mixture: str

    def __init__(
        self,
        mixture: str = "",
        train_size: int = 20_000,
        eval_size: int = 500,
        seed: int = 0,
    ):
        for what, size in (("train_size", train_size), ("eval_size", eval_size)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{what} must be an int >= 1, got {size!r}")
        self.mixture = parse_mixture(mixture or self.default_mixture, self.level_parts)
        for level, _ in self.mixture:
            self._check_level(level)
        self.seed = seed
        self.name = f"{self.task_name}_" + "_".join(
            "x".join(map(str, lv)) for lv, _ in self.mixture
        )
        weights = [w for _, w in self.mixture]
        n_eval, n_train = apportion(eval_size, weights), apportion(train_size, weights)
        self._data: list[np.ndarray] = []
        split_refs: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"eval": [], "train": []}
        for k, (level, _) in enumerate(self.mixture):
            count = n_eval[k] + n_train[k]
            space = self.level_size(level)
            if count > space:
                raise ValueError(
                    f"level {self.level_name(k)!r} has only {space} distinct instances, fewer "
                    f"than the {count} its weight asks for (train_size + eval_size = "
                    f"{train_size + eval_size}); lower its weight or the split sizes"
                )
            self._data.append(self._draw(level, count, np.random.default_rng((seed, k))))
            for split, lo, hi in (("eval", 0, n_eval[k]), ("train", n_eval[k], count)):
                split_refs[split].append((np.full(hi - lo, k), np.arange(lo, hi)))
        rng = np.random.default_rng((seed, len(self.mixture)))
        for split, refs in split_refs.items():
            levels = np.concatenate([lv for lv, _ in refs])
            rows = np.concatenate([r for _, r in refs])
            order = rng.permutation(len(levels))
            levels, rows = levels[order], rows[order]
            if split == "eval":
                order = _stratified_order(levels, len(self.mixture))
                levels, rows = levels[order], rows[order]
            setattr(self, split, _MixtureSplit(self, levels, rows, split))

    def level_name(self, k: int) -> str:
        return "x".join(map(str, self.mixture[k][0]))

    def level_counts(self, split: str) -> dict[str, int]:
        """Examples per level in ``split`` (``"train"`` or ``"eval"``)."""
        examples = self.train if split == "train" else self.eval
        levels = np.bincount(examples._levels, minlength=len(self.mixture))
        return {self.level_name(k): int(c) for k, c in enumerate(levels)}

    @abc.abstractmethod
    def _check_level(self, level: Level) -> None:
        """Raises ValueError for a level this task cannot build."""

    @abc.abstractmethod
    def level_size(self, level: Level) -> int:
        """Distinct instances of ``level``."""

    @abc.abstractmethod
    def _draw(self, level: Level, count: int, rng: np.random.Generator) -> np.ndarray:
        """``count`` distinct instances of ``level`` as rows of an array."""

    @abc.abstractmethod
    def example(self, k: int, row: int) -> Example:
        """Instance ``row`` of level ``k`` as an example dict."""


def multiplication_trace(a: int, b: int, *, lsb_first: bool = False) -> str:
    """``a * b`` written out: one partial product ``a * d * 10**i`` per digit ``d`` of ``b``
    (least significant first, ``0`` for a zero digit), joined by ``"+"``, then ``"="`` and the
    product. ``multiplication_trace(1234, 567) == "8638+74040+617000=699678"``.

    ``lsb_first`` writes every number least significant digit first, the order in which its
    carries are computed (``"8368+04047+000716=876996"``), so each digit follows from digits
    already written (Lee et al. 2023, "Teaching Arithmetic to Small Transformers": reversed
    outputs make carries learnable by small models).
    """
    digits = str(b)[::-1]
    numbers = [str(a * int(d) * 10**i) for i, d in enumerate(digits)] + [str(a * b)]
    if lsb_first:
        numbers = [n[::-1] for n in numbers]
    return "+".join(numbers[:-1]) + "=" + numbers[-1]


class LongMultiplicationTask(_MixtureTask):
    """``a*b=`` with the partial products written out, then their sum.

    Level ``"AxB"``: ``a`` has exactly ``A`` digits and ``b`` exactly ``B`` (no leading zeros),
    1 <= A, B <= 6. The prompt is ``"1234*567="``, the supervised target
    ``"8638+74040+617000=699678"`` (`multiplication_trace`): ``B`` partial products, then 2 + A
    + B + (B - 1) characters more; 3x3 needs at most 25 response tokens with EOS, 4x4 39.

    Reward: 1.0 iff the completion is exactly the trace of `multiplication_trace` in ASCII
    digits: ``b``'s partial products in order (``0`` for a zero digit, no leading zeros), their
    sum, nothing else. So the working is checked as well as the answer: a right answer after
    wrong or missing working, a bare answer, a truncated trace, spaces or text around it, or
    another script's digits score 0. An example's ``"answer"`` is ``a * b`` in plain decimal.

    Args:
      lsb_first: write the numbers of the response least significant digit first
        (`multiplication_trace`); the name gets ``"_lsb"``. Task name
        ``"long_multiplication_lsb"`` in :data:`TASKS`.
      mixture, train_size, eval_size, seed: as for every mixture task.
    """

    task_name = "long_multiplication"
    level_parts = 2
    default_mixture = "3x2:1,3x3:1,4x3:1"

    def __init__(
        self,
        mixture: str = "",
        train_size: int = 20_000,
        eval_size: int = 500,
        seed: int = 0,
        lsb_first: bool = False,
    ):
        if not isinstance(lsb_first, bool):
            raise ValueError(f"lsb_first must be a bool, got {lsb_first!r}")
        self.lsb_first = lsb_first
        super().__init__(mixture, train_size, eval_size, seed)
        if lsb_first:
            self.name += "_lsb"

    def _check_level(self, level: Level) -> None:
        if not all(1 <= n <= 6 for n in level):
            raise ValueError(f"operand digit counts must be in [1, 6], got level {level}")

    def level_size(self, level: Level) -> int:
        return math.prod(9 * 10 ** (n - 1) for n in level)

    def _draw(self, level: Level, count: int, rng: np.random.Generator) -> np.ndarray:
        da, db = level
        nb = 9 * 10 ** (db - 1)
        a, b = np.divmod(_sample_pairs(self.level_size(level), count, rng), nb)
        return np.stack([a + 10 ** (da - 1), b + 10 ** (db - 1)], axis=1)

    def example(self, k: int, row: int) -> Example:
        a, b = (int(x) for x in self._data[k][row])
        return {
            "prompt": f"{a}*{b}=",
            "answer": str(a * b),
            "target": multiplication_trace(a, b, lsb_first=self.lsb_first),
            "a": a,
            "b": b,
            "level": self.level_name(k),
        }

    @property
    def max_prompt_chars(self) -> int:
        return max(da + db + 2 for (da, db), _ in self.mixture)

    @property
    def max_target_chars(self) -> int:
        # All-nines operands have the longest partial products and product of their level.
        return max(
            len(multiplication_trace(10**da - 1, 10**db - 1)) for (da, db), _ in self.mixture
        )

    def reward(self, completion: str, example: Example) -> float:
        trace = multiplication_trace(example["a"], example["b"], lsb_first=self.lsb_first)
        return float(completion == trace)


class SortDigitsTask(_MixtureTask):
    """A digit string sorted ascending: ``"5914="`` -> ``"1459"``.

    Level ``"N"``: strings of exactly ``N`` digits (leading zeros allowed), 2 <= N <= 60, drawn
    uniformly and distinct. Prompt ``N + 1`` characters, response ``N`` (plus EOS). Reward:
    1.0 iff the completion is exactly the sorted string in ASCII digits (a truncated or
    over-long response, a space, or any other character scores 0).
    """

    task_name = "sort_digits"
    level_parts = 1
    default_mixture = "16:1,24:1,32:1"

    def _check_level(self, level: Level) -> None:
        if not 2 <= level[0] <= 60:
            raise ValueError(f"list length must be in [2, 60], got level {level[0]}")

    def level_size(self, level: Level) -> int:
        return 10 ** level[0]

    def _draw(self, level: Level, count: int, rng: np.random.Generator) -> np.ndarray:
        n = level[0]
        out = np.empty((0, n), np.uint8)
        while len(out) < count:
            fresh = rng.integers(0, 10, size=(count - len(out), n), dtype=np.uint8)
            both = np.concatenate([out, fresh])
            _, first = np.unique(both, axis=0, return_index=True)
            out = both[np.sort(first)]  # distinct rows, in the order drawn
        return out[:count]

    def example(self, k: int, row: int) -> Example:
        digits = "".join(map(str, self._data[k][row]))
        return {
            "prompt": f"{digits}=",
            "answer": "".join(sorted(digits)),
            "level": self.level_name(k),
        }

    @property
    def max_prompt_chars(self) -> int:
        return max(n + 1 for (n,), _ in self.mixture)

    @property
    def max_target_chars(self) -> int:
        return max(n for (n,), _ in self.mixture)

    def reward(self, completion: str, example: Example) -> float:
        return float(completion == example["answer"])


TASKS = {
    "addition": AdditionTask,
    "multiplication": MultiplicationTask,
    LongMultiplicationTask.task_name: LongMultiplicationTask,
    # Its own task name rather than a config flag: runs of the other tasks keep their config
    # (and so their warm-up cache keys).
    "long_multiplication_lsb": functools.partial(LongMultiplicationTask, lsb_first=True),
    SortDigitsTask.task_name: SortDigitsTask,
}
#: Tasks built from a difficulty mixture (``data.mixture``) rather than ``data.num_digits``.
MIXTURE_TASKS = ("long_multiplication", "long_multiplication_lsb", "sort_digits")


def make_task(name: str, **kwargs) -> Task:
    """Builds a built-in task by name (one of :data:`TASKS`)."""
    try:
        cls = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task name {name!r}; choose from {sorted(TASKS)}") from None
    return cls(**kwargs)


def task_from_config(data) -> Task:
    """The built-in task of a run's ``config.data``: ``data.task`` with ``data.num_digits``
    (addition, multiplication) or ``data.mixture`` (:data:`MIXTURE_TASKS`; ``""`` takes the
    task's default mixture), ``data.eval_size`` held out, splits fixed by seed 0."""
    mixture = data.get("mixture", "")
    if data.task in MIXTURE_TASKS:
        return make_task(data.task, mixture=mixture, eval_size=data.eval_size, seed=0)
    if mixture:
        raise ValueError(
            f"data.mixture={mixture!r} applies to {MIXTURE_TASKS}; task {data.task!r} takes "
            "data.num_digits"
        )
    return make_task(data.task, num_digits=data.num_digits, eval_size=data.eval_size, seed=0)
