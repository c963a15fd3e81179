"""A node's host tier as its devices' victim cache (``transfer.host.victim``).

Turns are written through to the node's host tier, so a device holds copies of what the
host tier holds, and a full node keeps its host tier's worth of state, not host plus
devices (docs/router.md "Round 40"). ``DeviceHolds`` mirrors one engine's device tier into
its node's host tier so the two hold less twice:

    engine (step thread)            DeviceHolds                     node's host tier
    session kept resident  ------>  hold its keys (queued) ------>  held keys evicted first
    session taken by a request ---> unhold (queued) ------------->  refreshed as the newest
    session evicted for memory ---> unhold; what the tier lacks:    refreshed; written back
                                    copied out now, stored (queued)  (the newest)
    a node mate recalls its keys    listener: exported between two   written back (not first)
                                    steps, stored, still held        <- the mate loads it

NOTES
1. A session's keys: its MLA blocks, and the KDA shards (with the tail, when unaligned) at
   each of its checkpoints (``kv_transfer.store.StateStore.block_keys`` / ``checkpoint_keys``),
   computed off the step thread when it is kept and remembered by the engine's resident id.
2. Eviction (``disagg.engine.reference.engine`` NOTE 9): on the step thread, one ``contains``
   round trip to the host tier for the session's blocks and its furthest checkpoint; the state from the first
   block the tier lacks is gathered to host memory before the pages are freed, and stored on
   this class's thread (``put_state``: what is present is refreshed, what is not is written),
   after the session's keys are released: stored while still held, each piece would go to the
   head of the eviction order and the next piece's room would evict it. Nothing missing: only
   the release (which refreshes). A write-back that would queue past ``max_pending_bytes``
   behind others is dropped and counted (the session is then recomputed or resumed from what
   the tier kept); one with nothing ahead of it is always queued, whatever its size (a K3
   session of 128K tokens holds about 1.9 GB).
3. Holds are the connection's (``kv_transfer.tiers.host_ipc``): a replica that dies drops
   what it held, and its node's tier goes back to write-through order for those keys.
4. Only decoding devices hold (the simulator's Simulator NOTE 12): a P/D prefill device keeps
   prompts whose sessions live on their decode nodes.
5. Recalls (``HostTier`` NOTE 9): a node mate that misses blocks this device holds, or the
   checkpoint at a block's end (a shared document, a session that moved), asks the tier for
   them and waits. This class listens on a connection of its own; for each held session asked
   about it writes back, from the first of its blocks the tier lacks, the state at the furthest
   checkpoint within the blocks asked for and at the checkpoints in the block after them (a
   prompt's or a turn's end, whose tail the asker resumes where its prompt goes on the same
   way), exported from the engine between two steps (``export_fn``), and keeps holding them.
   Residents that copied a shared prefix each hold its keys; a key asked for is written back
   once, by the resident that reaches furthest (the newest of equals), and stays found while
   any holds it.
   So the node's devices and its host tier are read as one tier, as the simulator's
   ``--host-write victim`` reads them; without it (``recall_ms`` 0, the simulator's
   ``victim-own``) the held-out cells lost what workers share (docs/router.md "Round 41").
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kv_transfer.keys import BlockHasher

if TYPE_CHECKING:
    from kv_transfer.objects import ResumeState

log = logging.getLogger(__name__)


class DeviceHolds:
    """Mirror one engine's resident sessions into the node's host tier (module docstring).

    Args:
        store: the node's ``kv_transfer.store.StateStore`` (its first tier counts holds).
        hasher: the worker's key space (salted per session's tenant).
        max_pending_bytes: write-backs that would queue beyond this behind others are dropped (NOTE 2).
        export_fn: ``(resident id, position, first block) -> ResumeState | None``, the engine's
            ``export_resident`` run between two steps; with it, this device answers recalls (NOTE 5).
    """

    def __init__(self, store, hasher: BlockHasher, max_pending_bytes: int = 1 << 30,
                 export_fn: Callable[[int, int, int], ResumeState | None] | None = None):
        self.store = store
        self.hasher = hasher
        self.max_pending_bytes = max_pending_bytes
        self.export_fn = export_fn
        self._keys: dict[int, tuple[list[str], list[str]]] = {}  # resident id -> (block keys, end point keys)
        self._held: dict[int, list[str]] = {}  # resident id -> keys held in the tier
        # NOTE 5: held resident -> (tenant, tokens, checkpoints, block keys); its held keys: _held
        self._residents: dict[int, tuple[str, list[int], tuple[int, ...], list[str]]] = {}
        self._by_key: dict[str, dict[int, int]] = {}  # block or point key -> {resident: blocks it reaches}
        self._lock = threading.Lock()
        self._pending = 0  # bytes of queued write-backs
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self.counters = dict.fromkeys(("kept", "taken", "evicted", "held_keys", "written_back", "written_back_bytes",
                                       "write_back_skipped", "write_back_dropped", "errors", "recalls_heard",
                                       "recalls_answered", "recalled_objects", "recalled_bytes"), 0)
        self._thread = threading.Thread(target=self._run, name="device-holds", daemon=True)
        self._thread.start()
        self._listener = None
        if export_fn is not None and hasattr(store.tiers[0], "recalled"):
            self._listener = threading.Thread(target=self._listen, name="device-holds-recalls", daemon=True)
            self._listener.start()

    # -- the engine's hook (step thread) ----------------------------------------------------
    def on_change(self, change) -> None:
        """``ReferenceEngine.on_resident``: queue a hold or unhold; on eviction, copy out what the
        tier lacks first (NOTE 2)."""
        self.counters[change.kind] += 1
        if change.kind == "kept":
            self._queue.put(("hold", change))
        elif change.kind == "taken":
            self._queue.put(("unhold", change.resident_id))
        else:
            self._write_back(change)

    def _write_back(self, change) -> None:
        try:
            position = change.checkpoints[-1] if change.checkpoints else None
            blocks, point = self._keys_of(change, position) if position is not None else ([], [])
        finally:  # released before the write-back is stored (NOTE 2), and whatever happens
            self._queue.put(("unhold", change.resident_id))
        if position is None:
            return
        # the node's host tier alone (one socket round trip): a lower tier's lookup may be a Ray call
        present = self.store.tiers[0].contains(blocks + point)
        first = next((i for i, ok in enumerate(present[: len(blocks)]) if not ok), len(blocks))
        if first == len(blocks) and all(present[len(blocks):]):
            self.counters["write_back_skipped"] += 1
            return
        state = change.export(position, first)
        nbytes = state.nbytes
        with self._lock:
            if self._pending and self._pending + nbytes > self.max_pending_bytes:
                self.counters["write_back_dropped"] += 1
                return
            self._pending += nbytes
        self._queue.put(("put", change, state, nbytes))

    # -- keys (NOTE 1) ----------------------------------------------------------------------
    def _keys_of(self, change, position: int) -> tuple[list[str], list[str]]:
        """(block keys up to ``position``, the keys of the resume point there)."""
        with self._lock:
            known = self._keys.get(change.resident_id)
        blocks, end = known if known is not None else self._compute(change)[:2]  # evicted before it was held
        n_full = position // self.hasher.block_size
        return blocks[:n_full], end

    def _compute(self, change) -> tuple[list[str], list[str], list[bytes]]:
        """(block keys, the keys of the furthest checkpoint, block digests), remembered by resident id."""
        hasher = self.hasher.with_salt(change.cache_salt)
        hashes = hasher.block_hashes(change.tokens)
        end = self._point_keys(hasher, change.tokens, change.checkpoints[-1], hashes) if change.checkpoints else []
        blocks = self.store.block_keys(hashes)
        with self._lock:
            self._keys[change.resident_id] = (blocks, end)
        return blocks, end, hashes

    def _point_keys(self, hasher: BlockHasher, tokens: list[int], position: int, hashes: Sequence[bytes]) -> list[str]:
        digest = hasher.prefix_digest(tokens, position, list(hashes))
        return self.store.checkpoint_keys(digest, position % hasher.block_size != 0)

    # -- this class's thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._do(item)
            except Exception:  # noqa: BLE001 - a failed hold or write-back loses reuse, never output
                self.counters["errors"] += 1
                log.warning("device holds: %s failed", item[0], exc_info=True)
            finally:
                self._queue.task_done()

    def _do(self, item: tuple) -> None:
        op = item[0]
        if op == "hold":
            change = item[1]
            blocks, end, hashes = self._compute(change)
            hasher = self.hasher.with_salt(change.cache_salt)
            points = {p: self._point_keys(hasher, change.tokens, p, hashes) for p in change.checkpoints[:-1]}
            keys = blocks + [k for ks in points.values() for k in ks] + end
            self.store.hold(keys)
            self._held[change.resident_id] = keys
            if change.checkpoints:
                points[change.checkpoints[-1]] = end
            per_block = max(1, len(blocks) // max(1, len(hashes)))
            with self._lock:  # NOTE 5: what recalls find, as (resident, the blocks it reaches)
                rid = change.resident_id
                self._residents[rid] = (change.cache_salt, change.tokens, change.checkpoints, blocks)
                by_key, bs = self._by_key, self.hasher.block_size
                for i, k in enumerate(blocks):  # residents that copied a shared prefix hold its keys each
                    by_key.setdefault(k, {})[rid] = i // per_block + 1
                for p, ks in points.items():
                    for k in ks:
                        by_key.setdefault(k, {})[rid] = p // bs
            self.counters["held_keys"] += len(keys)
        elif op == "unhold":
            rid = item[1]
            keys = self._held.pop(rid, None)
            with self._lock:
                self._keys.pop(rid, None)
                if self._residents.pop(rid, None) is not None:
                    for k in keys:  # what _by_key maps of it is among what it held
                        holders = self._by_key.get(k)
                        if holders is not None and holders.pop(rid, None) is not None and not holders:
                            del self._by_key[k]
            if keys:
                self.store.unhold(keys)
        else:
            _, change, state, nbytes = item
            try:
                hasher = self.hasher.with_salt(change.cache_salt)
                result = self.store.put_state(change.tokens[: state.position], state, hasher)
                self.counters["written_back"] += result.num_stored
                self.counters["written_back_bytes"] += result.bytes_stored
            finally:
                with self._lock:
                    self._pending -= nbytes

    # -- recalls (NOTE 5; this class's listener thread) ---------------------------------------
    def _listen(self) -> None:
        try:
            tier = self.store.tiers[0].reconnect()
        except Exception:  # noqa: BLE001 - no recalls answered: mates recompute
            log.warning("device holds: cannot listen for recalls", exc_info=True)
            return
        seq = 0
        try:
            while not self._closed:
                try:
                    seq, keys = tier.recalled(seq, 0.5)
                    if keys:
                        self._answer(keys)
                except ConnectionError:  # the tier's server is gone (its node is shutting down): none will come
                    if not self._closed:
                        log.info("device holds: the host tier's server closed; no more recalls answered")
                    return
                except Exception:  # noqa: BLE001 - a recall unanswered: the asker recomputes
                    self.counters["errors"] += 1
                    log.warning("device holds: answering a recall failed", exc_info=True)
                    if self._closed:
                        return
                    time.sleep(0.1)
        finally:
            tier.close()

    def _answer(self, keys: list[str]) -> None:
        """Write back what the recalled ``keys`` name of this device's held sessions (NOTE 5)."""
        self.counters["recalls_heard"] += 1
        asked: dict[int, tuple[int, int]] = {}  # resident -> (first block asked for, blocks reached)
        named: dict[int, set[str]] = {}  # resident -> the keys asked for that it holds
        with self._lock:
            for k in keys:
                for rid, reach in self._by_key.get(k, {}).items():
                    lo, hi = asked.get(rid, (reach, 0))
                    first = reach - 1 if k.startswith("mla") else reach  # a checkpoint needs no block of its own
                    asked[rid] = (min(lo, first), max(hi, reach))
                    named.setdefault(rid, set()).add(k)
            # one export per key: the furthest-reaching residents first (the newest of equals); a
            # resident whose every key asked for a chosen one holds too adds nothing
            covered: set[str] = set()
            found = {}
            for rid in sorted(asked, key=lambda r: (asked[r][1], r), reverse=True):  # all held (_by_key)
                if not named[rid] <= covered:
                    found[rid] = self._residents[rid]
                    covered |= named[rid]
        bs = self.hasher.block_size
        tier = self.store.tiers[0]
        for rid, (salt, tokens, checkpoints, blocks) in found.items():
            first, n_match = asked[rid]
            per_block = max(1, len(blocks) // max(1, len(tokens) // bs))
            if first < n_match:  # the asker named blocks the tier may still hold: from the first it lacks
                present = tier.contains(blocks[first * per_block : n_match * per_block])
                first += next((i for i, ok in enumerate(present) if not ok), len(present)) // per_block
            # the furthest checkpoint within the blocks asked for, and those in the block after them
            # (a prompt's or a turn's end: resumed from its tail where the asker's prompt goes on so)
            points = {c for c in checkpoints if n_match * bs < c < (n_match + 1) * bs}
            points.add(max((c for c in checkpoints if c <= n_match * bs), default=0))
            points = sorted(points - {0}, reverse=True)
            if not points:
                continue
            states = []
            for i, p in enumerate(points):
                state = self.export_fn(rid, p, min(first, p // bs) if i == 0 else p // bs)
                if state is None:  # no longer resident: its eviction wrote it back, or it runs again
                    break
                states.append(state)
            hasher = self.hasher.with_salt(salt)
            for state in states:
                result = self.store.put_state(tokens[: state.position], state, hasher)
                self.counters["recalled_objects"] += result.num_stored
                self.counters["recalled_bytes"] += result.bytes_stored
            if states:
                self.counters["recalls_answered"] += 1

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued hold, unhold and write-back is done (tests, a drain)."""
        done = threading.Event()
        threading.Thread(target=lambda: (self._queue.join(), done.set()), daemon=True).start()
        return done.wait(timeout_s)

    def stats(self) -> dict:
        with self._lock:
            return {**self.counters, "pending_bytes": self._pending, "residents_held": len(self._held)}

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)

