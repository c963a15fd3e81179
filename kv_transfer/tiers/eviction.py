"""Eviction policies: tiny strategy classes, registered in ``EVICTION_POLICIES``.

A policy only orders keys; the tier decides which candidates it can actually
evict (pinned or unhelpful ones are skipped) and calls ``on_remove`` for those
it evicts. ``victims()`` is a lazy generator: the tier evicts between two
``next()`` calls and the policy sees the new sizes.

lru     least recently used first (insert and access move a key to the back).
s3fifo  S3-FIFO (Yang et al., SOSP'23): new keys enter a small FIFO S; keys
        evicted from S with no hit are remembered in a ghost list G; a key hit
        while in S moves to the main FIFO M at eviction time; keys in G are
        inserted straight into M; M reinserts hit keys (freq - 1) instead of
        evicting them. Evict from S while bytes(S) > small_ratio * capacity,
        else from M. A one-pass scan only churns S, so it cannot flush M.
arc     ARC (Megiddo and Modha, FAST'03), weighed in bytes: T1 holds keys not read
        since they were put, T2 keys read at least once since, each least recently
        used first; ghost lists B1 and B2 remember what left each. A put of a key
        in B1 (T1 gave it up too soon) grows T1's target p, one in B2 shrinks it;
        evict from T1 while it holds more than p, else from T2. Scan-resistant
        as s3fifo; keeps more than s3fifo under a cyclic load larger than the
        tier. Like s3fifo it keeps a session's newest state (put, not yet read)
        behind what was read, so on agentic traces recency (lru) keeps more
        (docs/perf/reuse-cpu.md, docs/router.md "Round 14").

``demote(key)`` tells a policy a key will most likely not be read again (a
session's superseded KDA checkpoint, ``disagg.reuse.retention``): it goes to
the head of the eviction order (of keys demoted one after another, the last
demoted is evicted first). A demoted key that is read again is refreshed by
``on_access`` like any other key: nothing is dropped on a guess.

Config example::

    host_tier:
      eviction: lru           # or s3fifo, arc
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol


class EvictionPolicy(Protocol):
    name: str

    def on_insert(self, key: str, nbytes: int) -> None:
        """A key was committed to the tier."""

    def on_access(self, key: str) -> None:
        """A key was read."""

    def on_remove(self, key: str, evicted: bool) -> None:
        """A key left the tier (evicted by the tier, or deleted)."""

    def demote(self, key: str) -> None:
        """Evict ``key`` before every key not demoted (no-op for an unknown key)."""

    def victims(self) -> Iterator[str]:
        """Keys in eviction order, each at most once per generator."""

    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently used first.

    NOTES
    1. ``_order`` holds every committed key exactly once, oldest access first.
    """

    name = "lru"

    def __init__(self, capacity_bytes: int):
        self._order: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def on_insert(self, key: str, nbytes: int) -> None:
        assert key not in self._order, f"double insert of {key}"
        self._order[key] = nbytes

    def on_access(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: str, evicted: bool) -> None:
        self._order.pop(key, None)

    def demote(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key, last=False)

    def victims(self) -> Iterator[str]:
        skip: set[str] = set()  # candidates the tier passed by (pinned): they stay in the order
        while (key := next((k for k in self._order if k not in skip), None)) is not None:
            skip.add(key)
            yield key


