"""Where each prompt prefix can be resumed: a per-tier, per-worker prefix index.

The index is fed by kv_transfer store events (stored / evicted / moved) and
answers, for one request and all candidate workers in a single walk over the
request's block digests, the *resumable* length:

    resumable(w) = max p  such that  MLA block h_i is on w for all i < p / bs
                                and  a KDA checkpoint at p is on w
    p aligned:    checkpoint key = h_{p / bs}
    p unaligned:  MLA tail tail(p) and checkpoint key tail(p), both named by a
                  TailProbe the caller supplies (the index never sees tokens)

    blocks   | h_1 | h_2 | h_3 | h_4 |tail|
    ckpt          ^ p=2bs      ^ p=4bs    ^ p=4bs+t  -> resumable = furthest ^

"On w" means: in w's device tier, or in a tier w can read (host and disk are
shared by the workers of a node, remote by everyone). The tier reported is
the *slowest* one the resume reads, since that transfer bounds the load time.

Data layout (sized for 64 workers x 1M blocks, a decision within ~1 ms): three
``DigestTable``s (``disagg.router.digest_table``), MLA blocks, KDA checkpoints
(keyed by prefix digest) and MLA tails (keyed by tail digest). A row holds one
worker bitmask per tier (dev, host, disk, remote) as uint64 words, bit b set
when worker b can read the object from that tier (node-shared tiers set the
bits of every worker of the node, a global tier every bit); an MLA row's
``link`` is the row of the KDA checkpoint at its digest (none: 0 in the record,
``link + 1`` is stored), so the walk finds checkpoints without a second lookup
per block.

The walk is numpy over the prompt's blocks, a fixed number of calls whatever
the prompt length or the index size:

    rows, recs = find(h_1 .. h_n)                    one vectorized hash probe, cut at the first miss
    le[t, i]   = dev | ... | tier t  of block i      "readable no slower than t" (OR along tiers)
    cum[t, k]  = cand & AND_{i<=k} le[t, i]          (AND along blocks, one accumulate)
    alive(k)   = cum[any, k - 1]                     candidates reading blocks 0..k-1
    tier(w, p) = min t with w in cum[t, p / bs - 1] & le_t(checkpoint) [& le_t(tail)]

The resume points (a linked checkpoint at block k, or a probed tail) are then
visited furthest first as Python ints (``disagg.router.walk.visit_points``):
each worker takes the first point it can read, at the fastest tier it can
read it from; the loop ends once every worker with a point has one (usually
at the first point). Results are ``disagg.router.match.MatchResult``
(re-exported here). Prompts of at most ``int_walk_blocks`` full blocks take
the same walk on the rows' Python int masks instead (``disagg.router.walk``:
no numpy call per step, no flush), which is cheaper below a few dozen blocks.

Producers that report one (tier, reporter) many times (the simulator's
tiers) apply their events through ``updater``: ``apply_update`` without the
per-event ``IndexUpdate`` and scope resolution (NOTE 7).

NOTES
1. Resumable length never exceeds the newest KDA checkpoint a worker holds
   below the prompt end (p < prompt_len: at least one token is computed).
2. A KDA checkpoint counts as present when its first head shard (tp0) is
   reported; writers publish and evict a checkpoint's shards together.
3. Register workers (``add_worker``) before their events arrive; a worker
   seen first in an event is registered as alone on its own node. An event
   reported by a node id (a node-shared tier) applies to the node's workers.
4. A row exists iff some tier mask of it is non-zero; a change that clears
   the last bit frees the row (``_change``).
5. ``_mla.link(_mla.row(h)) == _kda.row(h)`` (both None when there is no
   checkpoint at h) for every MLA row: a KDA insert or delete re-links the MLA
   row at its digest, a new MLA row links the current KDA row.
6. Worker bits are never reused; a worker past the last mask word widens
   every table by a word (global-tier objects get the new bits too).
7. ``updater(tier, reporter)(stored, kind, digest)`` changes the index exactly
   as ``apply_update`` of the same stored / evicted event: the same table
   operations in the same order; the reporter's scope mask is resolved again
   whenever a worker has joined since (``_members``), so a node-shared tier
   sees every worker of its node.
8. ``match``'s common prefix is what at least ``common_min`` candidates can resume, not only read:
   on a hybrid model, blocks read without a checkpoint at or past them are recomputed (NOTE 1).
   Counting readable blocks alone, a shared document whose MLA blocks sit in every node's host
   tier and whose checkpoints sit on one worker's device was "common", and the prefix scorer gave
   the worker that resumes it no credit over one that recomputes it (docs/router.md, "Round 32").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from disagg.router.digest_table import (
    DIGEST_BYTES,
    REC_LINK,
    REC_MASKS,
    WORD_BITS,
    DigestTable,
    digest_key,
    mask_words,
    words_mask,
)
from disagg.router.match import MatchResult, PrefixMatch, _Lengths
from disagg.router.types import TIER_INDEX, TIERS, RouteRequest
from disagg.router.walk import _Candidates, tail_points, visit_points, walk_ints

__all__ = ["IndexUpdate", "MatchResult", "PrefixIndex", "PrefixMatch", "tier_of", "update_from_event"]

SCOPES = ("worker", "node", "global")
DEFAULT_SCOPES = {"device": "worker", "host": "node", "disk": "node", "remote": "global"}
OBJECT_KINDS = ("mla", "tail", "kda")
_ANY = 3  # tier column of "readable from any tier" in le / cum
INT_WALK_BLOCKS = 64  # longest prompt (full blocks) walked on ints (disagg.router.walk); longer ones use numpy
_ONE = np.uint64(1)
_any = np.logical_or.reduce  # ``a.any()`` without the method's Python wrapper


def _popcount_swar(x: np.ndarray) -> np.ndarray:
    """Set bits per uint64 (numpy < 2 has no ``bitwise_count``)."""
    x = x - ((x >> _ONE) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return (x * np.uint64(0x0101010101010101)) >> np.uint64(56)


_popcount = getattr(np, "bitwise_count", _popcount_swar)


@dataclass(frozen=True, slots=True)
class IndexUpdate:
    """One store event reduced to what the index needs."""

    op: str  # "stored" | "evicted" | "moved"
    object_kind: str  # "mla" | "tail" | "kda"
    digest: bytes  # block digest (mla) or prefix digest (tail, kda)
    tier: str  # tier the event is about (destination for "moved")
    worker_id: str  # worker (or node, for node-shared tiers) that reported the event
    from_tier: str | None = None  # source tier of a "moved" event (None: not reported)


def tier_of(tier_name: str) -> str | None:
    """Index tier of a kv_transfer tier name ("host", "disk", "remote:<peer>", ...)."""
    base = tier_name.split(":", 1)[0]
    return base if base in TIER_INDEX else None


def update_from_event(event: Any) -> IndexUpdate | None:
    """Adapter from a kv_transfer ``StoreEvent``: the one place that knows its fields.

    Reads ``kind``, ``key`` (``str(ObjectKey)``), ``object_kind``, ``tier`` and
    ``worker_id``; a producer that knows the source tier of a ``moved`` event
    may also set ``from_tier`` (``StoreEvent`` does not carry one). Returns
    None for events the index ignores: non-zero shards of a sharded object,
    keys that are not object keys, tiers it does not know, and events
    without a reporter.
    """
    key: str = event.key
    parts = key.split(":")
    kind = event.object_kind or parts[0]
    if kind not in OBJECT_KINDS or len(parts) not in (2, 3) or not event.worker_id:
        return None
    if len(parts) == 3 and not (parts[2].startswith("tp0of") or parts[2].startswith("dcp0of")):
        return None
    tier = tier_of(event.tier)
    if tier is None:
        return None
    src = getattr(event, "from_tier", None)
    return IndexUpdate(event.kind, kind, bytes.fromhex(parts[1]), tier, event.worker_id,
                       tier_of(src) if src else None)


def _ints(words: np.ndarray) -> list[int]:
    """Rows of uint64 words (..., word) as ints, one per row."""
    if words.shape[-1] == 1:
        return words[..., 0].ravel().tolist()
    return [words_mask(w) for w in words.reshape(-1, words.shape[-1])]


def _le(masks: np.ndarray) -> np.ndarray:
    """Tier masks (n, tier, word) -> le (tier, n, word): readable no slower than tier t (an OR along tiers)."""
    le = np.empty((len(TIERS), *masks.shape[::2]), np.uint64)
    le[0] = masks[:, 0]
    for t in range(1, len(TIERS)):  # three ORs instead of bitwise_or.accumulate along the short tier axis
        np.bitwise_or(le[t - 1], masks[:, t], out=le[t])
    return le


class PrefixIndex:
    """Per-worker, per-tier index of MLA blocks, tails and KDA checkpoints.

    Args:
        scopes: tier -> "worker" | "node" | "global": who can read an object
            reported in that tier (defaults: device per worker, host and disk
            per node, remote global).
        hybrid: True for MLA + KDA models (a resume point needs a checkpoint);
            False for pure attention (any block prefix is resumable).
    """

    def __init__(self, scopes: dict[str, str] | None = None, hybrid: bool = True):
        self.scopes = dict(DEFAULT_SCOPES if scopes is None else scopes)
        for tier, scope in self.scopes.items():
            if tier not in TIER_INDEX or scope not in SCOPES:
                raise ValueError(f"bad tier scope {tier!r}: {scope!r}")
        self.hybrid = hybrid
        self._bit: dict[str, int] = {}  # worker id -> bit
        self._workers: list[str] = []  # bit -> worker id
        self._node_of: dict[str, str] = {}  # worker id -> node id
        self._node_mask: dict[str, int] = {}  # node id -> bits of its workers
        self._global_tiers = tuple(TIER_INDEX[t] for t, s in self.scopes.items() if s == "global")
        self._mla = DigestTable()  # MLA blocks by block digest
        self._kda = DigestTable()  # KDA checkpoints by prefix digest
        self._tail = DigestTable()  # MLA tails by tail digest
        self._tables = {"mla": self._mla, "kda": self._kda, "tail": self._tail}
        self._cand: _Candidates | None = None  # last candidate list
        self._members = 0  # workers registered (what updater() scope masks were resolved against)
        self.int_walk_blocks = INT_WALK_BLOCKS  # prompts of at most this many blocks take the int walk
        self.num_events = 0  # events applied
        self.num_ignored = 0  # events the adapter dropped (see update_from_event)

    # ---- membership -------------------------------------------------------
    def add_worker(self, worker_id: str, node_id: str | None = None) -> int:
        """Register a worker (idempotent); returns its bit. A known worker given another node
        moves there (one first seen before it reported its node was registered as its own)."""
        bit = self._bit.get(worker_id)
        if bit is not None:
            old = self._node_of[worker_id]
            if node_id is not None and node_id != old:
                left = self._node_mask[old] & ~(1 << bit)
                if left:
                    self._node_mask[old] = left
                else:
                    del self._node_mask[old]
                self._node_of[worker_id] = node_id
                self._node_mask[node_id] = self._node_mask.get(node_id, 0) | (1 << bit)
            return bit
        bit = len(self._workers)
        words = bit // WORD_BITS + 1
        if words > self._mla.num_words:  # NOTE 6
            for table in self._tables.values():
                table.widen(words, self._global_tiers)
        self._bit[worker_id] = bit
        self._workers.append(worker_id)
        node = node_id or worker_id
        self._node_of[worker_id] = node
        self._node_mask[node] = self._node_mask.get(node, 0) | (1 << bit)
        self._members += 1
        return bit

    def node_of(self, worker_id: str) -> str:
        return self._node_of.get(worker_id, worker_id)

    @property
    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def num_objects(self) -> dict[str, int]:
        return {"mla": len(self._mla), "kda": len(self._kda), "tail": len(self._tail)}

    def tier_masks(self, object_kind: str, digest: bytes) -> tuple[int, int, int, int] | None:
        """(device, host, disk, remote) worker bitmasks of one object, None if not indexed.

        A tier of global scope reports -1 (every worker, present and future).
        """
        table = self._tables[object_kind]
        row = table.row(digest)
        if row is None:
            return None
        masks = table.int_masks(row)
        return tuple(-1 if t in self._global_tiers and m else m for t, m in enumerate(masks))  # type: ignore[return-value]

    def node_holds_point(self, request: RouteRequest, position: int, node_id: str) -> bool:
        """Whether ``node_id``'s shared tiers (host, disk) hold the request's resume point at
        ``position``: its KDA checkpoint (with the MLA tail when unaligned), its last MLA block
        and the one halfway. A few lookups, not a walk: a session's blocks are evicted from its
        context's end first (LRU touches a prefix with every later point; retention demotes a
        session's private objects end first), so the last block stands for the rest."""
        bs = request.block_size
        k = position // bs
        if position <= 0 or k > len(request.block_hashes):
            return False
        hashes = request.block_hashes
        if position % bs == 0:
            point = self.tier_masks("kda", hashes[k - 1])
        else:
            digest = next((t.digest for t in request.tail_probes if t.position == position), None)
            point = self.tier_masks("tail", digest) if digest is not None else None
        node = self._node_mask.get(node_id, 0)
        for masks in (point, *(self.tier_masks("mla", hashes[i]) for i in {k - 1, k // 2} if 0 <= i < k)):
            if masks is None or not any(m == -1 or m & node for m in masks[1:3]):  # host, disk
                return False
        return True

    # ---- updates ------------------------------------------------------------
    def _scope_mask(self, tier: str, reporter: str) -> int:
        scope = self.scopes.get(tier, "worker")
        if scope == "global":
            return -1
        if reporter not in self._bit and reporter in self._node_mask:  # a node reports its tier
            return self._node_mask[reporter] if scope == "node" else 0
        bit = self.add_worker(reporter)
        return 1 << bit if scope == "worker" else self._node_mask[self._node_of[reporter]]

    def _change(self, kind: str, digest: bytes, tier: int, set_mask: int, clear_mask: int) -> None:
        table = self._tables[kind]
        row = table.row(digest)
        if row is None:
            if not set_mask:
                return
            row = table.insert(digest)
            if kind == "mla":  # NOTE 5
                table.set_link(row, self._kda.row(digest))
            elif kind == "kda":
                mla_row = self._mla.row(digest)
                if mla_row is not None:
                    self._mla.set_link(mla_row, row)
        if not table.change(row, tier, set_mask, clear_mask):  # NOTE 4
            table.delete(digest)
            if kind == "kda":
                mla_row = self._mla.row(digest)
                if mla_row is not None:
                    self._mla.set_link(mla_row, None)

    def apply_update(self, u: IndexUpdate) -> None:
        """Apply one update.

        A ``moved`` update without ``from_tier`` (kv_transfer's ``StoreEvent``
        names only the destination) is read the way ``StateStore`` emits it: a
        move down (host -> disk / remote) is a demotion, the object left the
        node-level tiers faster than the destination; a move up (promotion to
        host) is a copy, the slower copy stays.
        """
        kind = u.object_kind
        if kind not in self._tables:
            raise ValueError(f"unknown object kind {kind!r}")
        t = TIER_INDEX[u.tier]
        mask = self._scope_mask(u.tier, u.worker_id)
        if u.op == "stored":
            self._change(kind, u.digest, t, mask, 0)
        elif u.op == "evicted":
            self._change(kind, u.digest, t, 0, mask)
        elif u.op == "moved":
            if u.from_tier is not None:
                src = [u.from_tier]
            else:
                src = [TIERS[s] for s in range(1, t)]  # demotion: out of host (and disk) above t
            for name in src:
                self._change(kind, u.digest, TIER_INDEX[name], 0, self._scope_mask(name, u.worker_id))
            self._change(kind, u.digest, t, mask, 0)
        else:
            raise ValueError(f"unknown event kind {u.op!r}")
        self.num_events += 1

    def updater(self, tier: str, reporter: str) -> Callable[[bool, str, bytes], None]:
        """A hot path for one producer's stored / evicted events (the simulator's tiers), NOTE 7.

        Returns ``update(stored, kind, digest)``, equivalent to ``apply_update(IndexUpdate(
        "stored" if stored else "evicted", kind, digest, tier, reporter))`` without building
        the update or resolving the tier and the reporter's scope per event.
        """
        t = TIER_INDEX[tier]
        tables, mla, kda = self._tables, self._mla, self._kda
        scope = [-1, 0]  # _members when resolved, the scope mask

        def update(stored: bool, kind: str, digest: bytes) -> None:
            if scope[0] != self._members:
                mask = self._scope_mask(tier, reporter)  # may register the reporter: read _members after
                scope[0], scope[1] = self._members, mask
            else:
                mask = scope[1]
            self.num_events += 1
            if not mask:  # nobody can read it: _change is a no-op
                return
            key = digest if len(digest) == DIGEST_BYTES else digest_key(digest)
            table = tables[kind]
            if stored:
                row = table.add_bits(key, t, mask)
                if row >= 0:  # a new row: NOTE 5 (a new MLA row's link is already "none")
                    if table is mla:
                        kda_row = kda.row(key)
                        if kda_row is not None:
                            mla.set_link(row, kda_row)
                    elif table is kda:
                        mla_row = mla.row(key)
                        if mla_row is not None:
                            mla.set_link(mla_row, row)
            elif table.clear_bits(key, t, mask) and table is kda:
                mla_row = mla.row(key)
                if mla_row is not None:
                    mla.set_link(mla_row, None)

        return update

    def apply(self, event: Any) -> None:
        """Apply one kv_transfer store event."""
        u = update_from_event(event)
        if u is None:
            self.num_ignored += 1
        else:
            self.apply_update(u)

    def apply_many(self, events: Iterable[Any]) -> None:
        for ev in events:
            self.apply(ev)

    def remove_worker_objects(self, worker_id: str) -> None:
        """Forget a dead worker's device tier (its node tiers stay)."""
        bit = self._bit.get(worker_id)
        if bit is None:
            return
        word, shift = divmod(bit, WORD_BITS)
        for kind, table in self._tables.items():
            device = table.rec[: table.num_rows, REC_MASKS + word]  # tier 0, this word
            held = (device >> np.uint64(shift)) & _ONE
            for row in np.flatnonzero(held).tolist():
                self._change(kind, table.digest(row), 0, 0, 1 << bit)

    # ---- queries -------------------------------------------------------------
    def resumable(self, request: RouteRequest, worker_id: str) -> tuple[int, str | None]:
        """(resumable tokens, slowest tier) for one worker."""
        m = self.match(request, [worker_id]).get(worker_id)
        return m.resumable_tokens, m.tier

    def _candidates(self, worker_ids: list[str]) -> _Candidates:
        key = tuple(worker_ids)
        c = self._cand
        if c is not None and c.key == key and len(c.words) == self._mla.num_words:
            return c
        bits = [self.add_worker(w) for w in worker_ids]
        mask = 0
        for b in bits:
            mask |= 1 << b
        self._cand = c = _Candidates(
            key, bits, mask, mask_words(mask, self._mla.num_words),
            np.array([b // WORD_BITS for b in bits], np.intp),
            np.array([b % WORD_BITS for b in bits], np.uint64),
            {},
        )
        for i, b in enumerate(bits):
            c.rank.setdefault(b, []).append(i)
        return c

    def _prefix(self, request: RouteRequest) -> tuple[np.ndarray, np.ndarray]:
        """MLA rows and records of the prompt's blocks, up to the first block no tier holds."""
        return self._mla.find_prefix(request.block_hashes)

    def match(self, request: RouteRequest, worker_ids: list[str], common_min: int | None = None) -> MatchResult:
        """Walk the request's blocks once for all ``worker_ids``.

        Args:
            request: digests of the prompt's full blocks and tail probes.
            worker_ids: candidates (registered on the fly if new).
            common_min: a leading block is "common" when at least this many
                candidates can read it and, on a hybrid model, resume to it
                (NOTE 8; None: no common-prefix count).
        """
        c = self._candidates(worker_ids)
        if len(request.block_hashes) <= self.int_walk_blocks:  # the same walk on ints (disagg.router.walk)
            common, resumable, tiers, lengths = walk_ints(self, c, request, common_min)
        else:
            common, resumable, tiers, lengths = self._walk_numpy(c, request, common_min)
        if common and self.hybrid and len(resumable) >= common_min:
            # blocks most candidates read but cannot resume to (no checkpoint at or past them) are no
            # common prefix: a worker that resumes them saves their prefill (NOTE 8)
            common = min(common, sorted(resumable)[len(resumable) - common_min] // request.block_size)
        return MatchResult(
            None,
            common,
            worker_ids=worker_ids if type(worker_ids) is list else list(worker_ids),
            resumable=resumable,
            tiers=tiers,
            mla_blocks=lengths,
            arrays=(np.array(resumable, np.float64), np.array(tiers, np.int64)),  # the columns plugins read
        )

    def _walk_numpy(self, c: _Candidates, request: RouteRequest, common_min: int | None
                    ) -> tuple[int, list[int], list[int], _Lengths]:
        """(common, resumable, tiers, lengths) of ``match`` by the numpy walk over the le tables."""
        bs, plen = request.block_size, request.prompt_len
        rows, recs = self._prefix(request)
        cum = _le(self._mla.rec_masks(recs))  # (tier, n, word): le
        common = 0
        if common_min is not None:
            held = _popcount(cum[_ANY] & c.words)
            short = ((held[:, 0] if held.shape[1] == 1 else held.sum(axis=1)) < common_min).nonzero()[0]
            common = int(short[0]) if short.size else len(rows)
        n = len(rows)
        if n:  # cum[t, i] = cand & le[t, 0] & ... & le[t, i]: who reads blocks 0..i, per tier
            cum[:, 0] &= c.words
            np.bitwise_and.accumulate(cum, axis=1, out=cum)
            if not _any(cum[_ANY, n - 1]):  # nobody reads the whole run: cut it where the last reader stops
                n = int(np.argmin(cum[_ANY].any(axis=1)))
                cum, recs = cum[:, :n], recs[:n]
        alive = cum[_ANY]  # alive[k - 1] = candidates reading blocks 0..k-1 (alive(0) = cand)
        resumable, tiers, _ = self._resolve(c, request, recs, cum, bs, plen)
        return common, resumable, tiers, _Lengths(alive, c.word, c.shift)

    def _resolve(self, c: _Candidates, request: RouteRequest, recs: np.ndarray, cum: np.ndarray, bs: int,
                 plen: int) -> tuple[list[int], list[int], list[int]]:
        """The numpy walk's resume points, resolved by ``disagg.router.walk.visit_points``.

        Resume points: position p, blocks read k, workers able to resume there
        (readers of blocks 0..k-1 that can read the point's objects from some
        tier), the le masks of the extra objects read.
        """
        n = len(recs)
        limit = max(min(n, (plen - 1) // bs), 0)  # aligned points p = k * bs < plen
        kda = self._kda
        if self.hybrid:
            ck = recs[:limit, REC_LINK]  # checkpoint row + 1, 0: none
            at = ck.nonzero()[0]  # block i ends at a checkpoint: a point with k = i + 1
            ck_rows = ck.take(at).view(np.int64) - 1
            obj = kda.rec_masks(kda.rec.take(ck_rows, axis=0))  # the checkpoints' masks, (point, tier, word)
            kms = cum[_ANY].take(at, axis=0) & (obj[:, 0] | obj[:, 1] | obj[:, 2] | obj[:, 3])
            ck_l = ck_rows.tolist()
        else:  # any block prefix resumes: a point where a run of alive ends
            alive = cum[_ANY]
            ends = np.flatnonzero((alive[1:] != alive[:-1]).any(axis=1))  # alive[i] > alive[i + 1]
            ends = np.append(ends, n - 1) if n else ends
            kms = alive[ends] & ~np.concatenate([alive[ends[:-1] + 1], np.zeros_like(alive[:1])]) if n else alive[:0]
            at = np.minimum(ends, limit - 1)
            keep = at >= 0
            at, kms, ck_l = at[keep], kms[keep], None
        at_l, km_l = at.tolist(), _ints(kms)  # points nobody reads have km 0: skipped when visited
        remote = len(TIERS) - 1

        def alive_at(k: int) -> int:
            return c.mask if k == 0 else _ints(cum[_ANY, k - 1])[0]

        def fast_at(k: int) -> list[int]:
            return _ints(cum[:remote, k - 1]) if k else [c.mask] * remote

        tails = tail_points(self, c, request, alive_at, bs, plen, n)
        return visit_points(self, c, at_l, km_l, ck_l, tails, fast_at, bs)

    def block_overlap(self, request: RouteRequest, worker_ids: list[str]) -> dict[str, list[int]]:
        """Per worker, consecutive leading blocks counted by their fastest tier.

        Returns {worker_id: [n_device, n_host, n_disk, n_remote]} (what a
        tier-weighted overlap credit needs; ignores KDA checkpoints).
        """
        c = self._candidates(worker_ids)
        raw = self._mla.rec_masks(self._prefix(request)[1])  # (n, tier, word)
        readable = raw[:, 0] | raw[:, 1] | raw[:, 2] | raw[:, 3]
        alive = np.bitwise_and.accumulate(np.concatenate([c.words[None], readable]), axis=0)[1:]  # of blocks 0..i
        d, ho, di = raw[:, 0], raw[:, 1], raw[:, 2]
        by_tier = np.stack([alive & d, alive & ~d & ho, alive & ~d & ~ho & di, alive & ~(d | ho | di)])
        counts = ((by_tier[:, :, c.word] >> c.shift) & _ONE).sum(axis=1, dtype=np.int64)  # (tier, cand)
        rows = counts.T.tolist()
        return {w: rows[i] for i, w in enumerate(worker_ids)}
