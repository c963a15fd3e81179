"""DigestTable: the vectorized lookup agrees with the dict path, exactly, through growth and deletes."""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import pytest

from disagg.router.digest_table import (
    BUCKET_SLOTS,
    REC_HI,
    REC_LINK,
    REC_LO,
    REC_MASKS,
    DigestTable,
    digest_key,
    mask_words,
    words_mask,
)


def _check(t: DigestTable, ref: dict[bytes, int], queries: list[bytes]) -> None:
    rows, recs = t.find(queries)
    assert rows.tolist() == [ref.get(q, -1) for q in queries]
    for q, row, rec in zip(queries, rows.tolist(), recs, strict=True):
        if row < 0:
            assert not rec.any()
        else:
            assert rec.tolist() == t.rec[row].tolist()
            assert rec[REC_HI] == int.from_bytes(digest_key(q)[8:], sys.byteorder)
            assert rec[REC_LO] == int.from_bytes(digest_key(q)[:8], sys.byteorder)
    for start in range(0, len(queries), 37):  # find_prefix: the leading run of present digests, exactly
        chunk = queries[start:start + 37]
        want = next((i for i, q in enumerate(chunk) if q not in ref), len(chunk))
        p_rows, p_recs = t.find_prefix(chunk)
        assert p_rows.tolist() == [ref[q] for q in chunk[:want]]
        assert p_recs.tolist() == [t.rec[ref[q]].tolist() for q in chunk[:want]]
    held = [q for q in queries if q in ref]
    for tail in ([], [os.urandom(16)], [os.urandom(16)] + held[:3]):  # a long run, then a miss
        p_rows, _ = t.find_prefix(held + tail)
        assert p_rows.tolist() == [ref[q] for q in held]


@pytest.mark.parametrize("seed", range(3))
def test_find_matches_the_dict_through_spills_rehashes_and_deletes(seed):
    rng = random.Random(seed)
    t, ref = DigestTable(num_buckets=1), {}  # one bucket: spills and rehashes from the start
    pool = [rng.randbytes(16) for _ in range(1500)]
    pool += [bytes([i]) * 16 for i in range(4)] + [bytes(16)]  # low-entropy keys, the all-zero digest
    pool += [b"\x01" * 8 + bytes([i]) * 8 for i in range(12)]  # one shared lo: a bucket over capacity
    for step in range(6000):
        d = rng.choice(pool)
        if rng.random() < 0.6:
            row = t.insert(d)
            assert ref.setdefault(d, row) == row
            assert t.change(row, step % 4, 1 << (step % 64), 0)
        else:
            assert t.delete(d) == ref.pop(d, None)
        if step % 500 == 0:
            _check(t, ref, rng.sample(pool, 300))
    _check(t, ref, pool)
    assert len(t) == len(ref)
    assert 2 * len(t) <= t._buckets.shape[0] * BUCKET_SLOTS  # load <= 1/2 (NOTE 2)


def test_digests_of_other_lengths_and_a_shared_lo():
    t = DigestTable()
    short, long = b"abc", b"x" * 40
    a, b = b"\x07" * 8 + b"\x01" * 8, b"\x07" * 8 + b"\x02" * 8  # same lo, different hi
    rows = {d: t.insert(d) for d in (short, long, a)}
    assert t.lookup([short, long]).tolist() == [rows[short], rows[long]]  # folded the same way
    assert t.lookup([a, b]).tolist() == [rows[a], -1]  # hi tells them apart
    rows[b] = t.insert(b)
    assert t.lookup([b, a]).tolist() == [rows[b], rows[a]]
    assert t.row(b"abc") == rows[short] and t.row(b"nope") is None


