"""Tests of the character-level tokenizer."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sat_jax.data import BOS_ID, EOS_ID, PAD_ID, CharTokenizer


def test_special_ids_and_vocab_size():
    tok = CharTokenizer()
    assert (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)
    assert tok.vocab_size == len(tok.alphabet) + 3
    assert tok.vocab_size <= 64


def test_encode_is_fixed_by_the_alphabet():
    tok = CharTokenizer("0123456789+=")
    # '3' -> 3 + 3, '7' -> 7 + 3, '+' -> 10 + 3, '=' -> 11 + 3.
    assert tok.encode("37+=") == [6, 10, 13, 14]
    assert tok.encode("37", add_bos=True, add_eos=True) == [1, 6, 10, 2]
    assert tok.encode("") == []


def test_round_trip_default_alphabet():
    tok = CharTokenizer()
    text = "what is 37+85=122? (1/2, 50%)"
    assert tok.decode(tok.encode(text)) == text


def test_decode_stops_at_eos_and_skips_pad_and_bos():
    tok = CharTokenizer("0123456789+=")
    assert tok.decode([1, 4, 0, 5, 2, 6, 7]) == "12"
    assert tok.decode(np.array([0, 0, 2, 4], dtype=np.int32)) == ""


def test_decode_rejects_out_of_range_ids():
    tok = CharTokenizer("01")
    with pytest.raises(ValueError, match="token id 5"):
        tok.decode([3, 5])


def test_unknown_character_is_named():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=r"unknown character 'Z' at position 2"):
        tok.encode("12Z")


def test_batch_encode_right_pads():
    tok = CharTokenizer("0123456789+=")
    ids, lengths = tok.batch_encode(["1+2=", "10+20="], pad_to=8)
    assert ids.dtype == np.int32 and lengths.dtype == np.int32
    np.testing.assert_array_equal(
        ids,
        [
            [1, 4, 13, 5, 14, 0, 0, 0],
            [1, 4, 3, 13, 5, 3, 14, 0],
        ],
    )
    np.testing.assert_array_equal(lengths, [5, 7])


def test_batch_encode_default_pads_to_longest_without_bos():
    tok = CharTokenizer("0123456789+=")
    ids, lengths = tok.batch_encode(["1", "123"], add_bos=False)
    assert ids.shape == (2, 3)
    np.testing.assert_array_equal(lengths, [1, 3])


def test_batch_encode_errors():
    tok = CharTokenizer("0123456789+=")
    with pytest.raises(ValueError, match="more than pad_to=3"):
        tok.batch_encode(["1+2="], pad_to=3)
    with pytest.raises(ValueError, match="empty"):
        tok.batch_encode([])
    with pytest.raises(TypeError, match="single str"):
        tok.batch_encode("1+2")


def test_bad_alphabets():
    with pytest.raises(ValueError, match="repeated"):
        CharTokenizer("0120")
    with pytest.raises(ValueError, match="vocab_size"):
        CharTokenizer("".join(chr(ord("!") + i) for i in range(62)))


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=CharTokenizer().alphabet, max_size=40))
def test_round_trip_property(text):
    tok = CharTokenizer()
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert all(0 < i < tok.vocab_size for i in ids)
    assert tok.decode(ids + [5, 6]) == text
