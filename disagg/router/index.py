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

Data layout (sized for 64 workers x 1M blocks, p99 < 1 ms per decision):

    _mla[digest]  = (dev, host, disk, remote,  le_host, le_disk, le_any,  ckpt)
    _kda[digest]  = (dev, host, disk, remote,  le_host, le_disk, le_any,  None)
                    KDA checkpoints keyed by prefix digest
    _tail[digest] = same, for MLA tails keyed by tail digest

``ckpt`` is the ``_kda`` entry at the same digest (the aligned checkpoint at
the end of that block) or None, so the walk finds checkpoints without a
second lookup per block.

Each mask is a Python int with bit b set when worker b can read the object
from that tier (node-shared tiers set the bits of every worker of the node,
the remote tier sets all bits: -1). ``le_t`` is the union of the tiers up
to t ("readable no slower than t"), so the walk needs no per-block Python:

    alive(k)   = cand & AND_{i<k} le_any(h_i)      workers reading blocks 0..k-1
    le_t(k)    = AND_{i<k} le_t(h_i)               ... all of them no slower than t
    tier(w, p) = min t with w in le_t(p / bs) & le_t(checkpoint) [& le_t(tail)]

Each AND is an ``itertools.accumulate`` over a ``map`` (C loops), so a walk
costs a handful of C-speed passes over the prompt's blocks plus Python work
per checkpoint and per worker, independent of the index size. Entries are
tuples of ints, which the garbage collector stops tracking, so a million
entries add no GC pauses.

NOTES
1. Resumable length never exceeds the newest KDA checkpoint a worker holds
   below the prompt end (p < prompt_len: at least one token is computed).
2. A KDA checkpoint counts as present when its first head shard (tp0) is
   reported; writers publish and evict a checkpoint's shards together.
3. Register workers (``add_worker``) before their events arrive; a worker
   seen first in an event is registered as alone on its own node. An event
   reported by a node id (a node-shared tier) applies to the node's workers.
4. ``entry[4 + t - 1] == entry[0] | ... | entry[t]`` for every entry (the
   cumulative masks are rebuilt on every change, see ``_entry``).
5. ``_mla[h][7] is _kda.get(h)`` for every MLA entry: a KDA change re-links
   the MLA entry at its digest, a new MLA entry links the current KDA entry.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass
from functools import reduce
from itertools import accumulate, compress, islice, repeat
from operator import and_, itemgetter, neg
from typing import Any

from disagg.router.types import TIER_INDEX, TIERS, RouteRequest

SCOPES = ("worker", "node", "global")
DEFAULT_SCOPES = {"device": "worker", "host": "node", "disk": "node", "remote": "global"}
OBJECT_KINDS = ("mla", "tail", "kda")
Entry = tuple  # (dev, host, disk, remote, le_host, le_disk, le_any, ckpt entry | None)
_LE = (0, 4, 5, 6)  # entry column of "readable no slower than tier t"
_ANY = itemgetter(6)
_CKPT = itemgetter(7)
_LE_COL = tuple(itemgetter(c) for c in _LE)
_NO_TIER = -1


def _entry(d: int, ho: int, di: int, re: int, ckpt: Entry | None = None) -> Entry | None:
    """Entry with its cumulative masks (NOTE 4); None when no tier holds the object."""
    le1 = d | ho if ho else d
    le2 = le1 | di if di else le1
    le3 = le2 | re if re else le2
    return (d, ho, di, re, le1, le2, le3, ckpt) if le3 else None


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


@dataclass(slots=True)
class PrefixMatch:
    """Result of a walk for one worker."""

    resumable_tokens: int = 0  # furthest resume point p (0 = nothing to resume)
    tier: str | None = None  # slowest tier read by the resume (None when p == 0)
    mla_blocks: int = 0  # consecutive MLA blocks readable from the start (any tier)


class MatchResult:
    """Walk result for one request over a set of candidate workers.

    Column form (what the walk produces and vectorized plugins read), row i
    for ``worker_ids[i]``; ``matches`` is the per-worker dict view, built on
    first use. Either form may be given to the constructor.
    """

    __slots__ = ("worker_ids", "resumable", "tiers", "mla_blocks", "common_blocks", "_matches")

    def __init__(
        self,
        matches: dict[str, PrefixMatch] | None = None,
        common_blocks: int = 0,
        *,
        worker_ids: list[str] | None = None,
        resumable: list[int] | None = None,
        tiers: list[int] | None = None,
        mla_blocks: list[int] | None = None,
    ):
        self.common_blocks = common_blocks  # leading blocks readable by >= common_min candidates
        self._matches = matches
        if matches is not None:
            worker_ids = list(matches)
            vals = list(matches.values())
            resumable = [m.resumable_tokens for m in vals]
            tiers = [_NO_TIER if m.tier is None else TIER_INDEX[m.tier] for m in vals]
            mla_blocks = [m.mla_blocks for m in vals]
        self.worker_ids: list[str] = worker_ids or []  # candidates, row order
        self.resumable: list[int] = resumable or []  # resumable tokens per row
        self.tiers: list[int] = tiers or []  # slowest tier index per row (-1: no resume)
        self.mla_blocks: list[int] = mla_blocks if mla_blocks is not None else []  # readable leading blocks per row
        assert len(self.worker_ids) == len(self.resumable) == len(self.tiers) == len(self.mla_blocks)

    @property
    def matches(self) -> dict[str, PrefixMatch]:
        if self._matches is None:
            self._matches = {
                w: PrefixMatch(p, TIERS[t] if t >= 0 else None, m)
                for w, p, t, m in zip(self.worker_ids, self.resumable, self.tiers, self.mla_blocks, strict=True)
            }
        return self._matches

    def get(self, worker_id: str) -> PrefixMatch:
        if self._matches is not None:
            return self._matches.get(worker_id) or PrefixMatch()
        try:
            i = self.worker_ids.index(worker_id)
        except ValueError:
            return PrefixMatch()
        t = self.tiers[i]
        return PrefixMatch(self.resumable[i], TIERS[t] if t >= 0 else None, self.mla_blocks[i])