def test_records_follow_masks_and_links():
    t = DigestTable()
    r0, r1 = t.insert(os.urandom(16)), t.insert(os.urandom(16))
    assert t.change(r0, 1, 0b101, 0) and t.change(r0, 3, -1, 0)  # -1: every worker
    t.set_link(r1, r0)
    assert t.rec[r0, REC_MASKS:].tolist() == [0, 0b101, 0, 2**64 - 1]
    assert t.rec[r1, REC_LINK] == r0 + 1 and t.link(r1) == r0
    assert not t.change(r1, 0, 0, -1)  # no mask set: the caller frees the row (NOTE 3)
    assert t.int_masks(r0) == [0, 0b101, 0, 2**64 - 1]
    assert t.change(r0, 1, 0, 0b100)  # still live (remote)
    assert t.masks(r0).tolist() == [[0], [0b001], [0], [2**64 - 1]]


def test_widen_keeps_masks_and_gives_global_objects_the_new_bits():
    t = DigestTable()
    r = t.insert(os.urandom(16))
    t.change(r, 0, 1 << 63, 0)
    t.change(r, 3, -1, 0)
    t.widen(2, global_tiers=(3,))
    t.change(r, 0, 1 << 64, 0)  # a worker of the second word
    m = t.masks(r)
    assert words_mask(m[0]) == (1 << 63) | (1 << 64)
    assert m[3].tolist() == [2**64 - 1, 2**64 - 1]
    assert mask_words(-1, 2).tolist() == [2**64 - 1, 2**64 - 1]


def test_bad_construction():
    with pytest.raises(ValueError):
        DigestTable(num_buckets=3)
    with pytest.raises(ValueError):
        DigestTable(num_words=0)


def test_find_on_an_empty_table():
    t = DigestTable()
    rows, recs = t.find([os.urandom(16) for _ in range(5)])
    assert rows.tolist() == [-1] * 5 and recs.shape == (5, REC_MASKS + 4) and not np.any(recs)


def test_add_and_clear_bits_are_change_by_key():
    t, ref = DigestTable(), DigestTable()
    rng = random.Random(5)
    keys = [os.urandom(16) for _ in range(40)]
    frees = 0
    for _ in range(2000):
        k, tier, mask = rng.choice(keys), rng.choice((0, 0, 1, 3)), 1 << rng.randrange(6) | 1 << rng.randrange(6)
        row = ref.row(k)
        if rng.random() < 0.6:
            new = row is None
            if new:
                row = ref.insert(k)
            ref.change(row, tier, mask, 0)
            assert t.add_bits(k, tier, mask) == (row if new else -1)
        else:
            mask = 63 if rng.random() < 0.5 else mask
            freed = row is not None and not ref.change(row, tier, 0, mask)
            if freed:
                ref.delete(k)
                frees += 1
            assert t.clear_bits(k, tier, mask) is freed
    assert frees > 20
    live = sorted(ref._row)
    assert sorted(t._row) == live
    assert [t.int_masks(t.row(k)) for k in live] == [ref.int_masks(ref.row(k)) for k in live]
    assert t.rec[[t.row(k) for k in live], REC_MASKS:].tolist() == ref.rec[[ref.row(k) for k in live], REC_MASKS:].tolist()
    assert t.prefix_ints(live) == [t._ints[t.row(k)] for k in live]
    gone = os.urandom(16)
    assert t.prefix_ints(live[:3] + [gone] + live[3:]) == [t._ints[t.row(k)] for k in live[:3]]


def test_settle_flushes_a_long_backlog_only(monkeypatch):
    import disagg.router.digest_table as dt

    monkeypatch.setattr(dt, "BACKLOG", 10)
    t = DigestTable()
    for i in range(5):
        t.add_bits(bytes([i + 1]) * 16, 0, 1)
    t.settle()
    assert t._dirty  # 5 pending rows: kept
    for i in range(5, 12):
        t.add_bits(bytes([i + 1]) * 16, 0, 1)
    t.settle()
    assert not t._dirty and not t._new
    assert t.find([bytes([3]) * 16])[0].tolist() == [2]
