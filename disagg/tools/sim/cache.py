"""LRU tiers of the simulator (device per worker, host and disk per node), and host tiers
ordered by serving's own eviction policies (``PolicyTier``).

Keys are opaque hashables (the simulator uses bytes: a 16-byte block digest
for an MLA block, a one-byte kind tag + digest for a checkpoint, see
``disagg.tools.sim.state``); each object has a size in capacity units (blocks).
Every insert and eviction is reported through ``on_event(op, key)`` so the
simulator can publish the store events a real tier publishes.

Bulk operations (``present``, ``touch_many``) run as C loops over the keys
(``map`` of dict methods), so a 1,000-block prompt costs microseconds.

NOTES
1. ``used`` == sum of sizes of resident objects <= capacity after every put.
2. Eviction order is least-recently used first; ``touch`` refreshes;
   ``demote`` puts keys at the eviction end (``disagg.tools.sim.retention``).
3. An object larger than the tier is refused (put returns None, no event).
4. A key demoted and not refreshed since (``put``, ``touch``) is *cold*; its eviction is
   reported as ``evicted_demoted`` (what nothing is expected to read again: the spill to
   the pool passes it by, Simulator NOTE 4), any other eviction as ``evicted``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable

from kv_transfer.tiers.eviction import make_policy

EventFn = Callable[[str, Hashable], None]


class LRUTier:
    def __init__(self, name: str, capacity: int, on_event: EventFn | None = None):
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.name = name
        self.capacity = capacity
        self.used = 0
        self.on_event = on_event
        self._items: OrderedDict[Hashable, int] = OrderedDict()
        self._cold: set[Hashable] = set()  # demoted, not refreshed since (NOTE 4)
        self.num_evictions = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[Hashable]:
        """Resident keys, least recently used first."""
        return list(self._items)

    def present(self, keys: Iterable[Hashable]) -> list[bool]:
        """Membership of each key (one C loop)."""
        return list(map(self._items.__contains__, keys))

    def touch(self, key: Hashable) -> None:
        if key in self._items:
            self._items.move_to_end(key)
            self._cold.discard(key)

    def touch_many(self, keys: list[Hashable]) -> None:
        """Refresh keys known to be resident, in order (the last one becomes the newest)."""
        deque(map(self._items.move_to_end, keys), maxlen=0)
        if self._cold:
            self._cold.difference_update(keys)

    def touch_present(self, keys: Iterable[Hashable]) -> None:
        """Refresh those of ``keys`` that are resident, in order."""
        items, cold = self._items, self._cold
        for key in keys:
            if key in items:
                items.move_to_end(key)
                cold.discard(key)

    def read(self, keys: Iterable[Hashable]) -> None:
        """``keys`` were read: nothing for an LRU tier (the simulator's store refreshes what a
        turn resumed, a put of a resident key; ``PolicyTier`` refreshes on reads and puts, as
        serving does)."""

    def demote(self, keys: Iterable[Hashable]) -> None:
        """Resident ``keys`` become the next to be evicted; the last key given goes first (NOTE 2)."""
        items, cold = self._items, self._cold
        for key in keys:
            if key in items:
                items.move_to_end(key, last=False)
                cold.add(key)

    def _evicted(self, key: Hashable) -> str:
        """The event of ``key``'s eviction (NOTE 4)."""
        if key in self._cold:
            self._cold.discard(key)
            return "evicted_demoted"
        return "evicted"

    def put(self, key: Hashable, size: int = 1) -> list[Hashable] | None:
        """Insert (or refresh) ``key``; returns the keys evicted to make room, None if refused."""
        items = self._items
        if key in items:
            items.move_to_end(key)
            self._cold.discard(key)
            return []
        if size > self.capacity:
            return None
        evicted: list[Hashable] = []
        while self.used + size > self.capacity:
            old, old_size = items.popitem(last=False)
            self.used -= old_size
            self.num_evictions += 1
            evicted.append(old)
            op = self._evicted(old)
            if self.on_event:
                self.on_event(op, old)
        items[key] = size
        self.used += size
        assert self.used <= self.capacity, "tier over capacity"
        if self.on_event:
            self.on_event("stored", key)
        return evicted

    def put_many(self, keys: list[Hashable], size: int = 1) -> None:
        """``put`` every key in order: the leading residents are refreshed in one C loop, the rest one by one.

        The C loop (``move_to_end`` over the keys) stops at the first key that is not resident
        (a KeyError): the keys before it were refreshed, exactly what ``put`` does to a resident.
        """
        items = self._items
        rest = iter(keys)
        try:
            deque(map(items.move_to_end, rest), maxlen=0)
            if self._cold:
                self._cold.difference_update(keys)
            return  # all resident
        except KeyError:
            pass
        first = len(keys) - len(list(rest)) - 1  # the key that raised (``rest`` holds the keys after it)
        if self._cold:
            self._cold.difference_update(keys[:first])
        on_event = self.on_event
        capacity = self.capacity
        for key in keys[first:]:  # an insert may evict a key further down the list: check again
            if key in items:
                items.move_to_end(key)
                self._cold.discard(key)
                continue
            if size > capacity:  # refused (NOTE 3)
                continue
            while self.used + size > capacity:  # ``put``, inline
                old, old_size = items.popitem(last=False)
                self.used -= old_size
                self.num_evictions += 1
                op = self._evicted(old)
                if on_event:
                    on_event(op, old)
            items[key] = size
            self.used += size
            if on_event:
                on_event("stored", key)
        assert self.used <= capacity, "tier over capacity"

    def discard(self, key: Hashable) -> None:
        """Drop ``key`` if resident (reported as an eviction)."""
        size = self._items.pop(key, None)
        if size is not None:
            self.used -= size
            op = self._evicted(key)
            if self.on_event:
                self.on_event(op, key)

    def utilization(self) -> float:
        return self.used / self.capacity if self.capacity else 1.0


