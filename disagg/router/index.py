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

    _mla[digest]  = (device_mask, host_mask, disk_mask, remote_mask)
    _kda[digest]  = same, for KDA checkpoints keyed by prefix digest
    _tail[digest] = same, for MLA tails keyed by tail digest

Each mask is a Python int with bit b set when worker b can read the object
from that tier (node-shared tiers set the bits of every worker of the node,
the remote tier sets all bits: -1). Entries are tuples of ints, which the
garbage collector stops tracking, so a million entries add no GC pauses. A walk ANDs the union masks block by
block, so its cost is O(prompt blocks) independent of the number of workers.

NOTES
1. Resumable length never exceeds the newest KDA checkpoint a worker holds
   below the prompt end (p < prompt_len: at least one token is computed).
2. A KDA checkpoint counts as present when its first head shard (tp0) is
   reported; writers publish and evict a checkpoint's shards together.
3. Register workers (``add_worker``) before their events arrive; a worker
   seen first in an event is registered as alone on its own node.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from disagg.router.types import TIER_INDEX, TIERS, RouteRequest

SCOPES = ("worker", "node", "global")
_EMPTY = (0, 0, 0, 0)
DEFAULT_SCOPES = {"device": "worker", "host": "node", "disk": "node", "remote": "global"}


@dataclass(frozen=True, slots=True)
class IndexUpdate:
    """One store event reduced to what the index needs."""

    op: str  # "stored" | "evicted" | "moved"
    object_kind: str  # "mla" | "tail" | "kda"
    digest: bytes  # block digest (mla) or prefix digest (tail, kda)
    tier: str  # tier the event is about (destination for "moved")
    worker_id: str  # worker that reported the event
    from_tier: str | None = None  # source tier of a "moved" event


def update_from_event(event: Any) -> IndexUpdate | None:
    """Adapter from a kv_transfer ``StoreEvent`` (or anything shaped like it).

    The one place that knows the event's field names. Returns None for events
    the index ignores (non-zero shards of a sharded object).
    """
    key: str = event.key
    parts = key.split(":")
    kind = parts[0]
    shard = parts[2] if len(parts) > 2 else ""
    if shard and not (shard.startswith("tp0of") or shard.startswith("dcp0of")):
        return None
    from_tier = getattr(event, "from_tier", None) or getattr(event, "src_tier", None)
    return IndexUpdate(event.kind, kind, bytes.fromhex(parts[1]), event.tier, event.worker_id, from_tier)


@dataclass(slots=True)
class PrefixMatch:
    """Result of a walk for one worker."""

    resumable_tokens: int = 0  # furthest resume point p (0 = nothing to resume)
    tier: str | None = None  # slowest tier read by the resume (None when p == 0)
    mla_blocks: int = 0  # consecutive MLA blocks readable from the start (any tier)


@dataclass(slots=True)
class MatchResult:
    """Walk result for one request over a set of candidate workers."""

    matches: dict[str, PrefixMatch]  # per candidate worker
    common_blocks: int  # leading blocks readable by >= common_min candidates


