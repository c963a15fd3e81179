"""LRU block tiers of the simulator (device per worker, host and disk per node).

Objects are (kind, digest) with kind "mla" (one block) or "kda" (one
checkpoint, ``size`` blocks' worth of capacity). Every insert and eviction
is reported through ``on_event(op, kind, digest)`` so the simulator can
publish the same store events a real tier publishes.

NOTES
1. ``used`` == sum of sizes of resident objects <= capacity after every put.
2. Eviction order is least-recently used first; ``touch`` refreshes.
3. An object larger than the tier is refused (put returns False, no event).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

Key = tuple[str, bytes]


class LRUTier:
    def __init__(self, name: str, capacity: int, on_event: Callable[[str, str, bytes], None] | None = None):
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.name = name
        self.capacity = capacity
        self.used = 0
        self.on_event = on_event
        self._items: OrderedDict[Key, int] = OrderedDict()
        self.num_evictions = 0

    def __contains__(self, key: Key) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def touch(self, key: Key) -> None:
        if key in self._items:
            self._items.move_to_end(key)

    def put(self, key: Key, size: int = 1) -> list[Key]:
        """Insert (or refresh) ``key``; returns the keys evicted to make room."""
        if key in self._items:
            self._items.move_to_end(key)
            return []
        if size > self.capacity:
            return []
        evicted: list[Key] = []
        while self.used + size > self.capacity:
            old, old_size = self._items.popitem(last=False)
            self.used -= old_size
            self.num_evictions += 1
            evicted.append(old)
            if self.on_event:
                self.on_event("evicted", old[0], old[1])
        self._items[key] = size
        self.used += size
        assert self.used <= self.capacity, "tier over capacity"
        if self.on_event:
            self.on_event("stored", key[0], key[1])
        return evicted

    def utilization(self) -> float:
        return self.used / self.capacity if self.capacity else 1.0
