"""Wire format of the state service: key batches, flag batches and chunk frames.

Every gRPC message of the service is one opaque byte string (no protobuf);
this module owns their layouts. All integers are little-endian.

    KeyBatch    u32 count | count x (u16 key_len | key utf-8)
    FlagBatch   count x u8 (0 or 1)                 one per key, in order
    Chunk       header (20 bytes) | key utf-8 | payload

    Chunk header  u8 version | u8 flags | u16 key_len | u64 total_bytes | u64 offset

A stored object of ``total_bytes`` is sent as consecutive chunks whose
payloads tile ``[0, total_bytes)`` in order; the last chunk is the one whose
``offset + len(payload) == total_bytes``. An empty object is one chunk with no
payload. A miss (Fetch only) is one chunk with the FOUND flag clear and
``total_bytes == 0``.

    object   |<------------------ total_bytes ------------------>|
    chunks   |<- chunk_bytes ->|<- chunk_bytes ->|<- remainder ->|
    offset   0                 c                 2c              total

``Reassembler`` enforces the tiling (offsets contiguous, total constant, final
length equal to ``total_bytes``); any deviation is a ``FramingError`` and the
partial object is dropped, never returned.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

FRAME_VERSION = 1
FLAG_FOUND = 0x01
MAX_KEY_BYTES = 1024  # keys are short ("mla:<32 hex>:tp0of8"); this bounds abuse

_CHUNK_HEADER = struct.Struct("<BBHQQ")
CHUNK_HEADER_BYTES = _CHUNK_HEADER.size
_COUNT = struct.Struct("<I")
_KEY_LEN = struct.Struct("<H")


class FramingError(ValueError):
    """A message that does not follow the wire format."""


def frame_overhead_bytes() -> int:
    """Upper bound of a chunk frame's size beyond its payload."""
    return CHUNK_HEADER_BYTES + MAX_KEY_BYTES


def check_key(key: str) -> bytes:
    """The utf-8 form of ``key``; FramingError (a ValueError) if empty or too long."""
    raw = key.encode()
    if not raw or len(raw) > MAX_KEY_BYTES:
        raise FramingError(f"key length {len(raw)} outside [1, {MAX_KEY_BYTES}]")
    return raw


@dataclass(slots=True)
class KeyBatch:
    """Request of Contains, Fetch and Delete: the keys asked about, in order."""

    keys: list[str]  # object keys (``str(ObjectKey)``), at most MAX_KEY_BYTES each

    def encode(self) -> bytes:
        parts = [_COUNT.pack(len(self.keys))]
        for key in self.keys:
            raw = check_key(key)
            parts.append(_KEY_LEN.pack(len(raw)))
            parts.append(raw)
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes) -> KeyBatch:
        view = memoryview(data)
        if len(view) < _COUNT.size:
            raise FramingError("key batch shorter than its count")
        (count,) = _COUNT.unpack_from(view, 0)
        pos = _COUNT.size
        keys: list[str] = []
        for _ in range(count):
            if pos + _KEY_LEN.size > len(view):
                raise FramingError("key batch truncated")
            (n,) = _KEY_LEN.unpack_from(view, pos)
            pos += _KEY_LEN.size
            if n == 0 or n > MAX_KEY_BYTES or pos + n > len(view):
                raise FramingError(f"bad key length {n}")
            try:
                keys.append(bytes(view[pos : pos + n]).decode())
            except UnicodeDecodeError as e:
                raise FramingError("key is not utf-8") from e
            pos += n
        if pos != len(view):
            raise FramingError(f"{len(view) - pos} trailing bytes after key batch")
        return cls(keys)


@dataclass(slots=True)
class FlagBatch:
    """Reply of Contains, Delete, Demote and Push: one boolean per key, in order."""

    flags: list[bool]  # Contains: present; Delete: removed; Demote: held and demoted; Push: stored

    def encode(self) -> bytes:
        return bytes(1 if f else 0 for f in self.flags)

    @classmethod
    def decode(cls, data: bytes) -> FlagBatch:
        if any(b > 1 for b in data):
            raise FramingError("flag byte other than 0 or 1")
        return cls([b == 1 for b in data])


@dataclass(slots=True)
class Chunk:
    """One frame of a Fetch reply stream or a Push request stream."""

    key: str  # object this chunk belongs to
    total_bytes: int  # length of the whole object (0 for a miss)
    offset: int  # position of ``payload`` within the object
    payload: bytes | memoryview = b""  # object bytes [offset, offset + len(payload))
    found: bool = True  # False only for a Fetch miss marker (no payload)

    def __repr__(self) -> str:  # never log payload bytes
        return (
            f"Chunk(key={self.key!r}, total_bytes={self.total_bytes}, offset={self.offset}, "
            f"num_payload_bytes={len(self.payload)}, found={self.found})"
        )

    @property
    def is_last(self) -> bool:
        return self.offset + len(self.payload) == self.total_bytes

    def encode(self) -> bytes:
        raw_key = check_key(self.key)
        header = _CHUNK_HEADER.pack(
            FRAME_VERSION,
            FLAG_FOUND if self.found else 0,
            len(raw_key),
            self.total_bytes,
            self.offset,
        )
        return b"".join((header, raw_key, self.payload))

    @classmethod
    def decode(cls, frame: bytes) -> Chunk:
        """Parse a frame; the payload is a zero-copy view into ``frame``."""
        view = memoryview(frame)
        if len(view) < CHUNK_HEADER_BYTES:
            raise FramingError(f"frame of {len(view)} bytes is shorter than its header")
        version, flags, key_len, total, offset = _CHUNK_HEADER.unpack_from(view, 0)
        if version != FRAME_VERSION:
            raise FramingError(f"unsupported frame version {version}")
        start = CHUNK_HEADER_BYTES + key_len
        if key_len == 0 or key_len > MAX_KEY_BYTES or start > len(view):
            raise FramingError(f"bad key length {key_len}")
        try:
            key = bytes(view[CHUNK_HEADER_BYTES:start]).decode()
        except UnicodeDecodeError as e:
            raise FramingError("key is not utf-8") from e
        chunk = cls(key, total, offset, view[start:], bool(flags & FLAG_FOUND))
        if not chunk.found and (total or offset or len(chunk.payload)):
            raise FramingError("a miss marker carries no bytes")
        if offset + len(chunk.payload) > total:
            raise FramingError(f"chunk [{offset}, +{len(chunk.payload)}) beyond total {total}")
        return chunk