class PolicyTier(LRUTier):
    """A tier ordered by one of serving's eviction policies (``kv_transfer.tiers.eviction``: the
    same classes the host tier runs), with serving's semantics where they differ from ``LRUTier``:

    - a put of a resident key is a read: serving's ``put_state`` writes nothing of what a tier
      holds and refreshes it (``StateStore`` NOTE 4: a turn's store of its prefix; ``HostTier``
      NOTE 3: a spill of the copy another node evicted), demoted or not;
    - a read refreshes (``read``: the tier's ``acquire`` calls the policy's ``on_access``); the
      simulator reads a host tier on every resume from it (``StateModel.resume``);
    - ``touch`` (the retention's refresh of a shared prefix) is a read too.

    NOTE 4 (cold keys) holds as in ``LRUTier``: a demoted key not read since is cold.
    """

    def __init__(self, name: str, capacity: int, policy: str, on_event: EventFn | None = None):
        super().__init__(name, capacity, on_event)
        self.policy_name = policy
        self._policy = make_policy(policy, max(capacity, 1))

    def read(self, keys: Iterable[Hashable]) -> None:
        items, cold, access = self._items, self._cold, self._policy.on_access
        for key in keys:
            if key in items:
                access(key)
                cold.discard(key)

    def touch(self, key: Hashable) -> None:
        self.read((key,))

    def touch_many(self, keys: list[Hashable]) -> None:
        self.read(keys)

    def touch_present(self, keys: Iterable[Hashable]) -> None:
        self.read(keys)

    def demote(self, keys: Iterable[Hashable]) -> None:
        items, cold, demote = self._items, self._cold, self._policy.demote
        for key in keys:
            if key in items:
                demote(key)
                cold.add(key)

    def _evict_one(self) -> Hashable:
        key = next(self._policy.victims())
        self.used -= self._items.pop(key)
        self.num_evictions += 1
        self._policy.on_remove(key, True)
        op = self._evicted(key)
        if self.on_event:
            self.on_event(op, key)
        return key

    def put(self, key: Hashable, size: int = 1) -> list[Hashable] | None:
        if key in self._items:
            self.read((key,))
            return []
        if size > self.capacity:
            return None
        evicted = []
        while self.used + size > self.capacity:
            evicted.append(self._evict_one())
        self._items[key] = size
        self.used += size
        self._policy.on_insert(key, size)  # type: ignore[arg-type]
        if self.on_event:
            self.on_event("stored", key)
        return evicted

    def put_many(self, keys: list[Hashable], size: int = 1) -> None:
        for key in keys:
            self.put(key, size)

    def discard(self, key: Hashable) -> None:
        size = self._items.pop(key, None)
        if size is not None:
            self.used -= size
            self._policy.on_remove(key, False)  # type: ignore[arg-type]
            op = self._evicted(key)
            if self.on_event:
                self.on_event(op, key)
