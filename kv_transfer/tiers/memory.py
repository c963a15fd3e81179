"""A plain in-memory ``ByteStore``: a dict behind a lock.

Used by tests, benchmarks and single-process tools that need a tier without
pinned memory, eviction or persistence. An optional ``capacity_bytes`` makes
``put_bytes`` refuse (return False) once the stored bytes would exceed it;
nothing is ever evicted.

    store = DictByteStore(capacity_bytes=1 << 30)
    store.put_bytes("mla:00..ff", payload)
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class DictByteStore:
    """Thread-safe dict of immutable byte strings.

    NOTES
    1. Stored values are private ``bytes`` copies: a caller mutating its buffer
       after ``put_bytes`` never changes what a later ``get_bytes`` returns.
    2. ``num_bytes`` equals the sum of ``len`` over stored values and never
       exceeds ``capacity_bytes`` (when set).
    """

    def __init__(self, name: str = "memory", capacity_bytes: int | None = None):
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._objects)

    def put_bytes(self, key: str, data: bytes | memoryview) -> bool:
        value = bytes(data)
        with self._lock:
            old = self._objects.get(key)
            new_total = self.num_bytes - (len(old) if old is not None else 0) + len(value)
            if self.capacity_bytes is not None and new_total > self.capacity_bytes:
                return False
            self._objects[key] = value
            self.num_bytes = new_total
            assert self.num_bytes >= 0, "byte accounting went negative"
            return True

    def get_bytes(self, key: str) -> bytes | None:
        with self._lock:
            return self._objects.get(key)

    def contains(self, keys: Iterable[str]) -> list[bool]:
        with self._lock:
            return [k in self._objects for k in keys]

    def delete(self, key: str) -> bool:
        with self._lock:
            old = self._objects.pop(key, None)
            if old is None:
                return False
            self.num_bytes -= len(old)
            return True
