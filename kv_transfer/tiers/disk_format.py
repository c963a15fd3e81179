"""Framed records of the disk tier's segment files.

Why our own framing and not Arrow IPC: every record needs its own CRC (Arrow
IPC has none) so a torn tail or a flipped bit costs one record, not a file;
records must be appendable one at a time by a background writer; and reads are
plain byte ranges of a memory map. Each record starts on a 64-byte boundary so
a scan can resynchronise after damage and payloads are aligned for
``torch.frombuffer``:

    offset 0                 24        align64(24 + key_len)          align64(...)
           | header (24 B)   | key     | pad | data (data_len)  | pad |
    header := magic | u16 key_len | u16 flags | u64 data_len
              | u32 data_crc | u32 header_crc (over header[:20] + key)

The magic names the checksum of both CRCs: "DKR2" CRC32C (written where the native CRC32C
of ``kv_transfer.checksum`` is available: several times zlib's speed, GIL released), "DKR1"
CRC-32 (written otherwise; files written before DKR2 existed read as before).

flags: 0 = object, 1 = tombstone (the key was deleted; data_len = 0).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

from kv_transfer import checksum

MAGICS = {b"DKR1": checksum.CRC32, b"DKR2": checksum.CRC32C}  # magic -> checksum algorithm
RECORD_MAGIC = b"DKR2" if checksum.WRITE_ALGO == checksum.CRC32C else b"DKR1"  # what ``frame`` writes
RECORD_ALIGN = 64
FLAG_TOMBSTONE = 1
_HEADER = struct.Struct("<4sHHQII")
HEADER_BYTES = _HEADER.size
assert HEADER_BYTES == 24


def align(n: int) -> int:
    return (n + RECORD_ALIGN - 1) // RECORD_ALIGN * RECORD_ALIGN


def record_size(key_len: int, data_len: int) -> int:
    return align(HEADER_BYTES + key_len) + align(data_len)


def frame(key: str, data: bytes | memoryview, flags: int = 0) -> tuple[list[bytes | memoryview], int, int, int]:
    """Buffers to write for one record (for ``os.writev``), the data's offset
    within the record, the data CRC and its algorithm (``MAGICS[RECORD_MAGIC]``)."""
    kb = key.encode()
    algo = MAGICS[RECORD_MAGIC]
    data_crc = checksum.compute(algo, data)
    head = _HEADER.pack(RECORD_MAGIC, len(kb), flags, len(data), data_crc, 0)
    header_crc = checksum.compute(algo, kb, checksum.compute(algo, head[:20]))
    head = head[:20] + struct.pack("<I", header_crc)
    data_off = align(HEADER_BYTES + len(kb))
    pad1 = bytes(data_off - HEADER_BYTES - len(kb))
    pad2 = bytes(align(len(data)) - len(data))
    return [head, kb, pad1, data, pad2], data_off, data_crc, algo


@dataclass(frozen=True, slots=True)
class ScannedRecord:
    key: str  # object key
    offset: int  # record start in the file
    data_offset: int  # absolute offset of the data in the file
    data_len: int  # data bytes
    data_crc: int  # CRC of the data
    tombstone: bool  # a delete marker
    end: int  # offset just past the record (aligned)
    algo: int = checksum.CRC32  # the CRCs' algorithm (``kv_transfer.checksum``), from the magic


@dataclass(slots=True)
class ScanResult:
    records: list[ScannedRecord]  # valid records, file order
    num_corrupt: int = 0  # damaged records skipped (bad header, bad data CRC, torn tail)
    valid_end: int = 0  # offset just past the last valid record


def scan(buf: memoryview | bytes, size: int | None = None) -> Iterator[ScannedRecord | int]:
    """Walk the records of one segment. Yields ScannedRecord for valid records
    and an int (the offset) for each damaged region skipped."""
    size = len(buf) if size is None else size
    pos = 0
    while pos + HEADER_BYTES <= size:
        magic, key_len, flags, data_len, data_crc, header_crc = _HEADER.unpack_from(buf, pos)
        key_end = pos + HEADER_BYTES + key_len
        algo = MAGICS.get(magic)
        ok = algo is not None and key_end <= size
        if ok:
            head = checksum.compute(algo, buf[pos : pos + 20])
            ok = checksum.compute(algo, buf[pos + HEADER_BYTES : key_end], head) == header_crc
        if not ok:
            nxt = _resync(buf, pos + RECORD_ALIGN, size)
            if nxt == size and magic == bytes(4) and not any(bytes(buf[pos:size])):
                return  # zero fill past the last record (a sparse or preallocated tail)
            yield pos
            pos = nxt
            continue
        data_off = pos + align(HEADER_BYTES + key_len)
        end = data_off + align(data_len)
        if data_off + data_len > size:
            yield pos  # torn tail: the header made it to disk, the data did not
            return
        if checksum.compute(algo, buf[data_off : data_off + data_len]) != data_crc:
            yield pos
        else:
            key = bytes(buf[pos + HEADER_BYTES : key_end]).decode("utf-8", "replace")
            yield ScannedRecord(key, pos, data_off, data_len, data_crc, bool(flags & FLAG_TOMBSTONE), min(end, size),
                                algo)
        pos = end


def _resync(buf: memoryview | bytes, pos: int, size: int) -> int:
    """Next 64-byte aligned offset at or after ``pos`` that starts with a magic."""
    raw = buf.obj if isinstance(buf, memoryview) and hasattr(buf.obj, "find") else bytes(buf)
    while pos < size:
        found = min((f for f in (raw.find(m, pos, size) for m in MAGICS) if f >= 0), default=-1)
        if found < 0:
            return size
        if found % RECORD_ALIGN == 0:
            return found
        pos = found - found % RECORD_ALIGN + RECORD_ALIGN
    return size


def scan_all(buf: memoryview | bytes, size: int | None = None) -> ScanResult:
    result = ScanResult([])
    for item in scan(buf, size):
        if isinstance(item, int):
            result.num_corrupt += 1
        else:
            result.records.append(item)
            result.valid_end = item.end
    return result
