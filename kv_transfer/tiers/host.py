"""Host tier: a node-local shared-memory arena with an index, slab allocation,
a pluggable eviction policy and reader pins.

    writer:  reserve(key, n) -> region in the arena -> write bytes -> commit()
    reader:  get_view(key)   -> HostLease (pins; zero-copy memoryview) -> release()
    full:    evict unpinned objects in policy order (slab-aware, see below);
             no room even then -> put returns False (backpressure)
    demote:  demote(keys) -> those keys go to the head of the policy's order
             (``kv_transfer.tiers.eviction``: evicted first, still readable)

Eviction, for a request of size class c: (1) victims in policy order until the
allocation succeeds, for at most one slot's worth of bytes; (2) then only
victims whose eviction frees a slot of class c or empties a slab; (3) then
whole-slab reclaim of the least occupied slab without pins. Uniform sizes
therefore see the exact policy order. Evicted bytes go to ``on_evict`` (e.g.
the disk tier's write-behind queue), called outside the lock.

One process owns the index (this class, thread-safe); other processes on the
node use ``HostTierClient`` (``kv_transfer.tiers.host_ipc``) and read and write
the same arena directly.

Config example::

    host_tier:
      capacity_bytes: 68719476736   # 64 GiB, hard limit
      eviction: lru                 # lru | s3fifo | arc
      pin_memory: true              # cudaHostRegister where CUDA exists
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kv_transfer import checksum
from kv_transfer.events import EventLog, StoreEvent, object_kind_of
from kv_transfer.tiers.allocator import Allocation, SlabAllocator
from kv_transfer.tiers.arena import SharedArena
from kv_transfer.tiers.eviction import make_policy

log = logging.getLogger(__name__)

EvictCallback = Callable[[str, bytes], None]


@dataclass(slots=True)
class _Entry:
    alloc: Allocation  # where the bytes live
    num_pins: int = 0  # open leases
    demoted: bool = False  # demoted and not read since (NOTE 6)


class HostLease:
    """A pinned, read-only, zero-copy view of one object. Use as a context manager."""

    __slots__ = ("key", "lease_id", "view", "_release", "_released")

    def __init__(self, key: str, lease_id: int, view: memoryview, release: Callable[[int], None]):
        self.key = key  # object key
        self.lease_id = lease_id  # id the owner knows this pin by
        self.view = view  # read-only bytes of the object, inside the arena
        self._release = release
        self._released = False

    @property
    def nbytes(self) -> int:
        return len(self.view)

    def release(self) -> None:
        if self.release_view():
            self._release(self.lease_id)

    def release_view(self) -> bool:
        """Drop the view but not the pin (a batch release drops the pins together); False when
        this lease was already released."""
        if self._released:
            return False
        self._released = True
        try:
            self.view.release()
        except BufferError:
            pass  # a tensor still aliases it; the caller keeps it alive at its own risk
        return True

    def __enter__(self) -> HostLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(slots=True)
class Reservation:
    """A region reserved for ``key``; write ``view`` then ``commit()`` (or ``abort()``)."""

    key: str  # object key
    reservation_id: int  # id the owner knows this region by (0: duplicate)
    offset: int  # byte offset in the arena (-1: duplicate)
    nbytes: int  # bytes to write
    view: memoryview | None  # writable region (None: key already stored)
    commit_fn: Callable[[int], bool] | None = None
    abort_fn: Callable[[int], None] | None = None

    @property
    def duplicate(self) -> bool:
        return self.reservation_id == 0

    def commit(self) -> bool:
        return True if self.duplicate else self.commit_fn(self.reservation_id)

    def abort(self) -> None:
        if not self.duplicate:
            self.abort_fn(self.reservation_id)


class _Listener:
    """A holder's recall listener on a ``HostTier`` of its own process (``HostTier.reconnect``)."""

    def __init__(self, tier: HostTier, name: str):
        self.tier, self.name = tier, name

    def recalled(self, after: int, timeout_s: float) -> tuple[int, list[str]]:
        return self.tier.recalled(self.name, after, timeout_s)

    def close(self) -> None:
        self.tier.forget_listener(self.name)