class _Lengths:
    """Leading readable blocks per candidate, expanded from the walk's steps on first use."""

    __slots__ = ("_bits", "_steps", "_list")

    def __init__(self, bits: list[int], steps: list[tuple[int, int]]):
        self._bits, self._steps, self._list = bits, steps, None

    def _expand(self) -> list[int]:
        if self._list is None:
            by_bit = {b: m for mask, m in self._steps for b in _bits(mask)}
            self._list = [by_bit.get(b, 0) for b in self._bits]
        return self._list

    def __len__(self) -> int:
        return len(self._bits)

    def __getitem__(self, i: int) -> int:
        if self._list is not None:
            return self._list[i]
        b = self._bits[i]
        return next((m for mask, m in self._steps if mask >> b & 1), 0)

    def __iter__(self):
        return iter(self._expand())

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other)  # type: ignore[call-overload]


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


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
        self._mla: dict[bytes, Entry] = {}
        self._kda: dict[bytes, Entry] = {}
        self._tail: dict[bytes, Entry] = {}
        self._tables = {"mla": self._mla, "kda": self._kda, "tail": self._tail}
        self._cand: tuple[tuple[str, ...], list[int], int] | None = None  # last candidate set
        self.num_events = 0  # events applied
        self.num_ignored = 0  # events the adapter dropped (see update_from_event)

    # ---- membership -------------------------------------------------------
    def add_worker(self, worker_id: str, node_id: str | None = None) -> int:
        """Register a worker (idempotent); returns its bit."""
        bit = self._bit.get(worker_id)
        if bit is not None:
            return bit
        bit = len(self._workers)
        self._bit[worker_id] = bit
        self._workers.append(worker_id)
        node = node_id or worker_id
        self._node_of[worker_id] = node
        self._node_mask[node] = self._node_mask.get(node, 0) | (1 << bit)
        return bit

    def node_of(self, worker_id: str) -> str:
        return self._node_of.get(worker_id, worker_id)

    @property
    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def num_objects(self) -> dict[str, int]:
        return {"mla": len(self._mla), "kda": len(self._kda), "tail": len(self._tail)}

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
        e = table.get(digest)
        raw = [0, 0, 0, 0] if e is None else list(e[:4])
        raw[tier] = (raw[tier] & ~clear_mask) | set_mask
        if kind == "mla":
            new = _entry(*raw, self._kda.get(digest))
        else:
            new = _entry(*raw)
        if new is None:
            table.pop(digest, None)
        else:
            table[digest] = new
        if kind == "kda":  # NOTE 5
            m = self._mla.get(digest)
            if m is not None:
                self._mla[digest] = m[:7] + (new,)

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
        for kind, table in self._tables.items():
            for digest in [d for d, e in table.items() if e[0] >> bit & 1]:
                self._change(kind, digest, 0, 0, 1 << bit)

    # ---- queries -------------------------------------------------------------
    def resumable(self, request: RouteRequest, worker_id: str) -> tuple[int, str | None]:
        """(resumable tokens, slowest tier) for one worker."""
        m = self.match(request, [worker_id]).get(worker_id)
        return m.resumable_tokens, m.tier

    def _candidates(self, worker_ids: list[str]) -> tuple[list[int], int]:
        key = tuple(worker_ids)
        if self._cand is not None and self._cand[0] == key:
            return self._cand[1], self._cand[2]
        bits = [self.add_worker(w) for w in worker_ids]
        cand = 0
        for b in bits:
            cand |= 1 << b
        self._cand = (key, bits, cand)
        return bits, cand

    def match(self, request: RouteRequest, worker_ids: list[str], common_min: int | None = None) -> MatchResult:
        """Walk the request's blocks once for all ``worker_ids``.

        Args:
            request: digests of the prompt's full blocks and tail probes.
            worker_ids: candidates (registered on the fly if new).
            common_min: a leading block is "common" when at least this many
                candidates can read it (None: no common-prefix count).
        """
        bits, cand = self._candidates(worker_ids)
        bs, plen = request.block_size, request.prompt_len
        es = list(map(self._mla.get, request.block_hashes))
        try:
            del es[es.index(None):]  # the walk ends at the first block no tier holds
        except ValueError:
            pass
        common = 0
        if common_min is not None:
            for e in es:
                if (e[6] & cand).bit_count() < common_min:
                    break
                common += 1
        # alive[k]: candidates that read blocks 0..k-1 (any tier); non-increasing ints >= 0
        alive = list(accumulate(map(_ANY, es), and_, initial=cand))
        if not alive[-1]:
            n = alive.index(0) - 1 if cand else 0
            del alive[n + 1:], es[n:]
        n = len(es)
        # alive shrinks at a few change points: (workers still reading, blocks read) per step
        steps: list[tuple[int, int]] = []
        v = alive[0]
        while v:
            k = bisect_left(alive, -(v - 1), key=neg)  # first position reading fewer workers
            steps.append((v & ~alive[k] if k <= n else v, k - 1))
            if k > n:
                break
            v = alive[k]
        snaps = self._resume_points(request, es, alive, steps, bs, plen)
        tok, tier = self._resolve(snaps, es)
        n_w = len(bits)
        return MatchResult(
            None,
            common,
            worker_ids=list(worker_ids),
            resumable=list(map(tok.get, bits, repeat(0, n_w))),
            tiers=list(map(tier.get, bits, repeat(_NO_TIER, n_w))),
            mla_blocks=_Lengths(bits, steps),
        )

    def _resume_points(self, request: RouteRequest, es: list[Entry], alive: list[int], steps: list[tuple[int, int]],
                       bs: int, plen: int) -> list[tuple[int, int, int, tuple[Entry, ...]]]:
        """Candidate resume points: (position, blocks read, workers, extra objects read)."""
        n = len(es)
        limit = min(n, (plen - 1) // bs)  # aligned points p = k * bs < plen
        snaps: list[tuple[int, int, int, tuple[Entry, ...]]] = []
        if self.hybrid:
            ks = list(map(_CKPT, islice(es, limit)))
            for i in compress(range(limit), ks):
                k = ks[i]
                km = alive[i + 1] & k[6]
                if km:
                    snaps.append(((i + 1) * bs, i + 1, km, (k,)))
        else:
            for mask, m in steps:
                nb = min(m, limit)
                if nb:
                    snaps.append((nb * bs, nb, mask, ()))
        for probe in request.tail_probes:
            p = probe.position
            k = p // bs
            if not 0 < p < plen or not p % bs or k > n:
                continue
            t = self._tail.get(probe.digest)
            if t is None:
                continue
            objs: tuple[Entry, ...] = (t,)
            km = alive[k] & t[6]
            if self.hybrid:
                c = self._kda.get(probe.digest)
                if c is None:
                    continue
                objs, km = (t, c), km & c[6]
            if km:
                snaps.append((p, k, km, objs))
        return snaps

    @staticmethod
    def _resolve(snaps: list, es: list[Entry]) -> tuple[dict[int, int], dict[int, int]]:
        """Furthest resume point and its slowest tier, per worker bit."""
        tok: dict[int, int] = {}
        tier: dict[int, int] = {}
        resolved = 0
        for p, nb, km, objs in sorted(snaps, key=itemgetter(0), reverse=True):
            new = km & ~resolved
            if not new:
                continue
            resolved |= new
            rest = new
            for t in range(3):
                m = rest
                for o in objs:
                    m &= o[_LE[t]]
                if m:  # AND over the distinct masks of the blocks read: one C pass per tier
                    m = reduce(and_, set(map(_LE_COL[t], islice(es, nb))), m)
                for b in _bits(m):
                    tok[b], tier[b] = p, t
                rest &= ~m
                if not rest:
                    break
            for b in _bits(rest):
                tok[b], tier[b] = p, 3
        return tok, tier

    def block_overlap(self, request: RouteRequest, worker_ids: list[str]) -> dict[str, list[int]]:
        """Per worker, consecutive leading blocks counted by their fastest tier.

        Returns {worker_id: [n_device, n_host, n_disk, n_remote]} (what a
        tier-weighted overlap credit needs; ignores KDA checkpoints).
        """
        bits = {w: self.add_worker(w) for w in worker_ids}
        counts = {b: [0, 0, 0, 0] for b in bits.values()}
        alive = 0
        for b in bits.values():
            alive |= 1 << b
        run, key = 0, None
        for h in request.block_hashes:
            e = self._mla.get(h)
            if e is None:
                break
            d, ho, di, _re = e[:4]
            alive &= e[6]
            if not alive:
                break
            k = (alive & d, alive & ~d & ho, alive & ~d & ~ho & di, alive & ~d & ~ho & ~di)
            if k != key:
                _flush(counts, key, run)
                key, run = k, 0
            run += 1
        _flush(counts, key, run)
        return {w: counts[b] for w, b in bits.items()}


def _flush(counts: dict[int, list[int]], key: tuple[int, ...] | None, run: int) -> None:
    if key is None or run == 0:
        return
    for tier, mask in enumerate(key):  # masks are >= 0: each is ANDed with the candidates
        for b in _bits(mask):
            c = counts.get(b)
            if c is not None:
                c[tier] += run
