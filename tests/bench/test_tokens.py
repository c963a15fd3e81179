"""Synthetic tokens: determinism, ranges, truncation, salting, text mode."""

from __future__ import annotations

import numpy as np

from disagg.tools.bench.tokens import TokenFactory, shared_hash_ids
from disagg.tools.bench.trace import TraceRecord


def test_same_id_same_tokens_and_range() -> None:
    f = TokenFactory(block_size=8, vocab_size=50, first_id=10, seed=1)
    a = f.token_array([3, 4], 16)
    b = f.token_array([9, 3], 16)
    assert (a[:8] == b[8:]).all() and not (a[8:] == b[:8]).all()
    assert a.min() >= 10 and a.max() < 50
    assert (f.token_array([3, 4], 11) == a[:11]).all()  # truncated to input_length
    assert not (
        TokenFactory(block_size=8, vocab_size=50, first_id=10, seed=2).token_array([3], 8) == a[:8]
    ).all()


def test_salt_changes_unique_blocks_only() -> None:
    recs = [
        TraceRecord("a", 0, 0, 0, 24, 1, [0, 1, 2], block_size=8),
        TraceRecord("b", 0, 0, 0, 24, 1, [0, 1, 7], block_size=8),
        TraceRecord("a.sub0", 0, 0, 0, 16, 1, [0, 2], parent_session="a", block_size=8),
    ]
    shared = shared_hash_ids(recs)
    assert shared == frozenset({0, 1})  # the subagent shares id 2 within its own family
    f = TokenFactory(block_size=8, shared_ids=shared)
    plain, salted = f.prompt_ids(recs[0]), f.prompt_ids(recs[0], salt=5)
    assert (plain[:16] == salted[:16]).all() and not (plain[16:] == salted[16:]).all()
    assert (f.prompt_ids(recs[0], salt=5) == salted).all()
    assert not (f.prompt_ids(recs[0], salt=6)[16:] == salted[16:]).all()
    keys = f.block_keys([0, 1, 2], salt=5)
    assert keys[0] == 0 and keys[1] == 1 and keys[2] != 2


def test_text_mode_is_deterministic_words() -> None:
    f = TokenFactory(block_size=4)
    rec = TraceRecord("a", 0, 0, 0, 10, 1, [1, 2, 3], block_size=4)
    text = f.prompt_text(rec)
    assert text == f.prompt_text(rec) and len(text.split()) == 10
    assert text != f.prompt_text(rec, salt=1)
    assert isinstance(f.prompt_ids(rec), np.ndarray)
