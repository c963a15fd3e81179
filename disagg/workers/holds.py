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
   the release (which refreshes). A write-back waiting behind more than
   ``max_pending_bytes`` is dropped and counted (the session is then recomputed or resumed from
   what the tier kept).
3. Holds are the connection's (``kv_transfer.tiers.host_ipc``): a replica that dies drops
   what it held, and its node's tier goes back to write-through order for those keys.
4. Only decoding devices hold (the simulator's Simulator NOTE 12): a P/D prefill device keeps
   prompts whose sessions live on their decode nodes.
5. What serving does not do yet, and the simulator's ``--host-write victim`` does: a worker
   reads its node mates' devices (the node's tier as the node reads it). Here a session whose
   host copy went first resumes from its own device, or is written back when evicted; a node
   mate that wants it (a shared document, a session that moved) recomputes it. The simulator's
   form of this (``--host-write victim-own``) loses to write-through in 7 of 8 held-out cells,
   so ``transfer.host.victim`` stays off until the mates' reads exist (docs/router.md "Round 41").
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

from kv_transfer.keys import BlockHasher

log = logging.getLogger(__name__)


class DeviceHolds:
    """Mirror one engine's resident sessions into the node's host tier (module docstring).

    Args:
        store: the node's ``kv_transfer.store.StateStore`` (its first tier counts holds).
        hasher: the worker's key space (salted per session's tenant).
        max_pending_bytes: write-backs queued beyond this are dropped (NOTE 2).
    """

    def __init__(self, store, hasher: BlockHasher, max_pending_bytes: int = 1 << 30):
        self.store = store
        self.hasher = hasher
        self.max_pending_bytes = max_pending_bytes
        self._keys: dict[int, tuple[list[str], list[str]]] = {}  # resident id -> (block keys, end point keys)
        self._held: dict[int, list[str]] = {}  # resident id -> keys held in the tier
        self._lock = threading.Lock()
        self._pending = 0  # bytes of queued write-backs
        self._queue: queue.Queue = queue.Queue()
        self.counters = dict.fromkeys(("kept", "taken", "evicted", "held_keys", "written_back", "written_back_bytes",
                                       "write_back_skipped", "write_back_dropped", "errors"), 0)
        self._thread = threading.Thread(target=self._run, name="device-holds", daemon=True)
        self._thread.start()

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
            if self._pending + nbytes > self.max_pending_bytes:
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
            keys = blocks + [k for p in change.checkpoints[:-1]
                             for k in self._point_keys(hasher, change.tokens, p, hashes)] + end
            self.store.hold(keys)
            self._held[change.resident_id] = keys
            self.counters["held_keys"] += len(keys)
        elif op == "unhold":
            rid = item[1]
            keys = self._held.pop(rid, None)
            with self._lock:
                self._keys.pop(rid, None)
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

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued hold, unhold and write-back is done (tests, a drain)."""
        done = threading.Event()
        threading.Thread(target=lambda: (self._queue.join(), done.set()), daemon=True).start()
        return done.wait(timeout_s)

    def stats(self) -> dict:
        with self._lock:
            return {**self.counters, "pending_bytes": self._pending, "residents_held": len(self._held)}

    def close(self) -> None:
        self._queue.put(None)

