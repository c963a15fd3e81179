"""The resume-point part of ``PrefixIndex.match``, and its walk over Python ints for short prompts.

``PrefixIndex.match`` has two walks that return the same ``MatchResult``:

    numpy walk   uint64 records of the flushed tables, a fixed number of numpy
                 calls whatever the prompt length (``disagg.router.index``)
    int walk     the rows' int masks (``DigestTable.prefix_ints``), C-level
                 passes (map, accumulate) of big-int operations per block, and
                 no flush of the tables' numpy side

A numpy call costs about a microsecond whatever its size and a flush a few
dozen of them, so for the short prompts of most requests (tens of blocks)
the int walk is the cheaper one; long prompts take the numpy walk
(``PrefixIndex.int_walk_blocks``). In the int walk, with le_t[i] the
candidates reading block i no slower than tier t::

    le_t[i]   = m_0[i] | ... | m_t[i]                     (tier masks of MLA row i)
    cum_t[k]  = cand & le_t[0] & ... & le_t[k - 1]        reduce(and_, le_t[:k], cand)
    alive[k]  = cum_any[k]                                readers of blocks 0..k-1 (alive[0] = cand)

which is the numpy walk's ``cum[t, k - 1]`` (and ``c.mask`` for k = 0).
Both walks hand their resume points to ``visit_points`` (the numpy walk's
former ``_resolve`` loop), so what is resolved from the points is one code.

NOTES
1. ``walk_ints`` and the numpy walk give equal ``MatchResult`` fields for every
   index state and request (tests/router/test_walk.py checks them on random
   states, hybrid and not, with node and global tiers and tail probes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import reduce
from itertools import accumulate, compress, repeat
from operator import and_, itemgetter, or_
from typing import Protocol

import numpy as np

from disagg.router.digest_table import REC_LINK, REC_MASKS, DigestTable
from disagg.router.match import _IntLengths
from disagg.router.types import TIERS, RouteRequest


class IndexTables(Protocol):
    """What the walk reads of a ``disagg.router.index.PrefixIndex``: its digest tables."""

    hybrid: bool  # KDA checkpoints gate resume points
    _mla: DigestTable  # MLA blocks by block digest
    _kda: DigestTable  # KDA checkpoints by prefix digest
    _tail: DigestTable  # MLA tails by tail digest


@dataclass(slots=True)
class _Candidates:
    """A candidate list as bits and as the word arrays the walk indexes with."""

    key: tuple[str, ...]  # the worker ids, in order
    bits: list[int]  # bit of each candidate
    mask: int  # OR of their bits
    words: np.ndarray  # mask as uint64 words (num_words,)
    word: np.ndarray  # word of each candidate's bit (intp)
    shift: np.ndarray  # position of the bit inside its word (uint64)
    rank: dict[int, list[int]]  # bit -> positions in the list holding it

_NO_TIER = -1
_ANY = 3  # tier index of "readable from any tier"
_REMOTE = len(TIERS) - 1
_POSITION = itemgetter(0)
_LINK = itemgetter(REC_LINK)
_M = [itemgetter(REC_MASKS + t) for t in range(len(TIERS))]
_bit_count = int.bit_count

Point = tuple[int, int, int, list[list[int]]]  # (position, blocks read, workers, le ints of the extra objects)


def tail_points(index: IndexTables, c: _Candidates, request: RouteRequest, alive_at: Callable[[int], int],
                bs: int, plen: int, n: int) -> list[Point]:
    """Unaligned resume points the request probes: (p, k, workers, le ints of tail [and checkpoint]), furthest first.

    ``alive_at(k)``: candidates reading blocks 0..k-1 (k <= n, the walk's leading readable blocks).
    """
    points = []
    for probe in request.tail_probes:
        p = probe.position
        k = p // bs
        if not 0 < p < plen or not p % bs or k > n:
            continue
        t = index._tail.row(probe.digest)
        if t is None:
            continue
        objs = [index._tail.int_masks(t)]
        if index.hybrid:
            kr = index._kda.row(probe.digest)
            if kr is None:
                continue
            objs.append(index._kda.int_masks(kr))
        les = [list(accumulate(o, or_)) for o in objs]  # readable no slower than t, per object
        km = alive_at(k)
        for le in les:
            km &= le[_ANY]
        if km:
            points.append((p, k, km, les))
    points.sort(key=_POSITION, reverse=True)  # ties keep probe order
    return points


def visit_points(index: IndexTables, c: _Candidates, at_l: list[int], km_l: list[int], ck_l: list[int] | None,
                 tails: list[Point], fast_at: Callable[[int], list[int]], bs: int
                 ) -> tuple[list[int], list[int], list[int]]:
    """Furthest resume point and its slowest tier per candidate (0 and -1: none), and who has one.

    Aligned points: block ``at_l[j]`` ends at a point (k = at_l[j] + 1) that the
    workers ``km_l[j]`` can read, its checkpoint row ``ck_l[j]`` (None: not
    hybrid, no checkpoint object); ``tails`` the unaligned points. They are
    visited furthest first; a worker takes the first one it can read, at the
    fastest tier t with the worker in ``fast_at(k)[t]`` (readers of blocks
    0..k-1 no slower than t) and in every extra object's le_t. Masks are
    Python ints here: few points are ever resolved.
    """
    kda = index._kda
    n_c = len(c.bits)
    res, tier = [0] * n_c, [_NO_TIER] * n_c
    got: list[int] = []  # candidate positions given a point
    todo = 0  # workers with a point, not yet given their furthest
    for km in km_l:
        todo |= km
    for pt in tails:
        todo |= pt[2]
    rank, remote = c.rank, _REMOTE
    j = len(at_l) - 1
    while todo:
        if tails and (j < 0 or tails[0][0] > (at_l[j] + 1) * bs):
            p, k, km, objs = tails.pop(0)
        else:
            k, km = at_l[j] + 1, km_l[j]
            p = k * bs
            objs = [list(accumulate(kda.int_masks(ck_l[j]), or_))] if ck_l is not None else []
            j -= 1
        new = km & todo
        if not new:
            continue
        todo &= ~new
        fast = fast_at(k)  # readers of blocks 0..k-1 per tier
        rest = new
        for t in range(remote):
            m = rest & fast[t]
            for o in objs:
                m &= o[t]
            for b in _bits(m):
                for x in rank[b]:
                    res[x], tier[x] = p, t
                    got.append(x)
            rest &= ~m
            if not rest:
                break
        for b in _bits(rest):
            for x in rank[b]:
                res[x], tier[x] = p, remote
                got.append(x)
    return res, tier, got


def _bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def walk_ints(index: IndexTables, c: _Candidates, request: RouteRequest, common_min: int | None
              ) -> tuple[int, list[int], list[int], _IntLengths]:
    """``match``'s walk on the rows' int masks: (common blocks, resumable, tiers, mla_blocks)."""
    bs, plen = request.block_size, request.prompt_len
    kda = index._kda
    recs = index._mla.prefix_ints(request.block_hashes)
    kda.settle()
    index._tail.settle()
    cand = c.mask
    m0, m1, m2, m3 = _M
    le3 = list(map(or_, map(or_, map(or_, map(m0, recs), map(m1, recs)), map(m2, recs)), map(m3, recs)))
    n = len(recs)
    common = 0
    if common_min is not None:  # leading blocks that at least common_min candidates read
        common = n
        for i, held in enumerate(map(_bit_count, map(and_, le3, repeat(cand)))):
            if held < common_min:
                common = i
                break
    alive = list(accumulate(le3, and_, initial=cand))
    if n and not alive[n]:  # nobody reads the whole run: cut it where the last reader stops
        n = alive.index(0, 1) - 1
        del alive[n + 1:]
        del recs[n:]
    limit = max(min(n, (plen - 1) // bs), 0)  # aligned points p = k * bs < plen
    if index.hybrid:
        links = list(map(_LINK, recs[:limit]))  # checkpoint row + 1, 0: none
        at_l = list(compress(range(limit), links))  # block i ends at a checkpoint: a point with k = i + 1
        ck_l: list[int] | None = [links[i] - 1 for i in at_l]
        kda_masks = kda.int_masks
        km_l = [alive[i + 1] & _any_tier(kda_masks(r)) for i, r in zip(at_l, ck_l, strict=True)]
    else:  # any block prefix resumes: a point where a run of alive ends
        ends = [i for i in range(n - 1) if alive[i + 1] != alive[i + 2]]
        if n:
            ends.append(n - 1)
        km_all = [alive[e + 1] & ~alive[e + 2] if e < n - 1 else alive[e + 1] for e in ends]
        at_l, km_l, ck_l = [], [], None
        for e, km in zip(ends, km_all, strict=True):
            a = min(e, limit - 1)
            if a >= 0:
                at_l.append(a)
                km_l.append(km)

    def fast_at(k: int) -> list[int]:  # cum_t[k] for t < remote: few points are resolved, each folds its k blocks
        head = recs[:k]
        le0 = list(map(m0, head))
        le1 = list(map(or_, le0, map(m1, head)))
        return [reduce(and_, le0, cand), reduce(and_, le1, cand),
                reduce(and_, map(or_, le1, map(m2, head)), cand)]

    tails = tail_points(index, c, request, alive.__getitem__, bs, plen, n)
    resumable, tiers, _ = visit_points(index, c, at_l, km_l, ck_l, tails, fast_at, bs)
    return common, resumable, tiers, _IntLengths(alive[1:], c.bits)


def _any_tier(masks: list[int]) -> int:
    return masks[0] | masks[1] | masks[2] | masks[3]