class HostTier:
    """The owner of a host arena's index.

    NOTES
    1. allocated_bytes (committed + reserved slots) never exceeds capacity_bytes.
    2. An object with num_pins > 0 is never evicted, deleted or freed.
    3. Committed objects are immutable; a put of an existing key is a no-op (True), except that
       a demoted object put again is refreshed as a read would (NOTE 5).
    4. used_bytes == sum of committed object sizes; num_objects == len(index).
    5. ``demote`` only reorders: a demoted object stays readable until evicted, and a read
       refreshes it (``on_access``) like any other. So does a put of it: whoever writes it
       again wants it kept (another node spilling the copy it evicted: once the session left
       that node, this copy, demoted as a duplicate, is the one left).
    6. With ``hand_on_demoted`` False, an object evicted while demoted (not read since) is not
       handed to ``on_evict``: nothing is expected to read it again, so a spill to another
       node (``kv_transfer.spill``) passes it by. Other evictions are handed on as before.
    7. ``touch`` refreshes what a writer found already stored (``StateStore.put_state``: a
       turn's store of a session's prefix, whose blocks the tier holds and the turn did not
       read here, e.g. because it resumed them from a device). Without it a session that
       resumes from its device every turn ages out of the host tier while it is active.
    8. Device holds (``hold`` / ``unhold``; the node's host tier as its devices' victim cache,
       ``disagg.workers.holds``): a key some device of the node holds is a copy the node can
       lose first. Held keys are counted (one per holder); a key becoming held while stored, or
       stored while held, goes to the head of the eviction order, as ``demote`` puts it but
       without NOTE 6's flag (a device still reads it: evicted, it is handed on). A read or a
       ``touch`` refreshes it like any other (a turn's store of a session's prefix). A key no
       device holds any more is refreshed as the newest: the last device let it go, and its
       holder writes back what the tier lacks before freeing it.
    9. Recalls (the node's devices read as one tier with it, ``disagg.workers.holds`` NOTE 5):
       a reader that misses keys some other device of the node holds asks for them back
       (``recall``). The keys go on a list every listener (a holder, ``recalled``) reads; the
       reader waits until every listener has come back for the list's next entries (it wrote
       back what it could), nothing it asked for is held or stored any more, or the timeout.
       While a recall waits, held keys stored are not put at the head (the reader is about to
       load the write-back: its blocks, and the checkpoint it did not know to ask for). The
       node's index events follow what the node can read: a held key this tier evicts stays
       published (a recall brings it back) until its last holder lets it go unstored.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        eviction: str = "lru",
        slab_bytes: int | None = None,
        arena_dir: str | None = None,
        pin_memory: bool = False,
        prefault: bool = False,
        on_evict: EvictCallback | None = None,
        hand_on_demoted: bool = True,
        event_log: EventLog | None = None,
        worker_id: str = "",
        name: str = "host",
    ):
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._alloc = SlabAllocator(capacity_bytes, slab_bytes)
        self._policy = make_policy(eviction, capacity_bytes)
        self.arena = SharedArena.create(capacity_bytes, arena_dir, pin=pin_memory, prefault=prefault)
        self.on_evict = on_evict
        self.hand_on_demoted = hand_on_demoted  # NOTE 6
        self.event_log = event_log
        self.worker_id = worker_id
        self._lock = threading.Lock()
        self._index: dict[str, _Entry] = {}
        self._leases: dict[int, str] = {}
        self._pending: dict[int, tuple[str, Allocation]] = {}
        self._next_id = 1
        self._used_bytes = 0
        self._held: dict[str, int] = {}  # key -> holders (NOTE 8)
        self._cond = threading.Condition(self._lock)  # recalls wait on it (NOTE 9)
        self._recalls: deque[tuple[int, tuple[str, ...]]] = deque(maxlen=1024)  # (seq, keys) listeners read
        self._recall_seq = 0
        self._next_listener = 0
        self._listeners: dict[str, int] = {}  # listener -> the last recall it answered
        self._wanted: set[str] = set()  # recalled, not stored yet
        self._recalls_open = 0  # recalls waiting: held keys stored meanwhile are not put first
        self._withheld: set[str] = set()  # held keys evicted here whose eviction was not published (NOTE 9)
        self._counters = dict.fromkeys(
            ("num_puts", "num_duplicate_puts", "num_put_rejected", "num_hits", "num_misses",
             "num_evictions", "evicted_bytes", "num_deletes", "num_slab_reclaims", "num_evict_errors",
             "num_demoted", "num_refreshed", "num_hold_demoted", "num_hold_released", "num_recalls",
             "num_recalled_keys", "num_recalled_stored", "num_recall_timeouts", "num_withheld_evictions"), 0)

    # ---- writes --------------------------------------------------------
    def reserve(self, key: str, nbytes: int) -> Reservation | None:
        """Reserve ``nbytes`` for ``key``, evicting if needed. None: no room (backpressure)."""
        evicted: list[tuple[str, bytes | None, int]] = []
        with self._lock:
            entry = self._index.get(key)
            if entry is not None:
                self._counters["num_duplicate_puts"] += 1
                if entry.demoted:  # NOTE 3
                    entry.demoted = False
                    self._policy.on_access(key)
                return Reservation(key, 0, -1, nbytes, None)
            alloc = self._alloc.allocate(nbytes) if nbytes > 0 else None
            if alloc is None and 0 < nbytes <= self._alloc.max_object_bytes:
                alloc = self._evict_for(nbytes, evicted)
            if alloc is None:
                self._counters["num_put_rejected"] += 1
            else:
                rid = self._new_id()
                self._pending[rid] = (key, alloc)
        self._after_evictions(evicted)
        if alloc is None:
            return None
        view = self.arena.view[alloc.offset : alloc.offset + nbytes]
        return Reservation(key, rid, alloc.offset, nbytes, view, self.commit, self.abort)

    def commit(self, reservation_id: int) -> bool:
        with self._lock:
            key, alloc = self._pending.pop(reservation_id)
            if key in self._index:  # a concurrent writer won: drop ours
                self._alloc.free(alloc.offset)
                self._counters["num_duplicate_puts"] += 1
                return True
            self._index[key] = _Entry(alloc)
            self._used_bytes += alloc.nbytes
            self._policy.on_insert(key, alloc.nbytes)
            self._withheld.discard(key)
            if key in self._wanted:  # recalled: a reader waits for it (NOTE 9)
                self._wanted.discard(key)
                self._counters["num_recalled_stored"] += 1
                self._cond.notify_all()
            elif key in self._held and not self._recalls_open:  # the node's copy goes first (NOTE 8)
                self._policy.demote(key)
                self._counters["num_hold_demoted"] += 1
            self._counters["num_puts"] += 1
            assert self._alloc.allocated_bytes <= self.capacity_bytes, "capacity exceeded"
        self._emit("stored", key, alloc.nbytes)
        return True

    def abort(self, reservation_id: int) -> None:
        with self._lock:
            _, alloc = self._pending.pop(reservation_id)
            self._alloc.free(alloc.offset)

    def reserve_many(self, requests: Sequence[tuple[str, int]]) -> list[Reservation | None]:
        """``reserve`` for each (key, nbytes), in order (a batch is one round trip for a client)."""
        return [self.reserve(key, nbytes) for key, nbytes in requests]

    def commit_many(self, reservations: Sequence[Reservation]) -> list[bool]:
        """``commit`` each (non-duplicate) reservation, in order."""
        return [self.commit(r.reservation_id) for r in reservations]

    def abort_many(self, reservations: Sequence[Reservation]) -> None:
        for r in reservations:
            self.abort(r.reservation_id)

    def seal(self, reservation_id: int, algo: int) -> bool:
        """Checksum a reserved object into its trailer (``checksum.seal``), then commit it.

        For writers that leave the checksum to the tier's owner: a client of another process
        then spends no CPU (and no GIL) of its own on it (``HostTierClient.seal_many``)."""
        with self._lock:
            _, alloc = self._pending[reservation_id]
        if alloc.nbytes < checksum.TRAILER:
            raise ValueError(f"a {alloc.nbytes}-byte object has no room for a trailer")
        checksum.seal(self.arena.view[alloc.offset : alloc.offset + alloc.nbytes], algo)
        return self.commit(reservation_id)

    def seal_many(self, reservations: Sequence[Reservation], algo: int) -> list[bool]:
        """``seal`` each (non-duplicate) reservation, in order."""
        return [self.seal(r.reservation_id, algo) for r in reservations]

    def put_bytes(self, key: str, data: bytes | bytearray | memoryview) -> bool:
        return put_via_reservation(self, key, data)

    # ---- reads ---------------------------------------------------------
    def acquire(self, key: str) -> tuple[int, int, int] | None:
        """Pin ``key``: (lease_id, offset, nbytes), or None on a miss."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self._counters["num_misses"] += 1
                return None
            entry.num_pins += 1
            entry.demoted = False
            lease_id = self._new_id()
            self._leases[lease_id] = key
            self._policy.on_access(key)
            self._counters["num_hits"] += 1
            return lease_id, entry.alloc.offset, entry.alloc.nbytes

    def release(self, lease_id: int) -> None:
        with self._lock:
            key = self._leases.pop(lease_id)
            entry = self._index[key]
            assert entry.num_pins > 0, "release without a pin"
            entry.num_pins -= 1

    def get_view(self, key: str) -> HostLease | None:
        got = self.acquire(key)
        if got is None:
            return None
        lease_id, offset, nbytes = got
        view = self.arena.view[offset : offset + nbytes].toreadonly()
        return HostLease(key, lease_id, view, self.release)

    def get_views(self, keys: Sequence[str]) -> list[HostLease | None]:
        """``get_view`` of each key, in order (a batch is one round trip for a client)."""
        return [self.get_view(key) for key in keys]

    def release_many(self, leases: Sequence[HostLease]) -> None:
        """Release every lease (views first, then the pins)."""
        for lease in leases:
            lease.release()

    def get_bytes(self, key: str) -> bytes | None:
        lease = self.get_view(key)
        if lease is None:
            return None
        with lease:
            return bytes(lease.view)

    def contains(self, keys: Iterable[str]) -> list[bool]:
        with self._lock:
            return [k in self._index for k in keys]

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index)

    def delete(self, key: str) -> bool:
        with self._lock:
            entry = self._index.get(key)
            if entry is None or entry.num_pins:
                return False
            self._remove(key, evicted=False)
            self._counters["num_deletes"] += 1
        self._emit("evicted", key, entry.alloc.nbytes)
        return True

    def demote(self, keys: Sequence[str]) -> int:
        """Evict ``keys`` before every other object, ``keys[0]`` first (NOTE 5); absent keys
        are ignored. Returns how many were present."""
        with self._lock:
            present = [k for k in keys if k in self._index]
            for key in reversed(present):  # each demote goes to the head: the first ends up first
                self._policy.demote(key)
                self._index[key].demoted = True
            self._counters["num_demoted"] += len(present)
        return len(present)

    def touch(self, keys: Sequence[str]) -> int:
        """Refresh ``keys`` as reads would, in order (the last becomes the newest), without pinning
        or reading them: a store of state the tier already holds (NOTE 7). A demoted key touched
        is wanted again and stops being demoted. Absent keys are ignored; returns how many were
        present."""
        with self._lock:
            n = 0
            for key in keys:
                entry = self._index.get(key)
                if entry is None:
                    continue
                entry.demoted = False
                self._policy.on_access(key)
                n += 1
            self._counters["num_refreshed"] += n
        return n

    def hold(self, keys: Sequence[str]) -> int:
        """One more device of the node holds each of ``keys`` (NOTE 8): a key that becomes held
        while stored goes to the head of the eviction order, ``keys[0]`` first. Returns how many
        were stored here."""
        with self._lock:
            held, index = self._held, self._index
            first = []
            for key in keys:
                n = held.get(key, 0)
                held[key] = n + 1
                if not n and key in index:
                    first.append(key)
            for key in reversed(first):  # each demote goes to the head: the first ends up first
                self._policy.demote(key)
            self._counters["num_hold_demoted"] += len(first)
            return sum(key in index for key in keys)

    def unhold(self, keys: Sequence[str]) -> int:
        """One device fewer holds each of ``keys`` (NOTE 8); a key no device holds any more is
        refreshed as the newest where stored. Keys not held are ignored. Returns how many keys
        were released by their last holder."""
        gone = []
        with self._lock:
            held, index = self._held, self._index
            n_free = 0
            for key in keys:
                n = held.get(key, 0)
                if n > 1:
                    held[key] = n - 1
                elif n == 1:
                    del held[key]
                    n_free += 1
                    if key in index:
                        index[key].demoted = False
                        self._policy.on_access(key)
                    elif key in self._withheld:  # the node cannot read it any more (NOTE 9)
                        self._withheld.discard(key)
                        gone.append(key)
            self._counters["num_hold_released"] += n_free
            if n_free and self._wanted:
                self._cond.notify_all()
        for key in gone:
            self._emit("evicted", key, 0)
        return n_free

    # ---- recalls (NOTE 9) ------------------------------------------------
    def recall(self, keys: Sequence[str], timeout_s: float, exclude: Iterable[str] = ()) -> int:
        """Ask the node's devices for ``keys`` this tier lacks and some device other than the
        caller's (``exclude``: the keys it holds itself) holds, and wait for them (NOTE 9). The
        listeners hear every key of ``keys`` another device holds, stored here or not (how far
        the reader's prefix matches theirs). Returns how many of the missing ones were stored
        when the wait ended (0: nothing to ask)."""
        exclude = exclude if isinstance(exclude, (set, frozenset)) else set(exclude)
        with self._cond:
            held, index = self._held, self._index
            theirs = tuple(k for k in dict.fromkeys(keys) if held.get(k, 0) > (k in exclude))
            want = tuple(k for k in theirs if k not in index)
            if not want:
                return 0
            self._recall_seq += 1
            seq = self._recall_seq
            self._recalls.append((seq, theirs))  # what they hold of it: how far the reader's prefix goes
            self._wanted.update(want)
            self._recalls_open += 1
            listeners = list(self._listeners)
            self._counters["num_recalls"] += 1
            self._cond.notify_all()
            deadline = time.monotonic() + timeout_s
            try:
                while True:
                    if all(self._listeners.get(name, seq) >= seq for name in listeners):
                        break  # every listener came back: it answered what it could
                    if not any(k in index or k in held for k in want):
                        break  # let go, and not written back: nothing is coming
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._counters["num_recall_timeouts"] += 1
                        break
                    self._cond.wait(left)
            finally:
                self._recalls_open -= 1
            self._wanted.difference_update(want)
            got = sum(k in index for k in want)
            self._counters["num_recalled_keys"] += got
            return got

    def recalled(self, listener: str, after: int, timeout_s: float) -> tuple[int, list[str]]:
        """A holder's wait for recalls (NOTE 9): having answered every recall up to ``after``, the
        keys of those after it, and the last one's number; ``(after, [])`` at the timeout.
        A listener that misses more than the list keeps gets the newest it has."""
        with self._cond:
            self._listeners[listener] = after
            self._cond.notify_all()  # a recall may wait for this listener's answer
            deadline = time.monotonic() + timeout_s
            while self._recall_seq <= after:
                left = deadline - time.monotonic()
                if left <= 0:
                    return after, []
                self._cond.wait(left)
            keys = [k for seq, ks in self._recalls if seq > after for k in ks]
            return self._recall_seq, list(dict.fromkeys(keys))

    def reconnect(self) -> _Listener:
        """Where a holder of this process listens for recalls (``recalled``, ``close``), as a
        ``HostTierClient``'s connection of its own does."""
        with self._lock:
            self._next_listener += 1
            return _Listener(self, f"local-{self._next_listener}")

    def forget_listener(self, listener: str) -> None:
        """A listener that is gone: recalls stop waiting for it."""
        with self._cond:
            if self._listeners.pop(listener, None) is not None:
                self._cond.notify_all()

    def num_held(self) -> int:
        """Keys some device of the node holds (NOTE 8), stored here or not."""
        with self._lock:
            return len(self._held)

    # ---- eviction (lock held) -----------------------------------------
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _remove(self, key: str, evicted: bool) -> Allocation:
        entry = self._index.pop(key)
        assert entry.num_pins == 0, "freeing a pinned object"
        self._policy.on_remove(key, evicted)
        self._used_bytes -= entry.alloc.nbytes
        return self._alloc.free(entry.alloc.offset)

    def _evict(self, key: str, out: list[tuple[str, bytes | None, int]]) -> None:
        entry = self._index[key]
        a = entry.alloc
        hand_on = self.on_evict is not None and (self.hand_on_demoted or not entry.demoted)  # NOTE 6
        data = bytes(self.arena.view[a.offset : a.offset + a.nbytes]) if hand_on else None
        self._remove(key, evicted=True)
        self._counters["num_evictions"] += 1
        self._counters["evicted_bytes"] += a.nbytes
        out.append((key, data, a.nbytes))

    def _evict_for(self, nbytes: int, out: list[tuple[str, bytes | None, int]]) -> Allocation | None:
        size_class = self._alloc.size_class(nbytes)
        budget = self._alloc.class_sizes[size_class]  # strict policy order for ~one slot of bytes
        for strict in (True, False):
            for key in self._policy.victims():
                entry = self._index[key]
                if entry.num_pins:
                    continue
                if strict and budget <= 0:
                    break
                if not strict and not self._alloc.frees_room_for(entry.alloc.offset, size_class):
                    continue
                budget -= entry.alloc.slot_bytes
                self._evict(key, out)
                alloc = self._alloc.allocate(nbytes)
                if alloc is not None:
                    return alloc
        by_offset = {e.alloc.offset: k for k, e in self._index.items()}
        for slab_id in self._alloc.slabs_by_occupancy():
            keys = [by_offset.get(o) for o in self._alloc.slab_offsets(slab_id)]
            if any(k is None or self._index[k].num_pins for k in keys):
                continue  # a reservation or a pin holds this slab
            for k in keys:
                self._evict(k, out)
            self._counters["num_slab_reclaims"] += 1
            return self._alloc.allocate(nbytes)
        return None

    def _after_evictions(self, evicted: list[tuple[str, bytes | None, int]]) -> None:
        if evicted and self._held:
            with self._lock:  # NOTE 9: what a device of the node holds, the node still reads
                withheld = {key for key, _, _ in evicted if key in self._held}
                self._withheld.update(withheld)
                self._counters["num_withheld_evictions"] += len(withheld)
        else:
            withheld = ()
        for key, data, nbytes in evicted:
            if key not in withheld:
                self._emit("evicted", key, nbytes)
            if self.on_evict is not None and data is not None:
                try:  # a failing write-behind loses that object only, never the caller's put
                    self.on_evict(key, data)
                except Exception:  # noqa: BLE001
                    self._counters["num_evict_errors"] += 1
                    log.warning("write-behind of evicted %s failed", key, exc_info=True)

    def _emit(self, kind: str, key: str, nbytes: int) -> None:
        if self.event_log is not None:
            self.event_log.emit(StoreEvent(kind, key, object_kind_of(key), self.name, self.worker_id, nbytes=nbytes))

    # ---- accounting ----------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def num_objects(self) -> int:
        return len(self._index)

    def stats(self) -> dict[str, int | float | str]:
        with self._lock:
            return {
                "tier": self.name,
                "policy": self._policy.name,
                "capacity_bytes": self.capacity_bytes,
                "used_bytes": self._used_bytes,
                "allocated_bytes": self._alloc.allocated_bytes,
                "pending_bytes": sum(a.slot_bytes for _, a in self._pending.values()),
                "num_objects": len(self._index),
                "num_pinned": sum(1 for e in self._index.values() if e.num_pins),
                "num_leases": len(self._leases),
                "num_held": len(self._held),
                "num_recall_listeners": len(self._listeners),
                "slab_bytes": self._alloc.slab_bytes,
                "fragmentation": self._alloc.fragmentation(),
                "pinned_memory": int(self.arena.pinned),
                **self._counters,
            }

    def close(self) -> None:
        self.arena.close()

    def __enter__(self) -> HostTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def put_via_reservation(tier, key: str, data: bytes | bytearray | memoryview) -> bool:
    """``put_bytes`` for anything with ``reserve``: reserve, copy into the arena, commit.

    Shared by ``HostTier`` (in-process) and ``HostTierClient`` (another process of the node).
    """
    data = memoryview(data).cast("B")
    res = tier.reserve(key, len(data))
    if res is None:
        return False
    if res.duplicate:
        return True
    try:
        res.view[:] = data
    except BaseException:
        res.abort()
        raise
    return res.commit()
