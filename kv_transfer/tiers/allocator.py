"""Size-classed slab allocator for the host arena.

Why slabs (and not a buddy or a free-extent allocator): objects are 10 KB -
64 MB, but a deployment produces few distinct sizes (MLA blocks, KDA shards,
tails). A buddy allocator rounds a 33 MB KDA shard up to 64 MB (up to 50%
waste); a free-extent (first/best-fit) allocator splinters under churn and then
needs many evictions to find one contiguous run. Here the arena is cut into
equal slabs; a slab, when first needed, is given to one size class and cut into
equal slots; when its last slot is freed it goes back to the free pool, so
memory moves between classes and no free *slab* is ever unusable.

    arena  |slab 0: class 3 |slab 1: free |slab 2: class 0 |slab 3: class 3 |...
    slab 0 |slot|slot|slot|slot|slot|  (slab_bytes // class_size slots)

Class sizes are ``page_floor(slab_bytes // n)`` for the n that keep neighbours
within ``growth`` of each other, so a slab holds a whole number of slots with at
most a page of slack per slot, and an object wastes at most 1 - 1/growth of its
slot (20% at growth 1.25). Free slots stranded in partial slabs of other
classes are the only external fragmentation; ``HostTier`` reclaims them by
evicting whole slabs when the eviction order finds no helpful victim.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

PAGE_BYTES = 4096


def _page_floor(n: int, page: int) -> int:
    return n // page * page


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def default_slab_bytes(capacity_bytes: int, page_bytes: int = PAGE_BYTES) -> int:
    """Slab size for an arena: a power of two, ~1/32 of it but at least 64 MiB
    (the largest object) when the arena holds 4 such slabs; in [64 KiB, 256 MiB]."""
    target = max(_pow2_floor(capacity_bytes // 32), min(64 << 20, _pow2_floor(capacity_bytes // 4)))
    slab = max(page_bytes, 64 << 10, min(target, 256 << 20))
    return min(slab, max(page_bytes, capacity_bytes // page_bytes * page_bytes))


@dataclass(slots=True)
class _Slab:
    size_class: int = -1  # owning class index, -1 when free
    num_live: int = 0  # allocated slots
    free_slots: list[int] | None = None  # stack of free slot indices


@dataclass(frozen=True, slots=True)
class Allocation:
    offset: int  # byte offset in the arena
    nbytes: int  # bytes requested
    slot_bytes: int  # bytes reserved (the class size)
    size_class: int  # class index


class SlabAllocator:
    """Allocates byte ranges of a fixed arena in size-classed slabs.

    NOTES
    1. Every live allocation lies inside [0, num_slabs * slab_bytes) and no two
       live allocations overlap.
    2. A slab is free or owned by exactly one class; a slab whose last slot is
       freed returns to the free pool at once.
    3. allocated_bytes == sum of slot sizes of live allocations <= capacity.
    """

    def __init__(self, capacity_bytes: int, slab_bytes: int | None = None,
                 page_bytes: int = PAGE_BYTES, growth: float = 1.25):
        slab_bytes = slab_bytes or default_slab_bytes(capacity_bytes, page_bytes)
        if slab_bytes % page_bytes or slab_bytes <= 0:
            raise ValueError(f"slab_bytes {slab_bytes} must be a positive multiple of {page_bytes}")
        if capacity_bytes < slab_bytes:
            raise ValueError(f"capacity {capacity_bytes} is smaller than one slab ({slab_bytes})")
        if growth <= 1.0:
            raise ValueError("growth must be > 1")
        self.capacity_bytes = capacity_bytes
        self.slab_bytes = slab_bytes
        self.page_bytes = page_bytes
        self.num_slabs = capacity_bytes // slab_bytes
        self.class_sizes = self._make_classes(slab_bytes, page_bytes, growth)  # ascending
        self._slabs = [_Slab() for _ in range(self.num_slabs)]
        self._free_slabs = list(range(self.num_slabs))  # min-heap: pack low addresses
        self._partial: list[set[int]] = [set() for _ in self.class_sizes]
        self._live: dict[int, Allocation] = {}
        self.allocated_bytes = 0
        self.requested_bytes = 0

    @staticmethod
    def _make_classes(slab: int, page: int, growth: float) -> list[int]:
        sizes = [slab]
        while sizes[-1] > page:
            n = max(math.ceil(slab * growth / sizes[-1]), slab // sizes[-1] + 1)
            size = max(_page_floor(slab // n, page), page)
            if size >= sizes[-1]:
                break
            sizes.append(size)
        return sorted(sizes)

    # ---- queries -------------------------------------------------------
    @property
    def max_object_bytes(self) -> int:
        return self.slab_bytes

    @property
    def num_allocations(self) -> int:
        return len(self._live)

    def size_class(self, nbytes: int) -> int | None:
        """Index of the smallest class that fits ``nbytes`` (None: too large)."""
        if nbytes > self.slab_bytes:
            return None
        lo, hi = 0, len(self.class_sizes) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.class_sizes[mid] >= nbytes:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def can_allocate(self, nbytes: int) -> bool:
        c = self.size_class(max(nbytes, 1))
        return c is not None and (bool(self._partial[c]) or bool(self._free_slabs))

    def slab_of(self, offset: int) -> int:
        return offset // self.slab_bytes

    def slab_offsets(self, slab_id: int) -> list[int]:
        """Offsets of the live allocations in one slab."""
        base = slab_id * self.slab_bytes
        return [o for o in self._live if base <= o < base + self.slab_bytes]

    def frees_room_for(self, offset: int, size_class: int) -> bool:
        """Would freeing ``offset`` make an allocation of ``size_class`` succeed?"""
        slab = self._slabs[self.slab_of(offset)]
        return slab.size_class == size_class or slab.num_live == 1

    def slabs_by_occupancy(self) -> list[int]:
        """Owned slabs, fewest live slots first (slab reclaim candidates)."""
        owned = [i for i, s in enumerate(self._slabs) if s.size_class >= 0]
        return sorted(owned, key=lambda i: (self._slabs[i].num_live, i))

    def fragmentation(self) -> float:
        """Share of free bytes stranded in partial slabs (usable by one class only)."""
        free = self.num_slabs * self.slab_bytes - self.allocated_bytes
        if free <= 0:
            return 0.0
        return 1.0 - len(self._free_slabs) * self.slab_bytes / free

    # ---- changes -------------------------------------------------------
    def allocate(self, nbytes: int) -> Allocation | None:
        """A slot for ``nbytes``, or None when the class has no free slot and no slab is free."""
        assert nbytes > 0, "empty allocation"
        c = self.size_class(nbytes)
        if c is None:
            return None
        size = self.class_sizes[c]
        if self._partial[c]:
            sid = max(self._partial[c], key=lambda i: (self._slabs[i].num_live, -i))  # fullest first: drains sparse slabs
        elif self._free_slabs:
            sid = heapq.heappop(self._free_slabs)
            slab = self._slabs[sid]
            assert slab.size_class == -1 and slab.num_live == 0, "free slab in use"
            slab.size_class = c
            slab.free_slots = list(range(self.slab_bytes // size - 1, -1, -1))
            self._partial[c].add(sid)
        else:
            return None
        slab = self._slabs[sid]
        slot = slab.free_slots.pop()
        slab.num_live += 1
        if not slab.free_slots:
            self._partial[c].discard(sid)
        a = Allocation(sid * self.slab_bytes + slot * size, nbytes, size, c)
        assert a.offset not in self._live and a.offset + size <= (sid + 1) * self.slab_bytes
        self._live[a.offset] = a
        self.allocated_bytes += size
        self.requested_bytes += nbytes
        assert self.allocated_bytes <= self.num_slabs * self.slab_bytes <= self.capacity_bytes
        return a

    def free(self, offset: int) -> Allocation:
        a = self._live.pop(offset)
        sid = self.slab_of(offset)
        slab = self._slabs[sid]
        assert slab.size_class == a.size_class and slab.num_live > 0, "double free"
        slab.free_slots.append((offset - sid * self.slab_bytes) // a.slot_bytes)
        slab.num_live -= 1
        self.allocated_bytes -= a.slot_bytes
        self.requested_bytes -= a.nbytes
        if slab.num_live == 0:
            self._partial[a.size_class].discard(sid)
            slab.size_class, slab.free_slots = -1, None
            heapq.heappush(self._free_slabs, sid)
        else:
            self._partial[a.size_class].add(sid)
        return a
