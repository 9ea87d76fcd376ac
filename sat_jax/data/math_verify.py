"""Answer grading for maths datasets: our exact numbers, math-verify for everything else.

``math_reward(completion, reference)`` takes the answer the completion *marks*, and only that:

1. the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced;
2. else the last ``#### X`` (GSM8K's marker), its first number when text follows.

An unmarked completion scores 0: a number merely present in the text ("I tried 12, 13, 14")
never counts, so a policy cannot collect reward by listing candidates.

The marked answer is then compared with the reference:

* **both sides plain numbers** (integers, decimals, ``a/b``, ``\\frac{a}{b}``, thousands separators,
  a ``\\text{}`` unit after the number, percentages): ours, exactly (as fractions). An integer
  reference needs exactly that value, so ``1000001`` does not pass for ``1000000``; other values
  match within ``rel_tol`` / ``abs_tol``; ``50%`` matches both 50 and 0.5. Numbers are parsed in
  plain decimal notation only (``1_000``, ``inf``, ``nan`` are not numbers) and at most 400
  digits long, so this path is linear in the answer;
* **anything else** (``\\sqrt{2}/2``, ``\\pi``, sets, intervals, equations, multiple-choice
  letters): the `math-verify` package (``pip install "sat-jax[tasks]"``), run by
  `sat_jax.data.grading.Grader` in a worker process with a deadline per answer (a pathological
  answer scores 0 instead of stalling the rollout). Without math-verify installed, the normalised
  texts must be equal (a ``\\text{}`` answer kept as its text: ``\\text{(A)}`` is ``(A)``).

``tests/data/test_math_verify.py`` holds a table of answer pairs graded both ways, with the rows
where this module and math-verify alone differ and why.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

from sat_jax.data.grading import Grader, available, default_grader

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = re.compile(r"####\s*([^\n]*)")
# A number in running text: \frac forms, or digits with optional thousands commas, decimals, a
# fraction bar and a percent sign. A sign counts only where it cannot be a binary operator
# ("10-3" is 10 and 3, not -3).
_SIGN = r"(?:(?<![\w)}])[-+])?"
_NUMBER_IN_TEXT = re.compile(
    _SIGN + r"\\[dt]?frac\{[^{}]*\}\{[^{}]*\}"
    r"|" + _SIGN + r"\\[dt]?frac\d\d"
    r"|" + _SIGN + r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?(?:\\?%)?"
    r"|" + _SIGN + r"\.\d+(?:\\?%)?"
)
_FRAC = re.compile(r"^([-+]?)\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}$")
_FRAC_SHORT = re.compile(r"^([-+]?)\\[dt]?frac(\d)(\d)$")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
# Plain decimal notation only: Python's float() and Fraction() also take "1_000", "inf", "nan"
# and surrounding spaces, none of which is a written answer.
_DECIMAL = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?$")
# Longest digit string parsed: bounds the work a crafted answer can cause (and stays below
# Python's int-from-str limit).
_MAX_DIGITS = 400
_TEXT_CMD = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}")
_BRACE = re.compile(r"[{}]")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None.

    One pass over the braces with a stack of the open ones, so the work is linear in the text
    (a scan forward from every ``\\boxed{`` is quadratic on unclosed boxes).
    """
    opens = {m.end() - 1 for m in _BOXED.finditer(text)}
    if not opens:
        return None
    stack: list[int] = []  # positions of the unclosed "{"
    best: tuple[int, int] | None = None  # (content start, end) of the latest-starting box
    for m in _BRACE.finditer(text):
        pos = m.start()
        if text[pos] == "{":
            stack.append(pos)
        elif stack:
            start = stack.pop()
            if start in opens and (best is None or start > best[0]):
                best = (start + 1, pos)
    return None if best is None else text[best[0] : best[1]]


