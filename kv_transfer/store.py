"""StateStore: resume state (MLA blocks, tails, KDA checkpoints) over ordered tiers.

Objects and their keys (see ``kv_transfer.keys``):

    tokens    |<- block 0 ->|<- block 1 ->|<- tail ->|            p = resume point
    objects     mla:h_1       mla:h_2       tail:D(p)   kda:D(p):tp{r}of{T}  (r < T)
    DCP d > 1   mla:h_i:dcp{r}of{d}, tail:D(p):dcp{r}of{d}             (r < d)

    D(p) = prefix_digest(p): h_{p/bs} when p is aligned, else tail(p).

MLA blocks carry no TP rank: TP ranks share the latent cache, so the first rank
to put a block stores it and the others find it present (stored once per TP
group); each TP rank's KDA head shard is its own object.

Resumable length: the furthest p <= max_position with every MLA block before p
present, a KDA checkpoint at p (all TP shards) and, when p is unaligned, the
tail at p. Unaligned candidates come from a small index parent digest -> tail
lengths kept on put (entries found absent in every tier are dropped lazily).

Tier order is speed order (host, disk, remote...). ``put_state`` writes to the
first tier that accepts (encoding straight into the host arena); with
``write_behind`` objects the host evicts move to the next tier; a hit in a
lower tier is promoted to the first. Every load verifies every checksum and
that each object is the piece its key names (block start and span, tail span,
KDA position, DCP and TP shard): a corrupt or misplaced object is counted and
deleted from its tier and the next tier is tried; if any piece cannot be had,
``load_state`` returns None (recompute).
Puts and loads of many pieces encode and verify them on ``io_threads``
threads (CRC and copies release the GIL).

Batch path (a first tier with ``reserve_many`` / ``commit_many`` / ``get_views``
/ ``release_many``, e.g. the host tier or its client in another process):

    put   reserve every piece (1 round trip) -> encode into the regions on the
          I/O threads -> commit all (1), or have the tier's owner seal them (1)
    load  pin every block (1 round trip) -> checksum + copy each straight into
          one rows buffer on the I/O threads -> release all (1); a block that
          is missing or fails there takes the per-object path through the tiers

Objects stay one per block (their keys are what routers, events and
``contains_keys`` callers see); the batches remove the per-object round trips.

Publishing from an engine's process. Every call into numpy or the checksum
library releases the GIL and takes it back; taking it back from an engine
thread that is busy launching kernels costs that thread a hand-off (a switch
interval's wait, then a wake-up). With one copy and one checksum per 64-token
block, an 8K prompt's put took ~260 hand-offs, and an H200 prefill ran 10-20%
slower while the store published (docs/perf). So a put encodes full blocks in
runs: blocks that are consecutive slices of the state's staging buffer and
sit in evenly spaced slots (one size class) are written by
``BlockCodec.encode_run``, headers by two array assignments and rows by one
strided copy per run part (parts of at most 1 / ``io_threads`` of the blocks).
When the first tier is a client of the node's store process
(``seals_remotely``), the blocks are written without checksums and the
process that owns the tier computes them and commits (``seal_many``, one
round trip): the engine's process then spends no CPU on checksums at all.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import torch

from kv_transfer import codec, device_crc, direct
from kv_transfer.dcp import reshard_dcp
from kv_transfer.errors import CorruptObjectError
from kv_transfer.events import EventLog, StoreEvent
from kv_transfer.keys import BlockHasher, ObjectKey, dcp_shard, kda_shard
from kv_transfer.objects import KDACheckpoint, MLABlock, ResumeState, StateLayout
from kv_transfer.tiers.base import ByteStore


@dataclass(slots=True)
class PutResult:
    num_stored: int = 0  # objects written by this call
    num_skipped: int = 0  # objects already present in some tier
    num_refused: int = 0  # objects no tier accepted (backpressure)
    bytes_stored: int = 0  # encoded bytes written
    bytes_skipped: int = 0  # encoded bytes not written because present
    num_refreshed: int = 0  # objects already stored that this put refreshed (NOTE 4)
    keys_stored: list[str] = field(default_factory=list)  # str(ObjectKey) written


@dataclass(slots=True)
class ResumePoint:
    """Where a prompt can resume. position 0 means nothing usable is stored."""

    position: int  # tokens whose state can be loaded
    num_blocks: int  # full MLA blocks before position
    has_tail: bool  # position is unaligned (a tail is part of the state)
    tiers: dict[str, str] = field(default_factory=dict)  # piece key -> tier holding it
    slowest_tier: str | None = None  # the lowest tier (in tier order) any piece comes from

    @property
    def hit(self) -> bool:
        return self.position > 0


class StateStore:
    """Facade over an ordered list of ``ByteStore`` tiers for one key space.

    NOTES
    1. A resumable position always has every KDA shard present: resumable
       length never exceeds the newest complete KDA checkpoint <= max_position.
    2. MLA objects are keyed without a TP rank (stored once per TP group).
    3. load_state returns state only if every piece passed checksum and layout
       checks; otherwise None (never partial or unverified data).
    4. A put refreshes what it finds stored, in prompt order, in every tier that orders
       evictions (``touch``): the MLA blocks before ``state.first_block`` (the prefix the
       writer skipped because the store held it) and the pieces already present. A session
       that resumes from its device every turn reads nothing from the host tier, so without
       this its host copy aged out while the session was active. The simulator's host tiers
       refresh on a turn's store the same way (``disagg.tools.sim.cache``).
    """

    def __init__(self, tiers: Sequence[ByteStore], layout: StateLayout, *, tp_size: int = 1,
                 dcp_size: int = 1, write_behind: bool = True, promote: bool = True,
                 event_log: EventLog | None = None, worker_id: str = "", io_threads: int | None = None,
                 device_checks: bool = True):
        if not tiers:
            raise ValueError("a StateStore needs at least one tier")
        if layout.kda_heads % tp_size:
            raise ValueError(f"tp_size {tp_size} does not divide {layout.kda_heads} KDA heads")
        self.tiers = list(tiers)
        self.layout = layout
        self.tp_size, self.dcp_size = tp_size, dcp_size
        self.promote = promote
        self.event_log, self.worker_id = event_log, worker_id
        self._lock = threading.Lock()
        self.io_threads = io_threads if io_threads is not None else min(8, os.cpu_count() or 1)
        self.device_checks = device_checks  # direct loads checksum on the device where it can (direct NOTE 4)
        self._pool: ThreadPoolExecutor | None = None
        self._tails: dict[bytes, set[int]] = {}  # parent digest -> tail lengths
        self._tail_keys: dict[bytes, tuple[bytes, int]] = {}  # tail digest -> (parent, length)
        self._counters = dict.fromkeys(
            ("num_put_objects", "num_put_skipped", "num_put_refused", "bytes_put", "num_loads",
             "num_load_hits", "num_load_misses", "num_missing_pieces", "num_corrupt_pieces",
             "num_promoted", "num_demoted", "num_demote_dropped", "num_retention_demoted",
             "num_put_refreshed", "num_recalls", "num_recalled"), 0)
        first = self.tiers[0]
        if write_behind and len(self.tiers) > 1 and getattr(first, "on_evict", False) is None:
            first.on_evict = self._demote

    # ---- keys ----------------------------------------------------------
    def _shards(self, kind: str, digest: bytes) -> list[str]:
        if kind == "kda":
            return [str(ObjectKey("kda", digest, kda_shard(r, self.tp_size))) for r in range(self.tp_size)]
        if self.dcp_size == 1:
            return [str(ObjectKey(kind, digest))]
        return [str(ObjectKey(kind, digest, dcp_shard(r, self.dcp_size))) for r in range(self.dcp_size)]

    @staticmethod
    def _mla_key(kind: str, digest: bytes, blk: MLABlock) -> str:
        shard = dcp_shard(blk.dcp_rank, blk.dcp_size) if blk.dcp_size > 1 else ""
        return str(ObjectKey(kind, digest, shard))

    def _locate(self, keys: list[str]) -> dict[str, int]:
        """key -> index of the first tier holding it (absent keys left out)."""
        found: dict[str, int] = {}
        todo = list(dict.fromkeys(keys))
        for i, tier in enumerate(self.tiers):
            if not todo:
                break
            hits = tier.contains(todo)
            found.update((k, i) for k, h in zip(todo, hits, strict=True) if h)
            todo = [k for k, h in zip(todo, hits, strict=True) if not h]
        return found

    def _refresh(self, keys: list[str]) -> int:
        """Refresh ``keys`` (in order) in every tier that orders evictions (NOTE 4); a tier ignores
        the keys it does not hold, so the prefix needs no lookup first."""
        return sum(touch(keys) for tier in self.tiers if (touch := getattr(tier, "touch", None)) is not None)

    def block_keys(self, hashes: Sequence[bytes]) -> list[str]:
        """The keys of the MLA blocks named by ``hashes`` (every DCP shard of each), in order."""
        return [k for h in hashes for k in self._shards("mla", h)]

    def checkpoint_keys(self, digest: bytes, unaligned: bool | None = None) -> list[str]:
        """The keys of the resume point whose prefix digest is ``digest``: every KDA shard, and
        the tail shards when the point is ``unaligned`` (None: when this store put a tail there;
        another process's store may have put it)."""
        keys = self._shards("kda", digest)
        if unaligned is None:
            with self._lock:
                unaligned = digest in self._tail_keys
        return keys + self._shards("tail", digest) if unaligned else keys

    def demote(self, keys: Sequence[ObjectKey | str]) -> int:
        """Have every tier that orders its evictions (``demote``) evict ``keys`` first, the
        first key first (host ``HostTier`` NOTE 5: still readable until evicted); tiers
        without an order (disk) keep theirs. Returns how many keys some tier held."""
        names = [str(k) for k in keys]
        found = 0
        for tier in self.tiers:
            demote = getattr(tier, "demote", None)
            if demote is not None and names:
                found += demote(names)
        with self._lock:
            self._counters["num_retention_demoted"] += found
        return found

    def hold(self, keys: Sequence[ObjectKey | str]) -> int:
        """A device of the node holds ``keys``: every tier that counts device holds (the host
        tier, ``HostTier`` NOTE 8) evicts them first. Returns how many some tier held."""
        names = [str(k) for k in keys]
        return sum(hold(names) for tier in self.tiers if (hold := getattr(tier, "hold", None)) is not None)

    def unhold(self, keys: Sequence[ObjectKey | str]) -> int:
        """The device lets ``keys`` go (``hold``'s reverse): how many no device holds any more."""
        names = [str(k) for k in keys]
        return sum(unhold(names) for tier in self.tiers if (unhold := getattr(tier, "unhold", None)) is not None)

    def recall(self, tokens: Sequence[int], hasher: BlockHasher, from_position: int, max_position: int,
               timeout_s: float) -> int:
        """Ask the node's devices (``HostTier`` NOTE 9) for what the first tier lacks of: the MLA
        blocks of ``tokens`` from the block holding ``from_position`` to ``max_position``, the KDA
        checkpoints at their ends, and the resume points inside the first of those blocks the
        tier lacks (where a turn ended); wait up to ``timeout_s``. Returns how many came back
        (then look up again)."""
        recall = getattr(self.tiers[0], "recall", None) if self.tiers else None
        bs = self.layout.block_size
        lo, hi = from_position // bs, min(max_position, len(tokens)) // bs
        if recall is None or hi <= lo:
            return 0
        every = hasher.block_hashes(tokens[: hi * bs])
        hashes = every[lo:]
        # each block, and the KDA state at its end (a checkpoint there, if a device has one)
        keys = [k for h in hashes for k in self._shards("mla", h) + self._shards("kda", h)]
        # and every tail in the first block the tier lacks, where a turn's end sits (as
        # resumable_length probes it): a node mate's session that this prompt goes on from
        present = self.tiers[0].contains([self._shards("mla", h)[0] for h in hashes])
        n_avail = lo + next((i for i, ok in enumerate(present) if not ok), len(present))
        start, end = n_avail * bs, min(max_position, len(tokens), n_avail * bs + bs - 1)
        if end > start:
            parent = every[n_avail - 1] if n_avail else hasher.root
            keys += [k for d in hasher.tail_digests(parent, tokens[start:end])
                     for k in self._shards("kda", d) + self._shards("tail", d)]
        got = recall(keys, timeout_s)
        with self._lock:
            self._counters["num_recalls"] += 1
            self._counters["num_recalled"] += got
        return got

    def contains_keys(self, keys: Sequence[ObjectKey | str]) -> list[bool]:
        """Presence of each key in any tier (one ``contains`` call per tier)."""
        names = [str(k) for k in keys]
        where = self._locate(names)
        return [n in where for n in names]

    # ---- put -----------------------------------------------------------
    def put_state(self, tokens: Sequence[int], state: ResumeState, hasher: BlockHasher,
                  tp_rank: int | None = 0) -> PutResult:
        """Store every piece of ``state`` not already present in some tier.

        Args:
            tokens: the prompt (at least ``state.position`` tokens).
            state: blocks, tail and KDA shard(s) at ``state.position``.
            hasher: the key space (block size must match the layout).
            tp_rank: the TP rank putting the state; its KDA shards must carry
                this rank (None: any, e.g. a gathered state with every shard).
        """
        layout, bs, p = self.layout, self.layout.block_size, state.position
        assert hasher.block_size == bs, "hasher and layout disagree on block size"
        assert state.layout.fingerprint() == layout.fingerprint(), "state from another layout"
        assert p <= len(tokens), "state past the end of the tokens"
        n_full = p // bs
        hashes = hasher.block_hashes(tokens[: n_full * bs])
        parent = hashes[n_full - 1] if n_full else hasher.root
        prefix = hasher.prefix_digest(tokens, p, hashes) if p else parent
        pieces: list[tuple[str, MLABlock | KDACheckpoint, bytes | None]] = []
        for i, blk in enumerate(state.mla_blocks):
            idx = state.first_block + i
            assert blk.start == idx * bs and blk.span == bs, f"block {idx} misplaced: {blk}"
            pieces.append((self._mla_key("mla", hashes[idx], blk), blk, None))
        if state.tail is not None:
            assert state.tail.start == n_full * bs and state.tail.span == p % bs, "tail misplaced"
            pieces.append((self._mla_key("tail", prefix, state.tail), state.tail, parent))
            with self._lock:
                self._tails.setdefault(parent, set()).add(p % bs)
                self._tail_keys[prefix] = (parent, p % bs)
        for k in state.kda:
            assert tp_rank is None or k.tp_rank == tp_rank, "KDA shard of another TP rank"
            assert k.tp_size == self.tp_size, f"KDA shard for tp_size {k.tp_size}, store has {self.tp_size}"
            pieces.append((str(ObjectKey("kda", prefix, kda_shard(k.tp_rank, k.tp_size))), k, None))
        present = self._locate([key for key, _, _ in pieces])
        result = PutResult()
        result.num_refreshed = self._refresh(self.block_keys(hashes[: min(state.first_block, n_full)])
                                             + [key for key, _, _ in pieces if key in present])
        todo = [(key, obj, par, codec.encoded_size(obj)) for key, obj, par in pieces if key not in present]
        for key, obj, _ in pieces:
            if key in present:
                result.num_skipped += 1
                result.bytes_skipped += codec.encoded_size(obj)
        tiers = self._put_pieces(todo, _staging_views(state))
        for (key, obj, par, nbytes), tier in zip(todo, tiers, strict=True):
            if tier is None:
                result.num_refused += 1
                continue
            result.num_stored += 1
            result.bytes_stored += nbytes
            result.keys_stored.append(key)
            pos = obj.position if isinstance(obj, KDACheckpoint) else (p if par is not None else None)
            self._emit("stored", key, tier, nbytes, pos, par)
        with self._lock:
            self._counters["num_put_objects"] += result.num_stored
            self._counters["num_put_skipped"] += result.num_skipped
            self._counters["num_put_refused"] += result.num_refused
            self._counters["num_put_refreshed"] += result.num_refreshed
            self._counters["bytes_put"] += result.bytes_stored
        return result

    def _put_pieces(self, todo: list[tuple[str, MLABlock | KDACheckpoint, bytes | None, int]],
                    staging: _Staging | None = None) -> list[str | None]:
        """Store each piece; the tier that took it (None: refused everywhere).

        When the first tier reserves in batches (``reserve_many`` / ``commit_many``: one round
        trip each to a node's store process), every piece is reserved at once, encoded straight
        into its region on the I/O threads (full blocks through ``BlockCodec``), then committed
        at once (or sealed by the tier's owner); pieces it refuses go down the tiers one by
        one. ``staging``: the state's one buffer of rows, when it carries them so.
        """
        first = self.tiers[0]
        if not todo or _batch_op(first, "reserve_many") is None:
            return self._parallel(lambda piece: self._put_object(*piece), todo)
        reservations = first.reserve_many([(key, nbytes) for key, _, _, nbytes in todo])
        blocks = codec.block_codec(self.layout)
        # the owner of a node's tier checksums what a client wrote (module docstring, "Publishing")
        remote_seal = getattr(first, "seals_remotely", False) and _batch_op(first, "seal_many") is not None
        jobs, unsealed = self._encode_jobs(todo, reservations, staging, blocks, first, remote_seal)
        written = [res for res in reservations if res is not None and not res.duplicate]
        try:
            self._parallel(lambda job: job(), jobs, min_per_thread=0)
        except BaseException:
            first.abort_many(written)
            raise
        to_seal = {id(res) for res in unsealed}
        rest = [res for res in written if id(res) not in to_seal]
        stored = dict(zip(map(id, unsealed), first.seal_many(unsealed, blocks.algo) if unsealed else [], strict=True))
        stored.update(zip(map(id, rest), first.commit_many(rest), strict=True))
        committed = (stored[id(res)] for res in written)
        out: list[str | None] = []
        for piece, res in zip(todo, reservations, strict=True):
            if res is not None and (res.duplicate or next(committed)):
                out.append(first.name)
            else:  # no room in the first tier (backpressure): the lower tiers, one by one
                out.append(self._put_object(*piece, first_tier=1))
        return out

    def _encode_jobs(self, todo, reservations, staging: _Staging | None, blocks: codec.BlockCodec, tier,
                     remote_seal: bool) -> tuple[list, list]:
        """(encode jobs for the I/O threads, reservations left for the tier to seal).

        Full blocks that are consecutive slices of the state's staging buffer and sit in evenly
        spaced slots of the arena form runs; a run is encoded by ``BlockCodec.encode_run`` in parts
        of at most 1 / ``io_threads`` of the state's blocks. Every other piece is encoded on its own."""
        size = blocks.total_len
        mapping = getattr(getattr(tier, "arena", None), "view", None)  # runs need the tier's arena
        arena = np.frombuffer(mapping, dtype=np.uint8) if staging is not None and mapping is not None else None
        step = -(-len(staging.index) // max(self.io_threads, 1)) if staging is not None else 1  # blocks per part
        jobs: list = []
        unsealed: list = []
        run: list = []  # [(block index in the staging buffer, reservation, block start)]

        def flush() -> None:
            if not run:
                return
            pitch = run[1][1].offset - run[0][1].offset if len(run) > 1 else size
            for k in range(0, len(run), step):
                part = run[k : k + step]
                dst = np.lib.stride_tricks.as_strided(arena[part[0][1].offset :], (len(part), size), (pitch, 1))
                i0 = part[0][0]
                src = staging.rows[:, i0 * blocks.block_size : (i0 + len(part)) * blocks.block_size]
                starts = np.array([start for _, _, start in part], dtype=np.int64)
                jobs.append(functools.partial(blocks.encode_run, dst, src, starts, not remote_seal))
            if remote_seal:
                unsealed.extend(res for _, res, _ in run)
            run.clear()

        def extends_run(i: int, res) -> bool:
            if not run or i != run[-1][0] + 1:
                return False
            gap = res.offset - run[-1][1].offset
            pitch = run[1][1].offset - run[0][1].offset if len(run) > 1 else gap
            return gap == pitch and gap >= size

        for (_, obj, parent, _), res in zip(todo, reservations, strict=True):
            if res is None or res.duplicate:
                continue
            full = isinstance(obj, MLABlock) and parent is None and obj.dcp_size == 1
            i = staging.index.get(id(obj)) if arena is not None and full else None
            if i is not None and res.nbytes == size:
                if not extends_run(i, res):
                    flush()
                run.append((i, res, obj.start))
                continue
            flush()
            if full:
                src = staging.view(obj) if staging is not None else None
                if src is None:  # a block of its own (on a device: one copy to the host first)
                    src = codec._as_numpy(obj.rows if obj.rows.device.type == "cpu" else obj.rows.cpu())
                jobs.append(functools.partial(blocks.encode_into, res.view, src, obj.start, not remote_seal))
                if remote_seal:
                    unsealed.append(res)
            else:
                jobs.append(functools.partial(codec.encode_into, obj, self.layout, res.view, parent))
        flush()
        return jobs, unsealed

    def _put_object(self, key: str, obj: MLABlock | KDACheckpoint, parent: bytes | None,
                    nbytes: int, first_tier: int = 0) -> str | None:
        data = None
        for tier in self.tiers[first_tier:]:
            reserve = getattr(tier, "reserve", None)
            if reserve is not None:  # encode straight into the tier's memory
                res = reserve(key, nbytes)
                if res is None:
                    continue
                if not res.duplicate:
                    try:
                        codec.encode_into(obj, self.layout, res.view, parent)
                    except BaseException:
                        res.abort()
                        raise
                if res.commit():
                    return tier.name
                continue
            if data is None:
                data = codec.encode(obj, self.layout, parent)
            if tier.put_bytes(key, data):
                return tier.name
        return None

    def _demote(self, key: str, data: bytes) -> None:
        """Host eviction callback: write the object to the next tier that takes it."""
        for tier in self.tiers[1:]:
            if tier.put_bytes(key, data):
                with self._lock:
                    self._counters["num_demoted"] += 1
                self._emit("moved", key, tier.name, len(data))
                return
        with self._lock:
            self._counters["num_demote_dropped"] += 1
            if key.startswith("tail:"):
                self._forget_tail(ObjectKey.parse(key).digest)

    def _forget_tail(self, digest: bytes) -> None:
        got = self._tail_keys.pop(digest, None)
        if got is not None:
            parent, length = got
            lengths = self._tails.get(parent)
            if lengths is not None:
                lengths.discard(length)
                if not lengths:
                    del self._tails[parent]

    # ---- lookup --------------------------------------------------------
    def resumable_length(self, tokens: Sequence[int], hasher: BlockHasher,
                         max_position: int | None = None, held_blocks: int = 0) -> ResumePoint:
        """The furthest resume point <= max_position (default len(tokens)); ``held_blocks``: the
        leading blocks the caller holds itself (its device: a delta load skips them), taken as
        present."""
        bs = self.layout.block_size
        assert hasher.block_size == bs, "hasher and layout disagree on block size"
        max_p = len(tokens) if max_position is None else min(max_position, len(tokens))
        hashes = hasher.block_hashes(tokens[: max_p // bs * bs])
        block_keys = [self._shards("mla", h) for h in hashes]
        held = min(held_blocks, len(block_keys))
        where = self._locate([k for ks in block_keys[held:] for k in ks])
        n_avail = held
        while n_avail < len(block_keys) and all(k in where for k in block_keys[n_avail]):
            n_avail += 1
        # candidates: (position, pieces at the point: kda shards + tail shards)
        candidates: list[tuple[int, list[str], list[str], bytes]] = []
        for k in range(1, n_avail + 1):  # KDA keys made only for the candidates looked up (below)
            candidates.append((k * bs, None, [], hashes[k - 1]))
        with self._lock:
            tails = {k: sorted(self._tails.get(hashes[k - 1] if k else hasher.root, ()))
                     for k in range(n_avail + 1)}
        for k, lengths in tails.items():
            parent = hashes[k - 1] if k else hasher.root
            for t in lengths:
                if k * bs + t <= max_p:
                    digest = hasher.tail_digest(parent, tokens[k * bs : k * bs + t])
                    candidates.append((k * bs + t, self._shards("kda", digest), self._shards("tail", digest), digest))
        # Tails another process stored are not in this store's index: probe every tail length in
        # the block after the last available one (where turn-end checkpoints sit), in one pass.
        start = n_avail * bs
        probe_end = min(max_p, start + bs - 1)
        if probe_end > start:
            known = {c[0] for c in candidates}
            parent = hashes[n_avail - 1] if n_avail else hasher.root
            for t, digest in enumerate(hasher.tail_digests(parent, tokens[start:probe_end]), start=1):
                if start + t not in known:
                    candidates.append((start + t, self._shards("kda", digest), self._shards("tail", digest), digest))
        # Furthest first, located a few at a time: the latest checkpoint is usually there, so the
        # hundreds of earlier block boundaries of a long prompt are rarely looked up at all.
        candidates.sort(key=lambda c: c[0], reverse=True)
        for lo, hi in _chunks(len(candidates)):
            batch = [(p, self._shards("kda", d) if kda is None else kda, tail, d)
                     for p, kda, tail, d in candidates[lo:hi]]
            where.update(self._locate([k for _, kda, tail, _ in batch for k in kda + tail]))
            with self._lock:
                for _, _, tail, digest in batch:
                    if tail and not any(k in where for k in tail):
                        self._forget_tail(digest)
            for p, kda, tail, _ in batch:
                if all(k in where for k in kda + tail):
                    pieces = [k for ks in block_keys[held : p // bs] for k in ks] + tail + kda
                    tiers = {k: self.tiers[where[k]].name for k in pieces}
                    slowest = self.tiers[max(where[k] for k in pieces)].name
                    return ResumePoint(p, p // bs, bool(tail), tiers, slowest)
        return ResumePoint(0, 0, False)

    # ---- load ----------------------------------------------------------
    def warm(self, device: torch.device | str) -> bool:
        """Ready direct loads to ``device`` (direct NOTE 4): the device checksum's constants are
        built and its kernel compiled now, not in the first resumed request's time to first
        token. False when loads to that device check on the host."""
        if not self.device_checks:
            return False
        bc = codec.block_codec(self.layout)
        return device_crc.warm(bc.end, bc.algo, device)

    def load_state(self, tokens: Sequence[int], position: int, hasher: BlockHasher,
                   layout: StateLayout | None = None, *, first_block: int = 0,
                   dcp_size: int = 1, dcp_rank: int = 0,
                   tp_ranks: Sequence[int] | None = None, contiguous: bool = False,
                   device: torch.device | str | None = None) -> ResumeState | None:
        """Load and verify the state at ``position``; None if any piece is missing or corrupt.

        Args:
            contiguous: decode the MLA blocks straight into one buffer (page-locked where CUDA
                exists), ``ResumeState.mla_rows``, ready for a batched scatter (no DCP reshard).
            device: with ``contiguous``, put ``mla_rows`` on this device, copied from the first
                tier's arena without host staging where it pins in batches (``kv_transfer.direct``).
            first_block: skip blocks the caller already holds.
            dcp_size, dcp_rank: the DCP shard wanted (stored shards are resharded).
            tp_ranks: KDA shards to load (default: all ``tp_size``).
        """
        layout = layout or self.layout
        bs = layout.block_size
        assert 0 < position <= len(tokens), f"bad resume position {position}"
        with self._lock:
            self._counters["num_loads"] += 1
        n_full = position // bs
        hashes = hasher.block_hashes(tokens[: n_full * bs])
        prefix = hasher.prefix_digest(tokens, position, hashes)
        blocks: list[MLABlock] = []
        rows = None
        if contiguous and self.dcp_size == dcp_size == 1 and n_full > first_block:
            keys = [str(ObjectKey("mla", hashes[i])) for i in range(first_block, n_full)]
            if device is not None and _batch_op(self.tiers[0], "get_views") is not None:
                rows = self._load_blocks_direct(keys, first_block, layout, torch.device(device))
            else:
                shape = (layout.num_mla_layers, (n_full - first_block) * bs, layout.latent_dim)
                rows = _alloc_rows(shape, getattr(torch, layout.cache_dtype))
                if not self._load_blocks_into(keys, first_block, layout, rows):
                    rows = None
                elif device is not None:
                    rows = rows.to(device)
            if rows is None:
                return self._miss()
            blocks = [MLABlock(rows[:, j * bs : (j + 1) * bs], (first_block + j) * bs, bs)
                      for j in range(n_full - first_block)]
        else:
            groups = self._load_groups([self._shards("mla", hashes[i]) for i in range(first_block, n_full)], layout,
                                       [(i * bs, bs) for i in range(first_block, n_full)])
            for shards in groups:
                if shards is None:
                    return self._miss()
                blocks.extend(reshard_dcp(shards, self.dcp_size, dcp_size)[dcp_rank :: dcp_size])
        tail = None
        if position % bs:
            shards = self._load_group(self._shards("tail", prefix), layout, place=(n_full * bs, position % bs))
            if shards is None:
                return self._miss()
            tail = reshard_dcp(shards, self.dcp_size, dcp_size)[dcp_rank]
        ranks = range(self.tp_size) if tp_ranks is None else tp_ranks
        kda = self._load_group([str(ObjectKey("kda", prefix, kda_shard(r, self.tp_size))) for r in ranks], layout,
                               place=position)
        if kda is None:
            return self._miss()
        with self._lock:
            self._counters["num_load_hits"] += 1
        return ResumeState(layout, position, blocks, first_block, tail, kda, mla_rows=rows)

    def _miss(self) -> None:
        with self._lock:
            self._counters["num_load_misses"] += 1
        return None

    def _load_groups(self, groups: list[list[str]], layout: StateLayout, places: list) -> list[list | None]:
        """``_load_group`` of each group, at its place (in parallel when there are several)."""
        return self._parallel(lambda i: self._load_group(groups[i], layout, place=places[i]), list(range(len(groups))))

    def _load_blocks_into(self, keys: list[str], first_block: int, layout: StateLayout,
                          rows: torch.Tensor) -> bool:
        """Load full block ``keys[j]`` (block ``first_block + j``) into ``rows[:, j * bs : (j + 1) * bs]``;
        False if one cannot be had.

        From a first tier that pins in batches (``get_views`` / ``release_many``: one round trip
        each to a node's store process) every block is verified and copied straight from the
        arena into ``rows`` on the I/O threads (``BlockCodec.decode_into``: checksum, then one
        copy; no allocation per block). Blocks it lacks, and any that fail there (corrupt,
        another format, misplaced), take the general per-object path through every tier.
        """
        bs = layout.block_size
        first = self.tiers[0]
        get_views = _batch_op(first, "get_views")
        done = [False] * len(keys)
        if get_views is not None:
            leases = get_views(keys)
            dst, blocks = codec._as_numpy(rows), codec.block_codec(layout)

            def fast(j: int) -> bool:
                if leases[j] is None:
                    return False
                try:
                    start = blocks.decode_into(leases[j].view, dst[:, j * bs : (j + 1) * bs])
                except CorruptObjectError:
                    return False  # the general path counts it, deletes it and tries the next tier
                return start == (first_block + j) * bs

            try:
                done = self._parallel(fast, list(range(len(keys))))
            finally:
                first.release_many([lease for lease in leases if lease is not None])
        todo = [j for j, ok in enumerate(done) if not ok]
        objs = self._parallel(lambda j: self._load_one(keys[j], layout, rows[:, j * bs : (j + 1) * bs],
                                                       place=((first_block + j) * bs, bs)), todo)
        return all(obj is not None for obj in objs)

    def _load_blocks_direct(self, keys: list[str], first_block: int, layout: StateLayout,
                            device: torch.device) -> torch.Tensor | None:
        """Full blocks ``keys`` from the first tier's arena straight into rows on ``device``
        (``kv_transfer.direct``); blocks that fail there take the general path. None on a miss."""
        first = self.tiers[0]
        leases = first.get_views(keys)
        try:
            got = direct.load_blocks(leases, codec.block_codec(layout), first_block, device, self._parallel,
                                     device_checks=self.device_checks)
        finally:  # every copy has completed (direct NOTE 2)
            first.release_many([lease for lease in leases if lease is not None])
        bs = layout.block_size
        for j in (j for j, ok in enumerate(got.verified) if not ok):
            host = _alloc_rows((layout.num_mla_layers, bs, layout.latent_dim), got.rows.dtype)
            if self._load_one(keys[j], layout, host, place=((first_block + j) * bs, bs)) is None:
                return None
            got.rows[:, j * bs : (j + 1) * bs].copy_(host)
        return got.rows

    def _parallel(self, fn, items: list, min_per_thread: int = 2) -> list:
        """``[fn(x) for x in items]`` on the I/O threads when there are enough items (at least
        ``min_per_thread`` per thread, and two): CRC checks and copies in and out of the tiers
        release the GIL, so pieces encode and verify in parallel."""
        if self.io_threads <= 1 or len(items) < max(2, min_per_thread * self.io_threads):
            return [fn(x) for x in items]
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="state-io")
        step = -(-len(items) // self.io_threads)  # one contiguous run per thread
        runs = [items[i : i + step] for i in range(0, len(items), step)]
        return [y for part in self._pool.map(lambda run: [fn(x) for x in run], runs) for y in part]

    def _load_group(self, keys: list[str], layout: StateLayout, into: torch.Tensor | None = None,
                    place=None) -> list | None:
        out = []
        for key in keys:
            obj = self._load_one(key, layout, into, place)
            if obj is None:
                return None
            out.append(obj)
        return out

    def _load_one(self, key: str, layout: StateLayout, out: torch.Tensor | None = None,
                  place=None) -> MLABlock | KDACheckpoint | None:
        """One verified object; an MLA object's rows land in ``out`` when given (no extra copy).

        ``place``: (start, span) of an MLA block or tail, or the position of a KDA shard. An
        object that is not the one its key and place name (valid bytes stored under another
        piece's key) is treated as corrupt: counted, deleted from its tier, the next tier tried.
        """
        for i, tier in enumerate(self.tiers):
            get_view = getattr(tier, "get_view", None)
            try:
                if get_view is not None:
                    lease = get_view(key)
                    if lease is None:
                        continue
                    with lease:  # copy out of the shared arena before the pin ends
                        obj = _decode_to(lease.view, layout, out, copy=True)
                        data = bytes(lease.view) if i and self.promote else None
                else:
                    data = tier.get_bytes(key)
                    if data is None:
                        continue
                    obj = _decode_to(data, layout, out, copy=False)
                if place is not None and not _fits(obj, key, place):
                    raise CorruptObjectError(f"{key}: {obj!r} is not the piece its key names")
            except CorruptObjectError:
                with self._lock:
                    self._counters["num_corrupt_pieces"] += 1
                tier.delete(key)
                self._emit("evicted", key, tier.name, 0)
                continue
            if i and self.promote and data is not None and self.tiers[0].put_bytes(key, data):
                with self._lock:
                    self._counters["num_promoted"] += 1
                self._emit("moved", key, self.tiers[0].name, len(data))
            return obj
        with self._lock:
            self._counters["num_missing_pieces"] += 1
        return None

    # ---- misc ----------------------------------------------------------
    def _emit(self, kind: str, key: str, tier: str, nbytes: int, position: int | None = None,
              parent: bytes | None = None) -> None:
        if self.event_log is not None:
            self.event_log.emit(StoreEvent(kind, key, key.split(":", 1)[0], tier, self.worker_id,
                                           position, parent, nbytes))

    def stats(self) -> dict:
        with self._lock:
            out: dict = dict(self._counters)
            out["num_tail_entries"] = len(self._tail_keys)
        for tier in self.tiers:
            st = getattr(tier, "stats", None)
            if st is not None:
                out[f"tier:{tier.name}"] = st()
        return out


_SHARD = re.compile(r"(?:tp|dcp)(\d+)of(\d+)")


def _fits(obj, key: str, place) -> bool:
    """``obj`` is the piece ``key`` names at ``place`` (see ``StateStore._load_one``)."""
    parsed = ObjectKey.parse(key)
    m = _SHARD.fullmatch(parsed.shard)
    rank, size = (int(m[1]), int(m[2])) if m else (0, 1)
    if parsed.kind == "kda":
        return isinstance(obj, KDACheckpoint) and (obj.position, obj.tp_rank, obj.tp_size) == (place, rank, size)
    return isinstance(obj, MLABlock) and (obj.start, obj.span, obj.dcp_rank, obj.dcp_size) == (*place, rank, size)


def _decode_to(buf, layout: StateLayout, out: torch.Tensor | None, copy: bool):
    """Decode one object; an MLA block's rows are copied into ``out`` when given."""
    if out is None:
        return codec.decode(buf, layout, copy=copy)
    obj = codec.decode(buf, layout, copy=False)
    if not isinstance(obj, MLABlock) or obj.rows.shape != out.shape:
        raise CorruptObjectError(f"expected an MLA block of shape {tuple(out.shape)}")
    codec.host_copy(out, obj.rows)
    return MLABlock(out, obj.start, obj.span, obj.dcp_size, obj.dcp_rank)


def _chunks(n: int, first: int = 8, rest: int = 128) -> list[tuple[int, int]]:
    """[(start, end)] covering range(n): ``first`` items, then ``rest`` at a time."""
    out, i = [], 0
    while i < n:
        j = min(n, i + (first if i == 0 else rest))
        out.append((i, j))
        i = j
    return out


@dataclass(slots=True)
class _Staging:
    """A state's one buffer of MLA rows (numpy [layers, n * bs, D]) and where each block is in it."""

    rows: np.ndarray
    index: dict[int, int]  # id(block) -> the block's index in ``rows``
    block_size: int

    def view(self, block) -> np.ndarray | None:
        i = self.index.get(id(block))
        return None if i is None else self.rows[:, i * self.block_size : (i + 1) * self.block_size]


def _staging_views(state: ResumeState) -> _Staging | None:
    """The blocks' rows in ``state.mla_rows`` (one conversion for all blocks), when the blocks
    are that buffer's views in order (ResumeState's contract; checked at both ends)."""
    rows, blocks = state.mla_rows, state.mla_blocks
    if rows is None or not blocks or rows.device.type != "cpu" or blocks[0].dcp_size != 1:
        return None
    bs = state.layout.block_size
    n = len(blocks)
    if rows.shape[1] != n * bs or blocks[0].rows.data_ptr() != rows.data_ptr() or \
            blocks[-1].rows.data_ptr() != rows[:, (n - 1) * bs].data_ptr():
        return None
    return _Staging(codec._as_numpy(rows), {id(b): i for i, b in enumerate(blocks)}, bs)


def _batch_op(tier, name: str):
    """``tier``'s batch operation ``name`` when its class defines one: a wrapper that intercepts
    single reads and writes (e.g. ``disagg.faults.FaultyTier``) keeps the per-object path."""
    return getattr(tier, name) if callable(getattr(type(tier), name, None)) else None


def _alloc_rows(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host buffer for loaded rows: page-locked where CUDA exists (torch caches those), else
    numpy memory, which is advised onto huge pages: a fresh 150 MB ``torch.empty`` spent 4x the
    copy's own time in 4 KiB page faults (docs/perf/cpu.md, "State path host-side cost")."""
    if _pinnable():
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    return torch.from_numpy(np.empty(shape, dtype=codec._as_numpy(torch.empty(0, dtype=dtype)).dtype)).view(dtype)


@cache
def _pinnable() -> bool:
    return torch.cuda.is_available()