def chunk_object(key: str, data: bytes | memoryview, chunk_bytes: int) -> Iterator[Chunk]:
    """Cut one object into chunks of at most ``chunk_bytes`` payload (lazy, zero-copy)."""
    assert chunk_bytes > 0, "chunk_bytes must be positive"
    view = memoryview(data).cast("B")
    total = len(view)
    if total == 0:
        yield Chunk(key, 0, 0, b"")
        return
    for offset in range(0, total, chunk_bytes):
        yield Chunk(key, total, offset, view[offset : offset + chunk_bytes])


def miss_chunk(key: str) -> Chunk:
    return Chunk(key, 0, 0, b"", found=False)


class Reassembler:
    """Joins chunk streams back into objects, one object at a time.

    NOTES
    1. Objects arrive one after another: a chunk for a new key while another
       object is incomplete is a FramingError.
    2. An object is returned only when its received length equals its
       ``total_bytes``; a partial object is never returned.
    """

    def __init__(self, max_object_bytes: int):
        self.max_object_bytes = max_object_bytes
        self._key: str | None = None
        self._total = 0
        self._received = 0
        self._parts: list[memoryview | bytes] = []

    @property
    def pending_key(self) -> str | None:
        """The key of an object started but not finished, if any."""
        return self._key

    def feed(self, chunk: Chunk) -> tuple[str, bytes | None] | None:
        """Add one chunk; returns ``(key, bytes)`` (``None`` bytes for a miss) when complete."""
        if self._key is None:
            if chunk.offset != 0:
                raise FramingError(f"object {chunk.key!r} starts at offset {chunk.offset}")
            if not chunk.found:
                return chunk.key, None
            if chunk.total_bytes > self.max_object_bytes:
                raise FramingError(
                    f"object of {chunk.total_bytes} bytes exceeds {self.max_object_bytes}"
                )
            self._key, self._total, self._received, self._parts = (
                chunk.key,
                chunk.total_bytes,
                0,
                [],
            )
        elif chunk.key != self._key or chunk.total_bytes != self._total or not chunk.found:
            raise FramingError(f"object {self._key!r} interrupted by {chunk!r}")
        if chunk.offset != self._received:
            raise FramingError(f"gap: expected offset {self._received}, got {chunk.offset}")
        if len(chunk.payload):
            self._parts.append(chunk.payload)
        self._received += len(chunk.payload)
        assert self._received <= self._total, "Chunk.decode bounds payloads by total"
        if self._received < self._total:
            return None
        key, parts = self._key, self._parts
        self._key, self._parts = None, []
        data = bytes(parts[0]) if len(parts) == 1 else b"".join(parts)
        assert len(data) == self._total, "reassembled length differs from total_bytes"
        return key, data


def batched(keys: Sequence[str], size: int) -> Iterable[list[str]]:
    """Consecutive slices of ``keys`` of at most ``size`` keys."""
    for start in range(0, len(keys), size):
        yield list(keys[start : start + size])


@dataclass(slots=True)
class ServerStats:
    """Reply of Stats (JSON on the wire): counters since the server started."""

    store_name: str = ""  # ``name`` of the exposed ByteStore
    num_contains_keys: int = 0  # keys asked about by Contains
    num_fetch_hits: int = 0  # objects sent by Fetch
    num_fetch_misses: int = 0  # Fetch keys not in the store
    num_bytes_sent: int = 0  # payload bytes sent by Fetch
    num_push_stored: int = 0  # objects stored by Push
    num_push_refused: int = 0  # objects the store refused (put_bytes False)
    num_bytes_received: int = 0  # payload bytes received by Push
    num_deleted: int = 0  # objects removed by Delete
    num_demoted: int = 0  # objects put first in line for eviction by Demote
    num_auth_failures: int = 0  # calls refused for a missing or wrong token
    num_bad_requests: int = 0  # calls refused for malformed or oversize frames
    num_store_errors: int = 0  # exceptions raised by the store (turned into misses)
    extra: dict[str, int] = field(default_factory=dict)  # forward-compatible counters

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> ServerStats:
        """Raises FramingError (a ValueError) for anything but a JSON object of counters."""
        raw = json.loads(bytes(data).decode())
        if not isinstance(raw, dict) or not isinstance(raw.get("extra", {}), dict):
            raise FramingError("server stats must be a JSON object")
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        unknown = {k: v for k, v in raw.items() if k not in cls.__dataclass_fields__}
        stats = cls(**known)
        stats.extra.update(unknown)
        return stats