def extract_answer(text: str) -> str | None:
    """The answer ``text`` marks (last ``\\boxed{}``, else last ``####``), or None."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    boxed = _last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    for tail in reversed(_HASHES.findall(text)):
        candidate = _candidate_from_tail(tail)
        if candidate is not None:
            return candidate
    return None


def _candidate_from_tail(tail: str) -> str | None:
    """The answer at the start of the text that follows a marker ("#### 12 apples." -> "12")."""
    tail = tail.strip()
    if not tail:
        return None
    # The whole tail may be the answer ("$\\frac{1}{2}$."); otherwise take its first number.
    if parse_number(tail) is not None:
        return tail
    numbers = _NUMBER_IN_TEXT.findall(tail)
    return numbers[0].strip() if numbers else None


def normalize_answer(s: str) -> str:
    """Canonical string form: LaTeX wrappers, units, spaces and a trailing period removed."""
    s = s.strip()
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", "")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\$", "").replace("$", "")
    # Unit words after a quantity are dropped ("5\text{ cm}"); otherwise a \text{} group is the
    # answer itself ("\text{(B)}", "\text{odd}") and keeps its text.
    without_units = _TEXT_CMD.sub(lambda m: m.group(1) if re.search(r"\d", m.group(1)) else "", s)
    s = without_units if re.search(r"\d", without_units) else _TEXT_CMD.sub(r"\1", s)
    s = s.replace("\\%", "%")
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    if s.startswith("+"):
        s = s[1:]
    return s


def _parse_plain(s: str) -> Fraction | None:
    """The exact value of a plain decimal ("1,234.5", "2e3"), or None."""
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if len(s) > _MAX_DIGITS or not _DECIMAL.match(s):
        return None
    return Fraction(s)


def parse_number(s: str) -> float | None:
    """The numeric value of an answer string, or None if it is not a number.

    A percentage returns its face value (``"50%"`` -> 50.0); `math_reward` also accepts
    the fraction.
    """
    values = _number_candidates(s)
    if not values:
        return None
    try:
        return float(values[0])
    except OverflowError:
        return None


def _number_candidates(s: str) -> list[Fraction]:
    """Values ``s`` may denote; a percentage denotes both its face value and that over 100."""
    s = normalize_answer(s)
    if not s:
        return []
    percent = s.endswith("%")
    if percent:
        s = s[:-1]
    value = None
    m = _FRAC.match(s) or _FRAC_SHORT.match(s)
    if m:
        sign, num, den = m.groups()
        num_v, den_v = _parse_plain(num), _parse_plain(den)
        if num_v is not None and den_v:
            value = num_v / den_v * (-1 if sign == "-" else 1)
    elif s.count("/") == 1:
        num, den = s.split("/")
        num_v, den_v = _parse_plain(num), _parse_plain(den)
        if num_v is not None and den_v:
            value = num_v / den_v
    else:
        value = _parse_plain(s)
    if value is None:
        return []
    return [value, value / 100] if percent else [value]


def _close(p: Fraction, r: Fraction, rel_tol: float, abs_tol: float) -> bool:
    """``p`` equals ``r``: exactly when ``r`` is an integer, else as `math.isclose` (computed
    exactly, so huge values neither overflow nor lose digits)."""
    if p == r:
        return True
    if r.denominator == 1:
        return False
    tol = max(Fraction(rel_tol) * max(abs(p), abs(r)), Fraction(abs_tol))
    return abs(p - r) <= tol


def math_reward(
    completion: str,
    reference: Any,
    *,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
    grader: Grader | None = None,
) -> float:
    """1.0 if the answer ``completion`` marks equals ``reference``, else 0.0.

    Args:
      completion: model output text.
      reference: the gold answer: a number, or a string such as ``"72"``, ``"\\frac{1}{2}"``,
        ``"\\sqrt{2}"``, ``"B"``, or a full GSM8K solution ending in ``"#### 72"``.
      rel_tol, abs_tol: numeric tolerance, as in `math.isclose`, for a reference that is not an
        integer (an integer reference is matched exactly).
      grader: the `Grader` that runs math-verify (default: this process's shared one).
    """
    if isinstance(reference, bool) or not isinstance(reference, int | float | str):
        raise TypeError(f"reference must be a number or a string, got {type(reference).__name__}")
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    if isinstance(reference, int | float):
        if not math.isfinite(reference):
            raise ValueError(f"reference must be a finite number, got {reference!r}")
        ref_values = [Fraction(reference)]
        ref_text = repr(reference)
    else:
        ref_values = _number_candidates(reference)
        if not ref_values:
            # A worked solution as the reference ("... #### 72"): take its marked final answer.
            extracted = extract_answer(reference)
            if extracted is not None:
                reference = extracted
                ref_values = _number_candidates(reference)
        ref_text = reference
    pred_values = _number_candidates(predicted)
    if pred_values and ref_values:
        # A percent sign on either side allows the face value or the fraction.
        hit = any(_close(p, r, rel_tol, abs_tol) for p in pred_values for r in ref_values)
        return float(hit)
    if available("math_verify"):
        grader = grader or default_grader()
        if not grader.fits(predicted, ref_text):
            return 0.0
        ok, equal = grader.call("math_verify", ref_text.strip(), predicted)
        return float(ok and equal)
    predicted, ref_text = normalize_answer(predicted), normalize_answer(ref_text)
    return float(bool(predicted) and predicted == ref_text)


def math_reward_fn(completion: str, example: dict[str, Any]) -> float:
    """`math_reward` against ``example["answer"]``: the default reward of file/TFDS sources."""
    return math_reward(completion, example["answer"])
