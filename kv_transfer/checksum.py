"""Checksums for stored objects: CRC32C in hardware where available, CRC-32 otherwise.

Every encoded object names the algorithm its trailer was computed with (a byte
of the codec header), so readers and writers with different builds interoperate:

    code  algorithm  implementation                                   GIL
    1     CRC-32     ``zlib.crc32`` (standard library, ~1-3 GB/s)       released (> 5 KB)
    2     CRC32C     ``libcrc32c`` from the ``google-crc32c`` wheel     released (ctypes call)
                     through ctypes (SSE4.2 / ARMv8 CRC, ~5-20 GB/s)
                     -> ``google_crc32c.extend`` (same library)        held (non-bytes buffers)
                     -> a table-driven pure-Python CRC32C               held (slow: tests, rescue)

Why ctypes: ``google_crc32c.extend`` 1.9 releases the GIL only for ``bytes``
of 1 MiB or more and rejects memoryviews of shared memory, so the codec calls
the wheel's bundled C library directly (a ctypes foreign call always releases
the GIL) with the buffer's address: zero-copy, and the engine's threads keep
running while a state's pieces are checksummed.

``WRITE_ALGO`` is CRC32C when any CRC32C implementation short of the pure one
is present, else CRC-32. Both detect every burst error up to 32 bits and
every single flipped byte; neither is a cryptographic hash (a corrupt object
only costs a recompute).
"""

from __future__ import annotations

import ctypes
import glob
import os
import zlib
from collections.abc import Callable

import numpy as np

CRC32 = 1  # zlib CRC-32 (IEEE polynomial)
CRC32C = 2  # Castagnoli polynomial (iSCSI, ext4)
NAMES = {CRC32: "crc32", CRC32C: "crc32c"}

Buffer = bytes | bytearray | memoryview | np.ndarray


def _address(buf: Buffer) -> tuple[np.ndarray, int, int]:
    """(keep-alive array, address, length) of a contiguous byte buffer, without copying."""
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
    assert arr.flags.c_contiguous, "checksummed buffers must be contiguous"
    return arr, arr.ctypes.data, arr.nbytes


def _load_ctypes() -> Callable[[Buffer, int], int] | None:
    try:
        import google_crc32c
        import google_crc32c._crc32c  # noqa: F401  (loads the bundled libcrc32c)
    except ImportError:
        return None
    base = os.path.dirname(os.path.dirname(google_crc32c.__file__))
    paths = glob.glob(os.path.join(base, "google_crc32c.libs", "libcrc32c*.so*"))  # manylinux wheels
    paths += glob.glob(os.path.join(os.path.dirname(google_crc32c.__file__), "_crc32c*.so"))
    for path in paths:
        try:
            fn = ctypes.CDLL(path).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_uint32, (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)

        def crc32c_ctypes(buf: Buffer, value: int = 0, _fn=fn) -> int:
            keep, addr, n = _address(buf)
            out = _fn(value, addr, n)
            del keep
            return out

        return crc32c_ctypes
    return None


def _load_extension() -> Callable[[Buffer, int], int] | None:
    try:
        import google_crc32c
    except ImportError:
        return None
    if getattr(google_crc32c, "implementation", "") != "c":
        return None

    def crc32c_ext(buf: Buffer, value: int = 0) -> int:
        arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1)
        return google_crc32c.extend(value, arr)  # ndarrays pass its read-only buffer check

    return crc32c_ext


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c_pure(buf: Buffer, value: int = 0) -> int:
    """CRC32C in pure Python (about 10 MB/s): the fallback of last resort."""
    table, crc = _TABLE, value ^ 0xFFFFFFFF
    for b in np.frombuffer(buf, dtype=np.uint8).tobytes():
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def crc32(buf: Buffer, value: int = 0) -> int:
    return zlib.crc32(buf if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8), value)


_native = _load_ctypes() or _load_extension()
crc32c: Callable[[Buffer, int], int] = _native or crc32c_pure
IMPLEMENTATION = ("ctypes" if _native.__name__ == "crc32c_ctypes" else "extension") if _native else "pure"
WRITE_ALGO = CRC32C if _native is not None else CRC32
_BY_CODE: dict[int, Callable[[Buffer, int], int]] = {CRC32: crc32, CRC32C: crc32c}


TRAILER = 4  # bytes: a u32, little-endian, at the end of an object


def seal(buf: memoryview, algo: int) -> int:
    """Write ``buf``'s trailer: its last ``TRAILER`` bytes become the ``algo`` checksum of the bytes
    before them (the codec's object layout). Lets the process that owns a tier checksum objects
    that a client wrote without one (``HostTier.seal_many``). Returns the checksum."""
    mv = buf.cast("B") if buf.format != "B" else buf
    value = compute(algo, mv[: len(mv) - TRAILER])
    mv[len(mv) - TRAILER :] = value.to_bytes(TRAILER, "little")
    return value


def compute(algo: int, buf: Buffer, value: int = 0) -> int:
    """Checksum ``buf`` with algorithm ``algo`` (``CRC32`` or ``CRC32C``), continuing from ``value``."""
    fn = _BY_CODE.get(algo)
    if fn is None:
        raise ValueError(f"unknown checksum algorithm {algo}")
    return fn(buf, value)