class S3FIFOPolicy:
    """S3-FIFO: small FIFO + main FIFO + ghost keys (see module docstring).

    NOTES
    1. Every committed key is in exactly one of ``_demoted`` / ``_small`` / ``_main``.
    2. ``_small_bytes`` / ``_main_bytes`` / ``_demoted_bytes`` equal the sizes of their queues.
    3. The ghost list holds keys only and never more than ``max(64, len(self))``.
    4. Demoted keys (``demote``) sit in their own queue ``_demoted``, evicted before S and
       M whatever their sizes, the latest demoted first; a demote resets the key's hits
       (they came before it was superseded). A demoted key read again before its eviction
       is promoted to M when it reaches the head (as a hit in S is). A demoted key evicted
       does *not* enter the ghost list: the ghost list means "left S unread, so a quick
       return proves it recurring (straight into M)"; a demoted key left because we
       said so, not because it was cold, so its return proves nothing and it starts again
       in S; and demotes in bulk would flush the ghost list of the signals it exists for.
    """

    name = "s3fifo"
    MAX_FREQ = 3

    def __init__(self, capacity_bytes: int, small_ratio: float = 0.1):
        if not 0.0 < small_ratio < 1.0:
            raise ValueError("small_ratio must be in (0, 1)")
        self.small_target = small_ratio * capacity_bytes
        self._small: OrderedDict[str, int] = OrderedDict()
        self._main: OrderedDict[str, int] = OrderedDict()
        self._ghost: OrderedDict[str, None] = OrderedDict()
        self._demoted: OrderedDict[str, int] = OrderedDict()  # NOTE 4: head = evicted first
        self._freq: dict[str, int] = {}
        self._small_bytes = 0
        self._main_bytes = 0
        self._demoted_bytes = 0

    def __len__(self) -> int:
        return len(self._small) + len(self._main) + len(self._demoted)

    def queues(self) -> tuple[list[str], list[str], list[str]]:
        """(small, main, ghost) keys, oldest first (for tests and debugging)."""
        return list(self._small), list(self._main), list(self._ghost)

    def demoted(self) -> list[str]:
        """Demoted keys, next to be evicted first (NOTE 4)."""
        return list(self._demoted)

    def on_insert(self, key: str, nbytes: int) -> None:
        assert key not in self._freq, f"double insert of {key}"
        self._freq[key] = 0
        if key in self._ghost:  # seen recently: straight into M
            del self._ghost[key]
            self._main[key] = nbytes
            self._main_bytes += nbytes
        else:
            self._small[key] = nbytes
            self._small_bytes += nbytes

    def on_access(self, key: str) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def on_remove(self, key: str, evicted: bool) -> None:
        if key not in self._freq:
            return
        del self._freq[key]
        if key in self._demoted:  # NOTE 4: no ghost entry
            self._demoted_bytes -= self._demoted.pop(key)
        elif key in self._small:
            self._small_bytes -= self._small.pop(key)
            if evicted:
                self._ghost[key] = None
                while len(self._ghost) > max(64, len(self)):
                    self._ghost.popitem(last=False)
        else:
            self._main_bytes -= self._main.pop(key)
        assert self._small_bytes >= 0 and self._main_bytes >= 0 and self._demoted_bytes >= 0

    def demote(self, key: str) -> None:
        if key not in self._freq:
            return
        if key in self._demoted:
            nbytes = self._demoted.pop(key)
            self._demoted_bytes -= nbytes
        elif key in self._small:
            nbytes = self._small.pop(key)
            self._small_bytes -= nbytes
        else:
            nbytes = self._main.pop(key)
            self._main_bytes -= nbytes
        self._demoted[key] = nbytes
        self._demoted.move_to_end(key, last=False)
        self._demoted_bytes += nbytes
        self._freq[key] = 0

    def _candidate(self, from_small: bool, skip: set[str], queue: OrderedDict[str, int] | None = None) -> str | None:
        promote = queue is not None or from_small  # a hit in S or among the demoted: promote to M
        if queue is None:
            queue = self._small if from_small else self._main
        while True:
            key = next((k for k in queue if k not in skip), None)
            if key is None or self._freq[key] == 0:
                return key
            if promote:  # hit while in S (or demoted): promote to M, lazily
                nbytes = queue.pop(key)
                if queue is self._small:
                    self._small_bytes -= nbytes
                else:
                    self._demoted_bytes -= nbytes
                self._main[key] = nbytes
                self._main_bytes += nbytes
                self._freq[key] = 0
            else:  # hit while in M: reinsert at the back with one less credit
                self._freq[key] -= 1
                self._main.move_to_end(key)

    def victims(self) -> Iterator[str]:
        skip: set[str] = set()
        while True:
            key = self._candidate(False, skip, self._demoted)  # NOTE 4
            if key is not None:
                skip.add(key)
                yield key
                continue
            small_first = self._small_bytes > self.small_target or not self._main
            key = self._candidate(small_first, skip)
            if key is None:
                key = self._candidate(not small_first, skip)
            if key is None:
                return
            skip.add(key)
            yield key