def _bits(mask: int, limit: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        b = low.bit_length() - 1
        if b >= limit:
            return
        yield b
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
        self._mla: dict[bytes, tuple[int, int, int, int]] = {}
        self._kda: dict[bytes, tuple[int, int, int, int]] = {}
        self._tail: dict[bytes, tuple[int, int, int, int]] = {}
        self.num_events = 0  # events applied

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
    def _scope_mask(self, tier: str, worker_id: str) -> int:
        bit = self.add_worker(worker_id)
        scope = self.scopes.get(tier, "worker")
        if scope == "worker":
            return 1 << bit
        if scope == "node":
            return self._node_mask[self._node_of[worker_id]]
        return -1

    def _table(self, object_kind: str) -> dict[bytes, tuple[int, int, int, int]]:
        if object_kind == "mla":
            return self._mla
        if object_kind == "kda":
            return self._kda
        assert object_kind == "tail", f"unknown object kind {object_kind!r}"
        return self._tail

    def _set(self, table: dict[bytes, tuple[int, int, int, int]], digest: bytes, tier: str, mask: int) -> None:
        e = table.get(digest, _EMPTY)
        t = TIER_INDEX[tier]
        table[digest] = e[:t] + (e[t] | mask,) + e[t + 1 :]

    def _clear(self, table: dict[bytes, tuple[int, int, int, int]], digest: bytes, tier: str, mask: int) -> None:
        e = table.get(digest)
        if e is None:
            return
        t = TIER_INDEX[tier]
        e = e[:t] + (e[t] & ~mask,) + e[t + 1 :]
        if e[0] | e[1] | e[2] | e[3]:
            table[digest] = e
        else:
            del table[digest]

    def apply_update(self, u: IndexUpdate) -> None:
        table = self._table(u.object_kind)
        mask = self._scope_mask(u.tier, u.worker_id)
        if u.op == "stored":
            self._set(table, u.digest, u.tier, mask)
        elif u.op == "evicted":
            self._clear(table, u.digest, u.tier, mask)
        elif u.op == "moved":
            if u.from_tier is not None:
                self._clear(table, u.digest, u.from_tier, self._scope_mask(u.from_tier, u.worker_id))
            self._set(table, u.digest, u.tier, mask)
        else:
            raise ValueError(f"unknown event kind {u.op!r}")
        self.num_events += 1

    def apply(self, event: Any) -> None:
        """Apply one kv_transfer store event."""
        u = update_from_event(event)
        if u is not None:
            self.apply_update(u)

    def apply_many(self, events: Iterable[Any]) -> None:
        for ev in events:
            self.apply(ev)

    def remove_worker_objects(self, worker_id: str) -> None:
        """Forget a dead worker's device tier (its node tiers stay)."""
        bit = self._bit.get(worker_id)
        if bit is None:
            return
        for table in (self._mla, self._kda, self._tail):
            for digest in [d for d, e in table.items() if e[0] >> bit & 1]:
                self._clear(table, digest, "device", 1 << bit)

    # ---- queries -------------------------------------------------------------
    def resumable(self, request: RouteRequest, worker_id: str) -> tuple[int, str | None]:
        """(resumable tokens, slowest tier) for one worker."""
        m = self.match(request, [worker_id]).matches[worker_id]
        return m.resumable_tokens, m.tier

    def match(
        self, request: RouteRequest, worker_ids: list[str], common_min: int | None = None
    ) -> MatchResult:
        """Walk the request's blocks once for all ``worker_ids``.

        Args:
            request: digests of the prompt's full blocks and tail probes.
            worker_ids: candidates (registered on the fly if new).
            common_min: a leading block is "common" when at least this many
                candidates can read it (None: no common-prefix count).
        """
        cand = 0
        for w in worker_ids:
            cand |= 1 << self.add_worker(w)
        bs = request.block_size
        plen = request.prompt_len
        tails: dict[int, list] = {}
        for probe in request.tail_probes:
            if 0 < probe.position < plen and probe.position % bs:
                tails.setdefault(probe.position // bs, []).append(probe)
        mla_get, kda_get = self._mla.get, self._kda.get
        alive = cand
        ge1 = ge2 = ge3 = 0  # workers whose slowest tier so far is >= host / disk / remote
        snaps: list[tuple[int, int, int, int, int]] = []  # (p, mask, ge1, ge2, ge3)
        mla_len: dict[int, int] = {}  # bit -> consecutive blocks, for workers that dropped out
        common = 0
        common_open = common_min is not None
        hybrid = self.hybrid
        n_blocks = len(request.block_hashes)
        i = 0
        if 0 in tails:
            self._probe_tails(tails[0], alive, ge1, ge2, ge3, snaps)
        for i, h in enumerate(request.block_hashes):
            e = mla_get(h)
            if e is None:
                break
            d, ho, di, re = e
            u = d | ho | di | re
            if common_open:
                if ((u & cand).bit_count() if u >= 0 else cand.bit_count()) >= common_min:
                    common += 1
                else:
                    common_open = False
            nxt = alive & u
            if nxt != alive:
                for b in _bits(alive & ~nxt, len(self._workers)):
                    mla_len[b] = i
                alive = nxt
                if not alive:
                    break
            nd = alive & ~d
            if nd:
                ge1 |= nd
                x = nd & ~ho
                if x:
                    ge2 |= x
                    ge3 |= x & ~di
            p = (i + 1) * bs
            if p >= plen:
                continue
            if hybrid:
                k = kda_get(h)
                if k is not None:
                    km = alive & (k[0] | k[1] | k[2] | k[3])
                    if km:
                        snaps.append(_snap(p, km, ge1, ge2, ge3, k))
            else:
                snaps.append((p, alive, ge1, ge2, ge3))
            if i + 1 in tails:
                self._probe_tails(tails[i + 1], alive, ge1, ge2, ge3, snaps)
        else:
            i = n_blocks
        for b in _bits(alive, len(self._workers)):
            mla_len.setdefault(b, i)
        return MatchResult(self._resolve(worker_ids, snaps, mla_len), common)

    def _probe_tails(self, probes: list, alive: int, ge1: int, ge2: int, ge3: int, snaps: list) -> None:
        for probe in sorted(probes, key=lambda t: t.position):
            t = self._tail.get(probe.digest)
            k = self._kda.get(probe.digest) if self.hybrid else (-1, 0, 0, 0)
            if t is None or k is None:
                continue
            tm = alive & (t[0] | t[1] | t[2] | t[3])
            km = tm & (k[0] | k[1] | k[2] | k[3])
            if km:
                p, m, g1, g2, g3 = _snap(probe.position, km, ge1, ge2, ge3, t)
                snaps.append(_snap(p, m, g1, g2, g3, k))

    def _resolve(self, worker_ids: list[str], snaps: list, mla_len: dict[int, int]) -> dict[str, PrefixMatch]:
        out = {w: PrefixMatch(0, None, mla_len.get(self._bit[w], 0)) for w in worker_ids}
        resolved = 0
        for p, mask, g1, g2, g3 in reversed(snaps):
            new = mask & ~resolved
            if not new:
                continue
            resolved |= new
            for b in _bits(new, len(self._workers)):
                w = self._workers[b]
                m = out.get(w)
                if m is None:
                    continue
                bit = 1 << b
                tier = 3 if g3 & bit else 2 if g2 & bit else 1 if g1 & bit else 0
                m.resumable_tokens = p
                m.tier = TIERS[tier]
        return out

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
            d, ho, di, re = e
            alive &= d | ho | di | re
            if not alive:
                break
            k = (alive & d, alive & ~d & ho, alive & ~d & ~ho & di, alive & ~d & ~ho & ~di)
            if k != key:
                _flush(counts, key, run)
                key, run = k, 0
            run += 1
        _flush(counts, key, run)
        return {w: counts[b] for w, b in bits.items()}


def _snap(p: int, km: int, ge1: int, ge2: int, ge3: int, k: tuple[int, ...]) -> tuple[int, int, int, int, int]:
    """Fold the fastest tier of an object (per worker) into the slowest-tier masks."""
    nd = km & ~k[0]
    x = nd & ~k[1]
    return (p, km, ge1 | nd, ge2 | x, ge3 | (x & ~k[2]))


def _flush(counts: dict[int, list[int]], key: tuple[int, ...] | None, run: int) -> None:
    if key is None or run == 0:
        return
    for tier, mask in enumerate(key):
        for b in _bits(mask, 1 << 30):
            c = counts.get(b)
            if c is not None:
                c[tier] += run
