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

``demote(key)`` tells a policy a key will most likely not be read again (a
session's superseded KDA checkpoint, ``disagg.reuse.retention``): it goes to
the head of the eviction order (of keys demoted one after another, the last
demoted is evicted first). A demoted key that is read again is refreshed by
``on_access`` like any other key: nothing is dropped on a guess.

Config example::

    host_tier:
      eviction: s3fifo        # or lru
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


EVICTION_POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "s3fifo": S3FIFOPolicy,
}


def make_policy(name: str, capacity_bytes: int) -> EvictionPolicy:
    try:
        factory = EVICTION_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(EVICTION_POLICIES)}") from None
    return factory(capacity_bytes)
