"""Digest -> row table with per-tier worker masks: the storage behind ``PrefixIndex``.

Each stored object (an MLA block, a tail or a KDA checkpoint, keyed by its
16-byte digest) owns a row. A row is one uint64 record:

    rec[row] = | lo | hi | link + 1 | masks[tier 0] ... masks[tier 3] |     (3 + 4 * num_words words)

    lo, hi     the digest's two 64-bit halves (a lookup verifies both)
    link       a row of another table (PrefixIndex: the KDA checkpoint at an MLA
               block's digest); stored + 1, 0 = none
    masks[t]   num_words words: bit b of word j set when worker 64 j + b can read the
               object from tier t

Two ways in:

    row(digest)        one digest (the event path): a Python dict
    find(digests)      a prompt's digests at once (the walk): a bucketed hash table in
                       numpy, probed for all digests in one round

        bucket(d)    = lo(d) & (num_buckets - 1)            lo: low 64 bits of the digest
        _buckets[b]  = | lo_0 .. lo_7 | row_0 + 1 .. row_7 + 1 |   (128 bytes, entries < _fill[b])
        _spill[b]    = digests of bucket b held only in the dict

    One gather of a bucket per digest, then one gather of the rows' records
    (cache lines fetched in parallel by numpy's C loop) finds a 500-block
    prompt in a table of a million digests in a dozen numpy calls, where a
    dict lookup per block pays several dependent cache misses. The record's
    own lo and hi confirm the row (an empty entry reads row 0, which the
    check rejects unless the digest is row 0's). A digest not found in a
    bucket that spilled (or whose lo matched another digest's) is looked up
    in the dict, so the answer is always exact. ``find_prefix`` stops at the
    first absent digest (what the walk needs) and asks the dict only there.

Digests of another length than 16 bytes are folded to 16 bytes with
blake2b, the same way on both paths (a request's digests share one length).

The event path touches Python objects only (the dict, a per-row list of
ints, lists of pending bucket changes); ``flush`` writes the changed records
and places and removes bucket entries in bulk, and every numpy read
(``find``, ``rec``, ``masks``) runs it first.

NOTES
1. After ``flush``, every digest in ``_row`` is either in exactly one entry of
   its bucket or counted in that bucket's ``_spill`` (never both), and a
   bucket's entries are ``0 .. _fill[b] - 1`` (removals compact the bucket).
   Before it, rows inserted since are in ``_new`` and deleted rows that had
   been placed are in ``_gone``.
2. ``num_buckets * BUCKET_SLOTS >= 2 * len(self)`` (load <= 1/2: about 2% of
   buckets spill); the table doubles and refills when a digest would break it.
3. A row is live iff some mask of it is non-zero (``PrefixIndex`` frees a row
   whose masks become zero); a freed row's record is zero and the row is reused.
4. After ``flush``, ``rec[row] == _ints[row]`` (as uint64 words) for every row;
   rows changed since are listed in ``_dirty``.
5. A free row's record is zero, so the record check cannot confirm the
   all-zero digest: lookups of it always go to the dict.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

DIGEST_BYTES = 16
WORD_BITS = 64
FULL_WORD = (1 << WORD_BITS) - 1
NUM_TIER_COLUMNS = 4
BUCKET_SLOTS = 8  # entries per hash bucket
REC_LO, REC_HI, REC_LINK, REC_MASKS = 0, 1, 2, 3  # record columns (masks from REC_MASKS on)
assert (REC_MASKS, NUM_TIER_COLUMNS) == (3, 4), "clear_bits reads the mask columns as v[3] .. v[6]"
_ZERO_KEY = bytes(DIGEST_BYTES)
_KEY_LEN = {DIGEST_BYTES}
BACKLOG = 1 << 15  # pending row changes that ``settle`` flushes
_all = np.logical_and.reduce  # ``a.all()`` without the method's Python wrapper
_any = np.logical_or.reduce
_HALVES = struct.Struct("=QQ").unpack  # (lo, hi) in native order, as numpy's uint64 view reads them
_OFFSETS = np.arange(BUCKET_SLOTS, 4096 * 2 * BUCKET_SLOTS, 2 * BUCKET_SLOTS)  # row i's "row + 1" part


def _entry_offsets(n: int) -> np.ndarray:
    """Flat offset of the "row + 1" half of row i of an (n, 2 * slots) gather."""
    if n <= len(_OFFSETS):
        return _OFFSETS[:n]
    return np.arange(BUCKET_SLOTS, n * 2 * BUCKET_SLOTS, 2 * BUCKET_SLOTS)


def digest_key(digest: bytes) -> bytes:
    """The 16-byte key of a digest (other lengths are folded with blake2b)."""
    if len(digest) == DIGEST_BYTES:
        return digest
    return hashlib.blake2b(digest, digest_size=DIGEST_BYTES).digest()


def mask_words(mask: int, num_words: int) -> np.ndarray:
    """A worker bitmask as ``num_words`` uint64 words (a negative mask: every bit set)."""
    return np.array([(mask >> (WORD_BITS * j)) & FULL_WORD for j in range(num_words)], np.uint64)


def words_mask(words: np.ndarray) -> int:
    """Inverse of ``mask_words`` for non-negative masks."""
    if words.shape[-1] == 1:
        return int(words[0])
    return int.from_bytes(words.astype("<u8").tobytes(), "little")


class DigestTable:
    """Rows of tier masks, found by digest (see module docstring).

    Args:
        num_words: 64-bit words per mask (64 workers per word).
        num_buckets: initial hash buckets (a power of two, grown as needed).
    """

    def __init__(self, num_words: int = 1, num_buckets: int = 128):
        if num_words < 1 or num_buckets < 1 or num_buckets & (num_buckets - 1):
            raise ValueError("num_words >= 1 and a power-of-two num_buckets required")
        self.num_words = num_words
        self._full = (1 << (WORD_BITS * num_words)) - 1  # every worker bit
        self._row: dict[bytes, int] = {}  # key -> row (the event path; every digest)
        self._digest_of: list[bytes | None] = []  # row -> key (None: free)
        self._free: list[int] = []  # freed rows, reused first
        self._ints: list[list[int] | None] = []  # row -> [lo, hi, link + 1, mask_0 .. mask_3] (NOTE 4)
        self._dirty: list[int] = []  # rows changed since the last flush (repeats allowed)
        self._new: dict[int, int] = {}  # row -> lo of digests inserted since the last flush (not in buckets)
        self._gone: list[tuple[int, int]] = []  # (bucket, row + 1) of placed digests deleted since
        self._rec = np.zeros((num_buckets * BUCKET_SLOTS // 2, REC_MASKS + NUM_TIER_COLUMNS * num_words), np.uint64)
        self._alloc_buckets(num_buckets)

    def _alloc_buckets(self, num_buckets: int) -> None:
        self._buckets = np.zeros((num_buckets, 2 * BUCKET_SLOTS), np.uint64)  # lo keys | row + 1 (0: empty)
        self._fill = np.zeros(num_buckets, np.int64)  # entries used, a prefix of the bucket
        self._spill = np.zeros(num_buckets, np.int64)  # digests of the bucket kept in the dict only
        self._bucket_mask = num_buckets - 1

    def __len__(self) -> int:
        return len(self._row)

    def row(self, digest: bytes) -> int | None:
        """Row of a digest, or None."""
        return self._row.get(digest_key(digest))

    def digest(self, row: int) -> bytes:
        d = self._digest_of[row]
        assert d is not None, f"row {row} is free"
        return d

    @property
    def num_rows(self) -> int:
        """Rows ever allocated (live or free): the valid prefix of ``rec``."""
        return len(self._digest_of)

    @property
    def rec(self) -> np.ndarray:
        """All records, (row, column) uint64 (flushed; see module docstring)."""
        self.flush()
        return self._rec

    def masks(self, row: int) -> np.ndarray:
        """Tier masks of one row as words, (tier, word)."""
        return self.rec[row, REC_MASKS:].reshape(NUM_TIER_COLUMNS, self.num_words)

    def int_masks(self, row: int) -> list[int]:
        """Tier masks of one row as ints (bit b: worker b)."""
        v = self._ints[row]
        assert v is not None, f"row {row} is free"
        return v[REC_MASKS:]

    def rec_masks(self, recs: np.ndarray) -> np.ndarray:
        """Tier masks of gathered records, (row, tier, word)."""
        return recs[:, REC_MASKS:].reshape(len(recs), NUM_TIER_COLUMNS, self.num_words)

    def link(self, row: int) -> int | None:
        v = self._ints[row]
        assert v is not None, f"row {row} is free"
        return v[REC_LINK] - 1 if v[REC_LINK] else None

    def set_link(self, row: int, other: int | None) -> None:
        v = self._ints[row]
        assert v is not None, f"row {row} is free"
        v[REC_LINK] = 0 if other is None else other + 1
        self._dirty.append(row)

    # ---- vectorized lookup -----------------------------------------------------------
    def _probe(self, digests: list[bytes]) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """One vectorized round without the dict fallback: (joined keys, buckets, rows, records, found,
        lo_eq), lo_eq[i, j] true when entry j of digest i's bucket has its lo (see ``_unsure``)."""
        self.flush()
        n = len(digests)
        buf = b"".join(digests)
        if len(buf) != DIGEST_BYTES * n:
            buf = b"".join(map(digest_key, digests))
        keys = np.frombuffer(buf, np.uint64).reshape(n, 2)
        lo = keys[:, 0]
        b = lo.view(np.int64) & self._bucket_mask  # bucket of each digest (an index array)
        got = self._buckets.take(b, axis=0)  # (n, 2 * slots)
        eq = got[:, :BUCKET_SLOTS] == lo[:, None]
        at = eq.argmax(axis=1)  # first entry with the same lo (else 0)
        at += _entry_offsets(n)  # flat index of that entry's row + 1
        rows = got.view(np.int64).take(at)
        rows -= 1  # an empty entry: -1, read as row 0 below and rejected by the check (NOTE 5)
        recs = self._rec.take(rows, axis=0, mode="clip")
        found = recs[:, REC_LO] == lo  # the record holds this very digest: both halves (two 1-D
        found &= recs[:, REC_HI] == keys[:, 1]  # compares: a reduce along a 2-wide axis costs more)
        if _ZERO_KEY in buf:  # NOTE 5 (a byte search; aligned hits are checked here)
            found &= keys.any(axis=1)
        return buf, b, rows, recs, found, eq

    def _unsure(self, buf: bytes, b: int, i: int, lo_eq: np.ndarray) -> bool:
        """Whether digest i, not confirmed by the probe, may still be held (spilled bucket or shared lo)."""
        return bool(self._spill[b] > 0 or buf[DIGEST_BYTES * i:DIGEST_BYTES * (i + 1)] == _ZERO_KEY
                    or _any(lo_eq[i]))

    def find(self, digests: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``digests`` (int64, -1 where absent) and their records (zeros where absent)."""
        if not digests:
            return np.empty(0, np.int64), self._rec[:0]
        buf, b, rows, recs, found, lo_eq = self._probe(digests)
        if _all(found):
            return rows, recs
        miss = (~found).nonzero()[0]
        rows[miss] = -1
        recs[miss] = 0
        get = self._row.get
        for i, bi in zip(miss.tolist(), b[miss].tolist(), strict=True):
            if self._unsure(buf, bi, i, lo_eq):  # a spilled bucket, or another digest with the same lo: ask the dict
                r = get(buf[DIGEST_BYTES * i:DIGEST_BYTES * (i + 1)], -1)
                if r >= 0:
                    rows[i], recs[i] = r, self._rec[r]
        return rows, recs

    def find_prefix(self, digests: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """``find`` cut before the first absent digest: the rows and records of the leading present run."""
        if not digests:
            return np.empty(0, np.int64), self._rec[:0]
        buf, b, rows, recs, found, lo_eq = self._probe(digests)
        n = len(digests)
        i = n if _all(found) else int(found.argmin())
        while i < n:  # digest i is not confirmed: only the dict can still have it
            unsure = self._unsure(buf, int(b[i]), i, lo_eq)
            r = self._row.get(buf[DIGEST_BYTES * i:DIGEST_BYTES * (i + 1)], -1) if unsure else -1
            if r < 0:
                return rows[:i], recs[:i]
            rows[i], recs[i] = r, self._rec[r]
            found[i] = True
            i = n if _all(found) else int(found.argmin())
        return rows, recs

    def prefix_ints(self, digests: list[bytes]) -> list[list[int]]:
        """``find_prefix`` on the event side: the int records (``_ints``, NOTE 4) of the leading run
        of present digests, read-only, without a flush (``settle`` bounds what is pending)."""
        keys = digests if set(map(len, digests)) <= _KEY_LEN else list(map(digest_key, digests))
        rows = list(map(self._row.get, keys))
        try:
            del rows[rows.index(None):]
        except ValueError:
            pass
        self.settle()
        return list(map(self._ints.__getitem__, rows))  # type: ignore[arg-type]

    def settle(self) -> None:
        """``flush`` once more than ``BACKLOG`` row changes are pending (readers of the int side
        alone would otherwise let the pending lists grow without bound)."""
        if len(self._dirty) > BACKLOG:
            self.flush()

    def lookup(self, digests: list[bytes]) -> np.ndarray:
        """Rows of ``digests`` (int64, -1 where absent)."""
        return self.find(digests)[0]

    def flush(self) -> None:
        """Apply the bucket changes (NOTE 1) and write the changed records (NOTE 4)."""
        if self._gone:
            self._remove_entries()
        if self._new:
            self._place_entries()
        if not self._dirty:
            return
        rows = list(dict.fromkeys(self._dirty))
        self._dirty.clear()
        zero = [0] * (REC_MASKS + NUM_TIER_COLUMNS)
        vals = [v if v is not None else zero for v in map(self._ints.__getitem__, rows)]
        idx = np.array(rows, np.intp)
        if self.num_words == 1:
            self._rec[idx] = np.array(vals, np.uint64)
        else:
            w = self.num_words
            out = np.zeros((len(rows), REC_MASKS + NUM_TIER_COLUMNS * w), np.uint64)
            for i, v in enumerate(vals):
                out[i, :REC_MASKS] = v[:REC_MASKS]
                out[i, REC_MASKS:] = np.concatenate([mask_words(m, w) for m in v[REC_MASKS:]])
            self._rec[idx] = out

    # ---- insert / delete -----------------------------------------------------------------
    def insert(self, digest: bytes) -> int:
        """Row of ``digest``, allocating an empty one (masks 0, no link) if new."""
        key = digest_key(digest)
        row = self._row.get(key)
        if row is not None:
            return row
        if 2 * (len(self._row) + 1) > self._buckets.size // 2:  # NOTE 2
            self._rehash(2 * len(self._buckets))
        lo, hi = _HALVES(key)
        ints = [lo, hi, 0, 0, 0, 0, 0]
        if self._free:
            row = self._free.pop()
            self._digest_of[row] = key
            self._ints[row] = ints
        else:
            row = len(self._digest_of)
            self._digest_of.append(key)
            self._ints.append(ints)
            if row >= len(self._rec):
                self._rec = np.concatenate([self._rec, np.zeros_like(self._rec)])
        self._row[key] = row
        self._dirty.append(row)
        self._new[row] = lo
        return row

    def delete(self, digest: bytes) -> int | None:
        """Free the row of ``digest``; returns it (None if absent)."""
        key = digest_key(digest)
        row = self._row.pop(key, None)
        if row is None:
            return None
        if self._new.pop(row, None) is None:  # placed (or spilled) at a flush: remove it at the next
            self._gone.append((_HALVES(key)[0] & self._bucket_mask, row + 1))
        self._digest_of[row] = None
        self._ints[row] = None
        self._dirty.append(row)
        self._free.append(row)
        return row

    def _remove_entries(self) -> None:
        """Drop the entries of deleted digests and compact their buckets (spilled ones: count down)."""
        b, row1 = (np.array(c, np.int64) for c in zip(*self._gone, strict=True))
        self._gone.clear()
        hit = self._buckets[b, BUCKET_SLOTS:] == row1[:, None].astype(np.uint64)
        found = hit.any(axis=1)
        spilled = b[~found]
        np.subtract.at(self._spill, spilled, 1)
        assert (self._spill[spilled] >= 0).all(), "a deleted digest was neither in its bucket nor spilled"
        at = hit.argmax(axis=1)[found]
        self._buckets[b[found], at] = 0
        self._buckets[b[found], BUCKET_SLOTS + at] = 0
        touched = np.unique(b[found])
        rows = self._buckets[touched]
        keep = rows[:, BUCKET_SLOTS:] != 0
        order = np.argsort(~keep, axis=1, kind="stable")  # the kept entries first, in their order
        rows[:, :BUCKET_SLOTS] = np.take_along_axis(rows[:, :BUCKET_SLOTS], order, axis=1)
        rows[:, BUCKET_SLOTS:] = np.take_along_axis(rows[:, BUCKET_SLOTS:], order, axis=1)
        self._buckets[touched] = rows
        self._fill[touched] = keep.sum(axis=1)

    def _place_entries(self) -> None:
        """Enter the digests inserted since the last flush into their buckets (full buckets spill)."""
        rows = np.fromiter(self._new.keys(), np.int64, len(self._new))
        lo = np.fromiter(self._new.values(), np.uint64, len(self._new))
        self._new.clear()
        b = (lo & np.uint64(self._bucket_mask)).astype(np.int64)
        order = np.argsort(b, kind="stable")
        b, lo, rows = b[order], lo[order], rows[order]
        slot = self._fill[b] + np.arange(len(b)) - np.searchsorted(b, b)  # after the bucket's current entries
        fits = slot < BUCKET_SLOTS
        bf, sf = b[fits], slot[fits]
        self._buckets[bf, sf] = lo[fits]
        self._buckets[bf, BUCKET_SLOTS + sf] = (rows[fits] + 1).astype(np.uint64)
        np.add.at(self._fill, bf, 1)
        np.add.at(self._spill, b[~fits], 1)

    def _rehash(self, num_buckets: int) -> None:
        """Refill every digest into ``num_buckets`` buckets."""
        keys = list(self._row)
        rows = np.fromiter(self._row.values(), np.int64, len(keys))
        self._alloc_buckets(num_buckets)
        self._new.clear()
        self._gone.clear()
        if not keys:
            return
        lo = np.frombuffer(b"".join(keys), np.uint64)[::2]
        b = (lo & np.uint64(self._bucket_mask)).astype(np.int64)
        order = np.argsort(b, kind="stable")
        b, lo, rows = b[order], lo[order], rows[order]
        slot = np.arange(len(b)) - np.searchsorted(b, b)  # rank inside the bucket
        fits = slot < BUCKET_SLOTS
        bf, sf = b[fits], slot[fits]
        self._buckets[bf, sf] = lo[fits]
        self._buckets[bf, BUCKET_SLOTS + sf] = (rows[fits] + 1).astype(np.uint64)
        self._fill[:] = np.minimum(np.bincount(b, minlength=num_buckets), BUCKET_SLOTS)
        self._spill[:] = np.bincount(b[~fits], minlength=num_buckets)

    # ---- masks ---------------------------------------------------------------------------
    def change(self, row: int, tier: int, set_mask: int, clear_mask: int) -> bool:
        """mask[row, tier] <- (mask & ~clear) | set (-1: every worker); returns whether the row is still live."""
        v = self._ints[row]
        assert v is not None, f"row {row} is free"
        col = REC_MASKS + tier
        old = v[col]
        new = ((old & ~clear_mask) | set_mask) & self._full
        if new != old:
            v[col] = new
            self._dirty.append(row)
        return any(v[REC_MASKS:])

    def add_bits(self, key: bytes, tier: int, mask: int) -> int:
        """``change(row, tier, mask, 0)`` by key, inserting the row when ``key`` is new.

        ``key`` is a 16-byte key (``digest_key``), ``mask`` non-zero. Returns the row
        if it was inserted (the caller links it), else -1.
        """
        row = self._row.get(key)
        inserted = -1
        if row is None:
            row = inserted = self.insert(key)
        v = self._ints[row]
        col = REC_MASKS + tier
        old = v[col]
        new = (old | mask) & self._full
        if new != old:
            v[col] = new
            self._dirty.append(row)
        elif inserted >= 0 and not new:  # no bit of the table's words: the new row stays empty (NOTE 3)
            self.delete(key)
            return -1
        return inserted

    def clear_bits(self, key: bytes, tier: int, mask: int) -> bool:
        """``change(row, tier, 0, mask)`` by key (16 bytes), freeing a row left with no mask (NOTE 3).

        Returns whether a row was freed (an absent key: nothing to clear, False).
        """
        row = self._row.get(key)
        if row is None:
            return False
        v = self._ints[row]
        col = REC_MASKS + tier
        old = v[col]
        new = old & ~mask & self._full
        if new != old:
            v[col] = new
            self._dirty.append(row)
        if v[3] or v[4] or v[5] or v[6]:  # the NUM_TIER_COLUMNS masks after REC_MASKS
            return False
        self.delete(key)
        return True

    def widen(self, num_words: int, global_tiers: tuple[int, ...]) -> None:
        """Grow masks to ``num_words`` words; objects in a global-scope tier get the new bits too."""
        if num_words <= self.num_words:
            return
        self.num_words = num_words
        self._full = full = (1 << (WORD_BITS * num_words)) - 1
        for v in self._ints:
            if v is not None:
                for t in global_tiers:
                    if v[REC_MASKS + t]:
                        v[REC_MASKS + t] = full  # a global mask is every bit
        self._rec = np.zeros((len(self._rec), REC_MASKS + NUM_TIER_COLUMNS * num_words), np.uint64)
        self._dirty = [r for r, v in enumerate(self._ints) if v is not None]
