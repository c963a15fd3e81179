"""Incremental detokenization (``disagg.api.detok``): the pieces add up to the whole text, a
split character is held until it completes, and the decoding cost per token is bounded."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.api.detok import MAX_HELD_TOKENS, IncrementalText
from disagg.engine.reference.tokenizer import BYTE_OFFSET, ByteTokenizer

BYTES = ByteTokenizer()


class NoTailCheck:
    """The byte tokenizer without ``incomplete_tail``: what a tokenizer library offers."""

    def __init__(self):
        self.num_decoded = 0  # tokens passed to decode, over all calls

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.num_decoded += len(ids)
        return BYTES.decode(ids, skip_special_tokens)


class Metaspace:
    """SentencePiece's decode rule on a toy vocabulary: "_" stands for a space and the leading
    space of the decoded text is dropped, so a piece decoded alone loses its word break."""

    vocab = ["_the", "_cat", "s", "_sat", "_on", "_a", "_mat", "."]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        text = "".join(self.vocab[i] for i in ids).replace("_", " ")
        return text[1:] if text.startswith(" ") else text


def _stream(tok, ids: list[int], chunks: list[int]) -> list[str]:
    text, pieces, i = IncrementalText(tok), [], 0
    for n in chunks:
        pieces.append(text.push(ids[i : i + n]))
        i += n
    pieces.append(text.push(ids[i:]))
    pieces.append(text.flush())
    return pieces


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, BYTE_OFFSET + 255), max_size=60), st.lists(st.integers(1, 5), max_size=30))
def test_pieces_add_up_to_the_whole_decode(ids, chunks):
    """Any tokens (special, invalid and split bytes), any chunking, with the tokenizer's tail check."""
    assert "".join(_stream(BYTES, ids, chunks)) == BYTES.decode(ids)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd"), st.sampled_from(["<pad>", "<eos>"])),
                max_size=30),
       st.lists(st.integers(1, 5), max_size=30))
def test_without_a_tail_check_valid_text_adds_up_too(pieces, chunks):
    """Valid UTF-8 with special tokens between characters, any chunking, no tail check (detok
    NOTE 1: text with a U+FFFD of its own is outside this guarantee)."""
    ids = [t for p in pieces for t in ([BYTES.pad_token_id if p == "<pad>" else BYTES.eos_token_id]
                                       if p in ("<pad>", "<eos>") else BYTES.encode(p))]
    assert "".join(_stream(NoTailCheck(), ids, chunks)) == BYTES.decode(ids)


def test_a_split_character_is_held_until_it_completes():
    euro = [b + BYTE_OFFSET for b in "€".encode()]  # 3 bytes
    for tok in (BYTES, NoTailCheck()):
        text = IncrementalText(tok)
        assert [text.push([t]) for t in euro] == ["", "", "€"]
        assert text.push([ord("x") + BYTE_OFFSET]) == "x"


def test_without_a_tail_check_invalid_bytes_are_released_after_a_few_tokens():
    bad, a = 0xFF + BYTE_OFFSET, ord("a") + BYTE_OFFSET
    text = IncrementalText(NoTailCheck())
    # a trailing "\ufffd" might be a character's first bytes, for up to MAX_HELD_TOKENS tokens
    assert [text.push([bad]) for _ in range(MAX_HELD_TOKENS)] == ["", "", "", "\ufffd" * MAX_HELD_TOKENS]
    assert text.push([a]) == "a", "later tokens are not held behind them"
    assert text.push([bad]) == "" and text.push([a]) == "\ufffda", "a byte that completes nothing is final"


def test_context_keeps_the_word_breaks_a_leading_space_rule_would_drop():
    tok = Metaspace()
    ids = [0, 1, 2, 3, 4, 5, 6, 7]
    pieces = _stream(tok, ids, [1] * len(ids))
    assert "".join(pieces) == tok.decode(ids) == "the cats sat on a mat."
    assert pieces[:3] == ["the", " cat", "s"]


@pytest.mark.parametrize("n", [2000])
def test_decoding_cost_per_token_is_bounded(n):
    """Whole-output decoding would pass n(n+1)/2 = 2M tokens to the tokenizer for 2,000 tokens."""
    rng = random.Random(0)
    text = "".join(rng.choice("abcdé€😀 ") for _ in range(n // 2))
    ids = BYTES.encode(text)[:n]
    tok = NoTailCheck()
    pieces = _stream(tok, ids, [1] * (len(ids) - 1))
    assert "".join(pieces) == BYTES.decode(ids)
    assert tok.num_decoded <= 4 * MAX_HELD_TOKENS * len(ids), tok.num_decoded