class ARCPolicy:
    """ARC, in bytes (see module docstring).

    NOTES
    1. Every committed key is in exactly one of ``_demoted`` / ``_t1`` / ``_t2``; the ghost
       lists ``_b1`` / ``_b2`` hold keys that are not committed (a put of a ghost key
       moves it out).
    2. ``_bytes[q]`` equals the sizes of queue ``q`` (ghosts keep the size they left with).
    3. ``0 <= p <= capacity``; after every change ``bytes(T1) + bytes(B1) <= capacity`` and
       all four lists hold at most ``2 * capacity`` (ghosts trimmed oldest first), as in
       the paper's directory of 2c pages.
    4. Demoted keys sit in their own queue, evicted first, the latest demoted first, as
       S3-FIFO NOTE 4; a demoted key read again goes to T2; one evicted or deleted
       leaves no ghost (its return says nothing about T1's size).
    5. A ghost hit moves p by the object's size times the other ghost list's bytes over
       its own (at least 1x): the paper's delta, weighed in bytes.
    """

    name = "arc"

    def __init__(self, capacity_bytes: int):
        self.capacity = max(1, capacity_bytes)
        self.p = 0.0  # T1's target, bytes (NOTE 3)
        self._t1: OrderedDict[str, int] = OrderedDict()
        self._t2: OrderedDict[str, int] = OrderedDict()
        self._b1: OrderedDict[str, int] = OrderedDict()
        self._b2: OrderedDict[str, int] = OrderedDict()
        self._demoted: OrderedDict[str, int] = OrderedDict()  # head = evicted first
        self._where: dict[str, OrderedDict[str, int]] = {}  # committed key -> its queue (NOTE 1)
        self._bytes: dict[int, int] = {id(q): 0 for q in (self._t1, self._t2, self._b1, self._b2, self._demoted)}

    def __len__(self) -> int:
        return len(self._where)

    def queues(self) -> tuple[list[str], list[str], list[str], list[str]]:
        """(T1, T2, B1, B2) keys, least recently used first (for tests and debugging)."""
        return list(self._t1), list(self._t2), list(self._b1), list(self._b2)

    def _add(self, q: OrderedDict[str, int], key: str, nbytes: int) -> None:
        q[key] = nbytes
        self._bytes[id(q)] += nbytes

    def _pop(self, q: OrderedDict[str, int], key: str) -> int:
        nbytes = q.pop(key)
        self._bytes[id(q)] -= nbytes
        return nbytes

    def _trim_ghosts(self) -> None:  # NOTE 3
        b = self._bytes
        while self._b1 and b[id(self._t1)] + b[id(self._b1)] > self.capacity:
            self._pop(self._b1, next(iter(self._b1)))
        while self._b2 and sum(b.values()) - b[id(self._demoted)] > 2 * self.capacity:
            self._pop(self._b2, next(iter(self._b2)))
        while self._b1 and sum(b.values()) - b[id(self._demoted)] > 2 * self.capacity:
            self._pop(self._b1, next(iter(self._b1)))

    def on_insert(self, key: str, nbytes: int) -> None:
        assert key not in self._where, f"double insert of {key}"
        b1, b2 = self._bytes[id(self._b1)], self._bytes[id(self._b2)]
        if key in self._b1:  # T1 gave it up too soon (NOTE 5)
            self._pop(self._b1, key)
            self.p = min(float(self.capacity), self.p + nbytes * max(1.0, b2 / max(b1, 1)))
            q = self._t2
        elif key in self._b2:  # T2 did
            self._pop(self._b2, key)
            self.p = max(0.0, self.p - nbytes * max(1.0, b1 / max(b2, 1)))
            q = self._t2
        else:
            q = self._t1
        self._add(q, key, nbytes)
        self._where[key] = q
        self._trim_ghosts()

    def on_access(self, key: str) -> None:
        q = self._where.get(key)
        if q is None:
            return
        if q is self._t2:
            q.move_to_end(key)
            return
        self._add(self._t2, key, self._pop(q, key))
        self._where[key] = self._t2

    def on_remove(self, key: str, evicted: bool) -> None:
        q = self._where.pop(key, None)
        if q is None:
            return
        nbytes = self._pop(q, key)
        if evicted and q is not self._demoted:  # NOTE 4
            self._add(self._b1 if q is self._t1 else self._b2, key, nbytes)
            self._trim_ghosts()

    def demote(self, key: str) -> None:
        q = self._where.get(key)
        if q is None:
            return
        nbytes = self._pop(q, key)
        self._add(self._demoted, key, nbytes)
        self._demoted.move_to_end(key, last=False)
        self._where[key] = self._demoted

    def demoted(self) -> list[str]:
        """Demoted keys, next to be evicted first (NOTE 4)."""
        return list(self._demoted)

    def victims(self) -> Iterator[str]:
        skip: set[str] = set()
        while True:
            key = next((k for k in self._demoted if k not in skip), None)
            if key is None:
                t1_first = self._bytes[id(self._t1)] > self.p or not self._t2
                first, second = (self._t1, self._t2) if t1_first else (self._t2, self._t1)
                key = next((k for k in first if k not in skip), None)
                if key is None:
                    key = next((k for k in second if k not in skip), None)
                if key is None:
                    return
            skip.add(key)
            yield key


EVICTION_POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
}


def make_policy(name: str, capacity_bytes: int) -> EvictionPolicy:
    try:
        factory = EVICTION_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(EVICTION_POLICIES)}") from None
    return factory(capacity_bytes)
