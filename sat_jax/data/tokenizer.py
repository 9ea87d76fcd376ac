"""Tokenizers: one minimal protocol, the built-in character tokenizer, Hugging Face
``tokenizer.json`` files, and the Qwen chat format for prompts.

* ``Tokenizer`` — what the rest of sat_jax needs from a tokenizer: ``encode``, ``decode``,
  ``vocab_size``, ``eos_id``, ``pad_id``. ``CharTokenizer`` and ``HFTokenizer`` both satisfy it;
  ``load_tokenizer("char" | path)`` builds either.
* ``CharTokenizer`` — a small deterministic character-level tokenizer for the built-in tasks. Each
  character of the alphabet is one token; ids 0-2 are reserved for PAD, BOS and EOS. The
  vocabulary is fixed by the alphabet string, so the same text always maps to the same ids on
  every host and in every run, which a checkpointed policy relies on.
* ``HFTokenizer`` — a local ``tokenizer.json`` through the ``tokenizers`` library (imported when
  a tokenizer is built, so sat_jax imports without it). Special-token names come from the
  ``tokenizer_config.json`` beside it when present. Nothing is downloaded.
* ``qwen_chat_prompt`` — the Qwen (ChatML) chat format, written out in Python rather than rendered
  from the checkpoint's Jinja ``chat_template``: no jinja2 dependency, no template code from a
  downloaded file is executed, and the prompt string is fixed by this code and its tests. It covers
  what RL prompts use (system / user / assistant text turns and the generation prompt, with
  Qwen3's ``enable_thinking=False`` empty think block); tool calls and the template's stripping of
  earlier turns' reasoning are not reproduced.

Reference: Qwen3 chat format, ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per turn (Yang et al.
2025, "Qwen3 Technical Report"; the ChatML convention of Qwen2).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

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
        try:
            ids += [self._char_to_id[ch] for ch in text]
        except KeyError:
            pos = next(i for i, ch in enumerate(text) if ch not in self._char_to_id)
            raise ValueError(
                f"unknown character {text[pos]!r} at position {pos} of text {text!r}; the "
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


# --------------------------------------------------------------------------------------------
# Hugging Face tokenizers and the Qwen chat format

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
_ROLES = ("system", "user", "assistant")
# Tried in order when neither the caller nor tokenizer_config.json names an EOS token.
_EOS_CANDIDATES = (IM_END, "<|endoftext|>", "</s>", "<eos>")


@runtime_checkable
class Tokenizer(Protocol):
    """The tokenizer interface of sat_jax.

    ``encode`` maps text to ids without adding special tokens; ``decode`` maps ids back, stopping
    at the first ``eos_id`` (so a sampled row with padding after EOS decodes to its response).
    """

    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def decode_response(tokenizer: Tokenizer, ids: Iterable[int]) -> str | None:
    """The text of a sampled response up to its first EOS, or None when it is malformed.

    Malformed: a PAD, a BOS (when the tokenizer has one) or an id outside ``[0, vocab_size)`` (a
    checkpoint's embedding rows past the tokenizer) before the first EOS. Such tokens have no
    text; dropping them would let the characters around them join into an answer (``[1, BOS,
    0, 8]`` reading as ``"108"``), so a malformed response scores 0 whatever the reward, in
    rollouts and in evaluation alike (``RolloutEngine.reward``). Tokens after the EOS (the
    sampler's padding) are ignored.
    """
    seq = np.asarray(ids).reshape(-1)
    eos = np.flatnonzero(seq == tokenizer.eos_id)
    if eos.size:
        seq = seq[: eos[0]]
    specials = [i for i in (tokenizer.pad_id, getattr(tokenizer, "bos_id", None)) if i is not None]
    if np.any((seq < 0) | (seq >= tokenizer.vocab_size) | np.isin(seq, specials)):
        return None
    return tokenizer.decode(seq)


def qwen_chat_prompt(
    messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
) -> str:
    """Render chat ``messages`` in the Qwen (ChatML) format.

    Each message becomes ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; with
    ``add_generation_prompt`` the string ends with ``<|im_start|>assistant\\n`` so the model writes
    the reply (end the reply at ``<|im_end|>``). ``enable_thinking=False`` appends Qwen3's empty
    think block ``<think>\\n\\n</think>\\n\\n`` after it (the Qwen3 template's way to switch
    thinking off); None or True adds nothing.

    Example::

        qwen_chat_prompt([{"role": "user", "content": "1+1?"}])
        # '<|im_start|>user\\n1+1?<|im_end|>\\n<|im_start|>assistant\\n'

    Raises:
      ValueError: naming the message index, for a role other than system/user/assistant, a
        system message that is not first, or non-string content.
    """
    if isinstance(messages, Mapping) or isinstance(messages, str):
        raise TypeError("messages must be a sequence of {'role', 'content'} mappings")
    parts = []
    for i, msg in enumerate(messages):
        role, content = msg.get("role"), msg.get("content")
        if role not in _ROLES:
            raise ValueError(
                f"messages[{i}] has role {role!r}; the Qwen chat format here supports {_ROLES}"
            )
        if role == "system" and i != 0:
            raise ValueError(f"messages[{i}] is a system message; it must come first")
        if not isinstance(content, str):
            raise ValueError(
                f"messages[{i}]['content'] must be a str, got {type(content).__name__}"
            )
        parts.append(f"{IM_START}{role}\n{content}{IM_END}\n")
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
        if enable_thinking is False:
            parts.append("<think>\n\n</think>\n\n")
    return "".join(parts)


def user_prompt(text: str) -> str:
    """``text`` as one user turn of the Qwen chat format, with the generation prompt (what
    ``data.chat_template=True`` feeds the policy)."""
    return qwen_chat_prompt([{"role": "user", "content": text}])


def _token_name(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A Hugging Face fast tokenizer from a local ``tokenizer.json``.

    Args:
      path: a directory holding ``tokenizer.json`` (and optionally ``tokenizer_config.json``) or
        the ``tokenizer.json`` file itself.
      eos_token: the token that ends a response; default ``tokenizer_config.json``'s
        ``eos_token``, else the first of ``<|im_end|>``, ``<|endoftext|>``, ``</s>`` in the
        vocabulary. With the chat format, generation ends at ``<|im_end|>``: a base model's
        config names ``<|endoftext|>``, so pass ``eos_token="<|im_end|>"`` for chat rollouts.
      pad_token: padding token; default ``tokenizer_config.json``'s ``pad_token``, else EOS.

    Example::

        tok = HFTokenizer("/ckpt/Qwen3-30B-A3B-Base", eos_token="<|im_end|>")
        ids = tok.encode_chat([{"role": "user", "content": "What is 2+2?"}])
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ):
        try:
            from tokenizers import Tokenizer as _RustTokenizer
        except ImportError as e:  # pragma: no cover - exercised only without the extra
            raise ImportError(
                "HFTokenizer needs the `tokenizers` package (pip install 'sat_jax[hf]')"
            ) from e
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self.path = file
        self._tok = _RustTokenizer.from_file(str(file))
        extra: dict[str, Any] = {}
        cfg_file = file.parent / "tokenizer_config.json"
        if cfg_file.exists():
            with open(cfg_file) as f:
                extra = json.load(f)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

        if eos_token is None:
            eos_token = _token_name(extra.get("eos_token"))
        if eos_token is None:
            eos_token = next(
                (t for t in _EOS_CANDIDATES if self._tok.token_to_id(t) is not None), None
            )
        if eos_token is None:
            raise ValueError(
                f"{file}: no eos_token given, none in tokenizer_config.json and none of "
                f"{_EOS_CANDIDATES} in the vocabulary"
            )
        self.eos_token = eos_token
        self.eos_id = self._id("eos_token", eos_token)
        if pad_token is None:
            pad_token = _token_name(extra.get("pad_token")) or eos_token
        self.pad_token = pad_token
        self.pad_id = self._id("pad_token", pad_token)
        bos = _token_name(extra.get("bos_token"))
        self.bos_id = None if bos is None else self._tok.token_to_id(bos)

    def _id(self, name: str, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise ValueError(f"{name} {token!r} is not in the vocabulary of {self.path}")
        return int(i)

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token`` (e.g. ``"<|im_end|>"``), or None if it is not in the vocabulary."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Ids of ``text``. Special tokens written in the text (``<|im_start|>`` ...) map to their
        ids; ``add_special_tokens`` runs the tokenizer's post-processor (e.g. a BOS)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(
        self, ids: Iterable[int], *, skip_special_tokens: bool = False, stop_at_eos: bool = True
    ) -> str:
        """Text of ``ids`` (a list or 1-D integer array), cut before the first EOS by default.

        Raises:
          ValueError: for an id outside ``[0, vocab_size)``.
        """
        seq = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).reshape(-1)
        seq = [int(i) for i in seq.tolist()]
        if stop_at_eos and self.eos_id in seq:
            seq = seq[: seq.index(self.eos_id)]
        bad = [i for i in seq if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside [0, {self.vocab_size})")
        return self._tok.decode(seq, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
    ) -> str:
        """The prompt string of ``messages`` in the Qwen chat format (``qwen_chat_prompt``)."""
        return qwen_chat_prompt(
            messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
    ) -> list[int]:
        """Ids of ``apply_chat_template(messages, ...)``."""
        return self.encode(
            self.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=enable_thinking,
            )
        )

    def batch_encode(
        self, texts: Sequence[str], pad_to: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Right-padded ids int32 [B, L] and lengths int32 [B] (the sampler's prompt layout).

        Raises:
          ValueError: an empty batch or a text longer than ``pad_to`` tokens.
        """
        if isinstance(texts, str):
            raise TypeError("texts must be a sequence of strings, got a single str")
        if not texts:
            raise ValueError("texts is empty; batch_encode needs at least one string")
        rows = [self.encode(t) for t in texts]
        lengths = np.array([len(r) for r in rows], np.int32)
        width = int(lengths.max()) if pad_to is None else int(pad_to)
        if lengths.max() > width:
            worst = int(lengths.argmax())
            raise ValueError(
                f"text {texts[worst]!r} encodes to {lengths[worst]} tokens, more than "
                f"pad_to={pad_to}"
            )
        ids = np.full((len(rows), width), self.pad_id, np.int32)
        for b, row in enumerate(rows):
            ids[b, : len(row)] = row
        return ids, lengths


def load_tokenizer(spec: str | os.PathLike, **kwargs: Any) -> Tokenizer:
    """``"char"``: the built-in ``CharTokenizer``; a local path: ``HFTokenizer(path, **kwargs)``."""
    if str(spec) == "char":
        return CharTokenizer(**kwargs)
    return HFTokenizer(spec, **kwargs)
