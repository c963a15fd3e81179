"""The interface every storage tier and remote peer implements.

Tiers store *encoded* objects (bytes produced by ``kv_transfer.codec``) under
string keys (``str(ObjectKey)``). They never interpret the payload; checksums
are verified by the codec when an object is decoded, and a tier that detects
damage on its own (disk CRC) drops the object and reports a miss.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable


@runtime_checkable
class ByteStore(Protocol):
    name: str  # tier name: "host", "disk", "remote:<peer>", ...

    def put_bytes(self, key: str, data: bytes | memoryview) -> bool:
        """Store ``data`` under ``key``. False when it cannot be stored (no room, refused)."""

    def get_bytes(self, key: str) -> bytes | memoryview | None:
        """The stored bytes, or None on a miss."""

    def contains(self, keys: Iterable[str]) -> list[bool]:
        """Presence of each key, in order."""

    def delete(self, key: str) -> bool:
        """Remove ``key``; False if it was absent or is in use."""
