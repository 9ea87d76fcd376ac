"""A small deterministic character-level tokenizer for the built-in tasks.

Each character of the alphabet is one token; ids 0-2 are reserved for PAD, BOS and EOS. The
vocabulary is fixed by the alphabet string, so the same text always maps to the same ids on every
host and in every run, which a checkpointed policy relies on.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
NUM_SPECIAL = 3

# Digits, arithmetic, the answer separator "=", punctuation that math prompts use and the lowercase
# letters (short instructions such as "what is"). 49 symbols, so vocab_size 52 (limit 64).
DEFAULT_ALPHABET = "0123456789+-*/=()., :?%abcdefghijklmnopqrstuvwxyz"
MAX_VOCAB_SIZE = 64


class CharTokenizer:
    """Character-level tokenizer: one id per character of ``alphabet`` after PAD, BOS and EOS.

    Attributes:
      alphabet: the characters, in id order (character ``alphabet[i]`` has id ``i + 3``).
      vocab_size: number of ids, special ones included.
      pad_id, bos_id, eos_id: the special ids (0, 1, 2).

    Example::

        tok = CharTokenizer()
        ids = tok.encode("37+85=")
        tok.decode(ids + [tok.eos_id, 5])  # -> "37+85="
    """

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if not isinstance(alphabet, str) or not alphabet:
            raise ValueError(f"alphabet must be a non-empty string, got {alphabet!r}")
        if len(set(alphabet)) != len(alphabet):
            dupes = sorted({c for c in alphabet if alphabet.count(c) > 1})
            raise ValueError(f"alphabet has repeated characters: {dupes!r}")
        if len(alphabet) + NUM_SPECIAL > MAX_VOCAB_SIZE:
            raise ValueError(
                f"alphabet of {len(alphabet)} characters gives vocab_size "
                f"{len(alphabet) + NUM_SPECIAL} > {MAX_VOCAB_SIZE}"
            )
        self.alphabet = alphabet
        self.vocab_size = len(alphabet) + NUM_SPECIAL
        self._char_to_id = {c: i + NUM_SPECIAL for i, c in enumerate(alphabet)}

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Maps ``text`` to ids, optionally framed by BOS / EOS.

        Raises:
          ValueError: naming the first character that is not in the alphabet.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = [self.bos_id] if add_bos else []
        for pos, ch in enumerate(text):
            try:
                ids.append(self._char_to_id[ch])
            except KeyError:
                raise ValueError(
                    f"unknown character {ch!r} at position {pos} of text {text!r}; the "
                    f"tokenizer alphabet is {self.alphabet!r}"
                ) from None
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Maps ids back to text, stopping at the first EOS and skipping PAD and BOS.

        Accepts a list or a 1-D integer array (e.g. one row of sampled tokens).

        Raises:
          ValueError: for an id outside ``[0, vocab_size)``.
        """
        chars = []
        for i in np.asarray(ids).reshape(-1).tolist():
            if i == self.eos_id:
                break
            if i in (self.pad_id, self.bos_id):
                continue
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside [0, {self.vocab_size})")
            chars.append(self.alphabet[i - NUM_SPECIAL])
        return "".join(chars)

    def batch_encode(
        self,
        texts: Sequence[str],
        pad_to: int | None = None,
        *,
        add_bos: bool = True,
        add_eos: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Encodes a batch, right-padded with PAD.

        Args:
          texts: the strings (typically prompts).
          pad_to: row length L; None pads to the longest row. A fixed value keeps shapes static
            under jit.
          add_bos: prepend BOS to every row (default True: prompts start with BOS).
          add_eos: append EOS to every row.

        Returns:
          ``(ids, lengths)``: ``ids`` int32 ``[B, L]``, right-padded with ``pad_id``; ``lengths``
          int32 ``[B]``, the number of real tokens (BOS/EOS included) in each row.

        Raises:
          ValueError: an empty batch, an unknown character, or a row longer than ``pad_to``.
        """
        if isinstance(texts, str):
            raise TypeError("texts must be a sequence of strings, got a single str")
        if len(texts) == 0:
            raise ValueError("texts is empty; batch_encode needs at least one string")
        rows = [self.encode(t, add_bos=add_bos, add_eos=add_eos) for t in texts]
        lengths = np.array([len(r) for r in rows], dtype=np.int32)
        longest = int(lengths.max())
        if pad_to is None:
            pad_to = longest
        elif pad_to < 1:
            raise ValueError(f"pad_to must be >= 1, got {pad_to}")
        elif longest > pad_to:
            worst = int(lengths.argmax())
            raise ValueError(
                f"text {texts[worst]!r} encodes to {longest} tokens, more than pad_to={pad_to}"
            )
        ids = np.full((len(rows), pad_to), self.pad_id, dtype=np.int32)
        for b, row in enumerate(rows):
            ids[b, : len(row)] = row
        return ids, lengths
