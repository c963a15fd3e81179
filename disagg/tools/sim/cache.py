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
5. A node's host tier as its devices' victim cache (``VictimHost``, Simulator NOTE 12): the
   node counts, per key, the devices of the node that hold it. A key some device holds is
   demoted in the host tier (stored there, or already there, when a device stores it), so a
   full host tier lets it go before what no device holds; when the last device holding a key
   evicts it, the host tier gets it back as its newest (refreshed, or written back when it let
   it go), unless the device had demoted it (nothing expects to read it). ``NodeView`` reads
   the host tier and the node's other devices as one tier, and the router's index is told of
   the host tier as that view holds it (``VictimHost``'s ``publish``).
"""

from __future__ import annotations

import operator
from collections import Counter, OrderedDict, deque
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


class VictimHost:
    """A node's host tier kept exclusive of the node's devices where it is full (NOTE 5).

    ``device_listener`` wraps each device's event callback, ``host_listener`` the host tier's;
    ``size_of`` gives a key's size in the host tier (``StateModel.size_of``). With ``publish``
    (the host tier's index callback, without a spill) the node's host tier is published as
    what ``NodeView`` reads: a key stays published while a device of the node holds it, though
    the host tier let it go, and is published when a device stores it first.
    """

    def __init__(self, host: LRUTier, size_of: Callable[[Hashable], int], publish: EventFn | None = None):
        self.host = host
        self.size_of = size_of
        self.publish = publish
        self.held: Counter[Hashable] = Counter()  # key -> devices of the node holding it
        self.written_back = 0  # keys the host tier got back from a device that evicted them

    def host_listener(self, inner: EventFn) -> EventFn:
        held, host, publish = self.held, self.host, self.publish

        def on_event(op: str, key: Hashable) -> None:
            if op == "stored":
                inner(op, key)
                if key in held:  # a device holds it: it goes first (it is resident now)
                    host.demote((key,))
            elif publish is None or key not in held:  # else a device still holds it: the node keeps it
                inner(op, key)

        return on_event

    def device_listener(self, inner: EventFn) -> EventFn:
        held, host, size_of, publish = self.held, self.host, self.size_of, self.publish

        def on_event(op: str, key: Hashable) -> None:
            inner(op, key)
            if op == "stored":
                held[key] += 1
                if held[key] == 1:
                    if key in host:
                        host.demote((key,))
                    elif publish is not None:
                        publish("stored", key)
                return
            left = held[key] - 1
            if left > 0:
                held[key] = left
                return
            del held[key]
            if op == "evicted_demoted":  # the device's retention expects no read: the host's copy stays cold
                if publish is not None and key not in host:
                    publish(op, key)
                return
            if key not in host:
                self.written_back += 1
            host.put(key, size_of(key))  # refreshed, or written back

        return on_event


class NodeView:
    """A node's host tier and the devices of its other workers, read as one tier (NOTE 5): what a
    worker resumes from its node over the node's links. Reads refresh the host tier only."""

    def __init__(self, host: LRUTier | None, devices: list[LRUTier]):
        self.host = host
        self.devices = devices

    def present(self, keys: Iterable[Hashable]) -> list[bool]:
        keys = list(keys)
        out = self.host.present(keys) if self.host is not None else [False] * len(keys)
        for dev in self.devices:
            out = list(map(operator.or_, out, dev.present(keys)))
        return out

    def __contains__(self, key: Hashable) -> bool:
        return (self.host is not None and key in self.host) or any(key in dev for dev in self.devices)

    def read(self, keys: Iterable[Hashable]) -> None:
        if self.host is not None:
            self.host.read(keys)
