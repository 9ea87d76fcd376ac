"""Numeric answer verification for math datasets (GSM8K-style and MATH-style numeric answers).

``math_reward(completion, reference)`` extracts the final answer from the completion, normalises
both sides to numbers and compares them with a tolerance. Extraction order, first hit wins:

1. the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced;
2. the last ``#### X`` (GSM8K's answer marker);
3. the last "answer is X" / "answer: X";
4. the last number anywhere in the text.

Normalisation removes ``$``, spaces, LaTeX spacing and ``\\text{...}`` units, thousands
separators ("1,234"), a leading ``+`` and a trailing period, and understands ``\\frac{a}{b}``
(also ``\\dfrac``, ``\\tfrac``, ``\\frac12``), ``a/b``, decimals, scientific notation and
percentages (``50%`` matches both 50 and 0.5). If either side is not a number the normalised strings
are compared exactly.
"""

from __future__ import annotations

import math
import re
from typing import Any

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*([^\n]*)", re.IGNORECASE)
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
_TEXT_CMD = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def extract_answer(text: str) -> str | None:
    """The final-answer string of a completion (see module docstring for the order), or None."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    marked = _marked_answer(text)
    if marked is not None:
        return marked
    numbers = _NUMBER_IN_TEXT.findall(text)
    return numbers[-1].strip() if numbers else None


def _marked_answer(text: str) -> str | None:
    """The answer behind an explicit marker (boxed, ####, "answer is"), or None."""
    boxed = _last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    for pattern in (_HASHES, _ANSWER_IS):
        hits = pattern.findall(text)
        for tail in reversed(hits):
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
    # Keep a \text{} group that holds the number itself, drop unit words ("5\text{ cm}").
    s = _TEXT_CMD.sub(lambda m: m.group(1) if re.search(r"\d", m.group(1)) else "", s)
    s = s.replace("\\%", "%")
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    if s.startswith("+"):
        s = s[1:]
    return s


def _parse_plain(s: str) -> float | None:
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if "," in s:
        return None
    try:
        value = float(s)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_number(s: str) -> float | None:
    """The numeric value of an answer string, or None if it is not a number.

    A percentage returns its face value (``"50%"`` -> 50.0); `math_reward` also accepts
    the fraction.
    """
    values = _number_candidates(s)
    return values[0] if values else None


def _number_candidates(s: str) -> list[float]:
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
            value = num_v / den_v * (-1.0 if sign == "-" else 1.0)
    elif s.count("/") == 1:
        num, den = s.split("/")
        num_v, den_v = _parse_plain(num), _parse_plain(den)
        if num_v is not None and den_v:
            value = num_v / den_v
    else:
        value = _parse_plain(s)
    if value is None:
        return []
    return [value, value / 100.0] if percent else [value]


def math_reward(
    completion: str,
    reference: Any,
    *,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
) -> float:
    """1.0 if the final answer of ``completion`` equals ``reference``, else 0.0.

    Args:
      completion: model output text.
      reference: the gold answer: a number, or a string such as ``"72"``, ``"\\frac{1}{2}"``,
        ``"1,000"``, or a full GSM8K solution ending in ``"#### 72"``.
      rel_tol, abs_tol: numeric tolerance, as in `math.isclose`.
    """
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    if isinstance(reference, bool):
        raise TypeError("reference must be a number or a string, got bool")
    if isinstance(reference, int | float):
        ref_values = [float(reference)]
        ref_text = repr(reference)
    elif isinstance(reference, str):
        ref_values = _number_candidates(reference)
        if not ref_values:
            # A worked solution as the reference ("... #### 72"): take its marked final answer.
            extracted = _marked_answer(reference)
            if extracted is not None:
                reference = extracted
                ref_values = _number_candidates(reference)
        ref_text = reference
    else:
        raise TypeError(f"reference must be a number or a string, got {type(reference).__name__}")
    pred_values = _number_candidates(predicted)
    if pred_values and ref_values:
        # A percent sign on either side allows the face value or the fraction.
        hit = any(
            math.isclose(p, r, rel_tol=rel_tol, abs_tol=abs_tol)
            for p in pred_values
            for r in ref_values
        )
        return float(hit)
    return float(normalize_answer(predicted) == normalize_answer(ref_text))


def math_reward_fn(completion: str, example: dict[str, Any]) -> float:
    """`math_reward` against ``example["answer"]``: the default reward of file/TFDS sources."""
    return math_reward(completion, example["answer"])
