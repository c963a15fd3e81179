"""Disk tier: append-only segment files, memory-mapped reads, write-behind.

    put_bytes -> admission policy -> pending map + queue  (returns at once)
    writer thread -> append record to the active segment "<id>.seg.tmp"
                  -> full: fsync, rename to "<id>.seg" (sealed), map it
    get_bytes -> pending map (not yet written) | mmap of a sealed segment |
                 pread of the active one; the record CRC is checked on read
    over capacity -> compact sealed segments with >= 50% dead bytes (copy live
                 records forward), else drop the oldest sealed segment, copying
                 forward its records that were read since written (second chance)
    restart   -> scan sealed segments; a leftover "*.tmp" (crash) is cut at its
                 last valid record and sealed; damaged records are skipped and
                 counted in stats()["corrupt_records_skipped"]

Admission policies (table ``ADMISSION_POLICIES``): ``always``; ``second_touch``
(admit a key offered before: filters one-hit wonders; the store offers keys on
host eviction, so a block evicted twice is kept).

Config example::

    disk_tier:
      directory: /mnt/nvme/disagg
      capacity_bytes: 1099511627776   # 1 TiB of segment files
      segment_bytes: 268435456
      admission: always               # or second_touch
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kv_transfer import checksum
from kv_transfer.events import EventLog, StoreEvent, object_kind_of
from kv_transfer.tiers.disk_format import FLAG_TOMBSTONE, frame, record_size, scan_all

log = logging.getLogger(__name__)


class AdmitAlways:
    name = "always"

    def admit(self, key: str) -> bool:
        return True


class AdmitOnSecondTouch:
    """Admit a key the second time it is offered within the last ``window`` offers."""

    name = "second_touch"

    def __init__(self, window: int = 1 << 16):
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._window = window

    def admit(self, key: str) -> bool:
        if key in self._seen:
            del self._seen[key]
            return True
        self._seen[key] = None
        if len(self._seen) > self._window:
            self._seen.popitem(last=False)
        return False


ADMISSION_POLICIES: dict[str, Callable[[], AdmitAlways | AdmitOnSecondTouch]] = {
    "always": AdmitAlways,
    "second_touch": AdmitOnSecondTouch,
}


@dataclass(slots=True)
class _Segment:
    seg_id: int  # monotonically increasing; file order == write order
    path: str  # current file path (".seg.tmp" while active)
    fd: int  # open for pread / append
    size: int = 0  # bytes in the file
    live_bytes: int = 0  # bytes of records still in the index
    sealed: bool = False  # renamed, immutable, mapped
    map: mmap.mmap | None = None  # sealed segments only
    readers: int = 0  # reads in flight
    doomed: bool = False  # collected: close when the last reader leaves


@dataclass(slots=True)
class _Loc:
    seg_id: int  # segment holding the record
    data_offset: int  # absolute data offset in the file
    nbytes: int  # data length
    crc: int  # data CRC
    record_bytes: int  # record length on disk
    touched: bool = False  # read since written (second chance at GC)
    algo: int = checksum.CRC32  # the CRC's algorithm (disk_format.MAGICS)


def _private_directory(directory: str) -> None:
    """Create ``directory`` 0700, or make an existing one of this user's 0700 (DiskTier NOTE 7)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.stat(directory)
    if st.st_uid != os.getuid():
        raise PermissionError(f"disk tier directory {directory!r} belongs to uid {st.st_uid}, not this user "
                              f"({os.getuid()}): choose a directory of your own")
    if st.st_mode & 0o777 != 0o700:
        os.chmod(directory, 0o700)


class DiskTier:
    """Segment-file tier with a background writer.

    NOTES
    1. Sealed segments are immutable; only the active segment is appended to.
    2. total_bytes (sum of segment sizes) <= capacity_bytes after every append.
    3. A key is in at most one of ``_pending`` (queued) and ``_index`` (on disk).
    4. Nothing returned by get_bytes failed its CRC.
    5. A write that fails (no space, an I/O error) loses that object only: it is
       counted (``num_write_errors``) and dropped, and the writer goes on; a read
       that fails is a miss.
    6. A delete writes a tombstone, so the key stays deleted across restarts.
       Segments are collected in any order, so a collected segment's tombstones
       are written again while an older segment (which may hold the deleted
       record) remains.
    7. Tenants' state is the owner's alone: the directory is 0700 and owned by this user (one
       owned by another user is refused: it could have been planted), segment files are 0600,
       recovered ones included.
    8. ``on_evict`` (when given) receives the key and bytes of every record evicted to make
       room, as the host tier's does; it must not block (it runs under the tier's lock) and
       a failure there loses that object only.
    """

    def __init__(self, directory: str, capacity_bytes: int, *, segment_bytes: int = 256 << 20,
                 admission: str = "always", max_pending_bytes: int = 1 << 30, verify_reads: bool = True,
                 event_log: EventLog | None = None, worker_id: str = "", name: str = "disk",
                 on_evict: Callable[[str, bytes], None] | None = None):
        if admission not in ADMISSION_POLICIES:
            raise ValueError(f"unknown admission policy {admission!r}; known: {sorted(ADMISSION_POLICIES)}")
        self.name, self.directory, self.capacity_bytes = name, directory, capacity_bytes
        self.segment_bytes = min(segment_bytes, max(capacity_bytes // 4, 1 << 16))
        self.max_pending_bytes, self.verify_reads = max_pending_bytes, verify_reads
        self.event_log, self.worker_id = event_log, worker_id
        self.on_evict = on_evict  # evicted records' bytes go here (NOTE 8), e.g. a spill to the pool
        self._admission = ADMISSION_POLICIES[admission]()
        self._lock = threading.Lock()
        self._segments: dict[int, _Segment] = {}
        self._index: dict[str, _Loc] = {}
        self._pending: dict[str, tuple[int, bytes]] = {}
        self._tombs: dict[str, int] = {}  # deleted key -> segment of its newest tombstone (NOTE 6)
        self._pending_bytes = 0
        self._token = 0
        self._queue: queue.Queue[tuple[str, int] | None] = queue.Queue()
        self._counters = dict.fromkeys(
            ("num_puts", "num_written", "num_not_admitted", "num_backpressure", "num_hits", "num_misses",
             "num_evicted", "num_compacted_segments", "num_dropped_segments", "corrupt_records_skipped",
             "corrupt_files_skipped", "num_corrupt_reads", "num_read_errors", "num_write_errors", "bytes_written"), 0)
        _private_directory(directory)
        self._recover()
        self._active = self._new_segment()
        self._writer = threading.Thread(target=self._write_loop, name=f"{name}-writer", daemon=True)
        self._writer.start()

    # ---- ByteStore -----------------------------------------------------
    def put_bytes(self, key: str, data: bytes | bytearray | memoryview) -> bool:
        """Queue ``data`` for writing; never blocks on disk. False: not admitted or queue full."""
        with self._lock:
            if key in self._index or key in self._pending:
                return True
            if not self._admission.admit(key):
                self._counters["num_not_admitted"] += 1
                return False
            if self._pending_bytes + len(data) > self.max_pending_bytes or not self._fits(key, len(data)):
                self._counters["num_backpressure"] += 1
                return False
            self._token += 1
            self._pending[key] = (self._token, bytes(data))
            self._pending_bytes += len(data)
            self._counters["num_puts"] += 1
            self._queue.put((key, self._token))
        return True

    def get_bytes(self, key: str) -> bytes | None:
        with self._lock:
            if key in self._pending:
                self._counters["num_hits"] += 1
                return self._pending[key][1]
            loc = self._index.get(key)
            if loc is None:
                self._counters["num_misses"] += 1
                return None
            seg = self._segments[loc.seg_id]
            seg.readers += 1
            loc.touched = True
            view = seg.map if seg.sealed else None  # read together: sealing maps under the lock
        try:
            if view is not None:
                data = view[loc.data_offset : loc.data_offset + loc.nbytes]
            else:
                data = os.pread(seg.fd, loc.nbytes, loc.data_offset)
        except OSError as exc:  # a failing device: a miss (the caller recomputes), never an error
            log.warning("disk tier read of %s failed: %s", key, exc)
            data = None
        finally:
            with self._lock:
                seg.readers -= 1
                if seg.doomed and seg.readers == 0:
                    self._close_segment(seg)
        if data is None:
            with self._lock:
                self._counters["num_read_errors"] += 1
            return None
        if self.verify_reads and (len(data) != loc.nbytes or checksum.compute(loc.algo, data) != loc.crc):
            with self._lock:
                self._counters["num_corrupt_reads"] += 1
                if self._index.get(key) is loc:
                    self._drop(key)
            return None
        with self._lock:
            self._counters["num_hits"] += 1
        return data

    def contains(self, keys: Iterable[str]) -> list[bool]:
        with self._lock:
            return [k in self._index or k in self._pending for k in keys]

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index) + list(self._pending)

    def delete(self, key: str) -> bool:
        with self._lock:
            if key in self._pending:  # perhaps being written now, perhaps over an older record:
                self._pending_bytes -= len(self._pending.pop(key)[1])  # the tombstone follows either
            elif key in self._index:
                self._drop(key)
            else:
                return False
            self._token += 1
            self._queue.put((key, -self._token))  # tombstone: stays deleted across restarts
        return True

    # ---- writer thread -------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, token = item
                if token < 0:
                    self._append(key, b"", flags=FLAG_TOMBSTONE)
                    continue
                with self._lock:
                    entry = self._pending.get(key)
                    if entry is None or entry[0] != token:
                        continue  # deleted before it was written
                    data = entry[1]
                self._append(key, data, token=token)
            except Exception as exc:  # NOTE 5: one failed write never stops the writer
                log.warning("disk tier write of %s failed: %s", item[0] if item else None, exc)
                with self._lock:
                    self._counters["num_write_errors"] += 1
                    key, token = item
                    if token > 0 and self._pending.get(key, (None,))[0] == token:
                        self._pending_bytes -= len(self._pending.pop(key)[1])
            finally:
                self._queue.task_done()

    def _fits(self, key: str, nbytes: int) -> bool:
        need = record_size(len(key.encode()), nbytes)
        return need <= self.segment_bytes and need <= self.capacity_bytes

    def _append(self, key: str, data: bytes, flags: int = 0, touched: bool = False,
                token: int | None = None) -> None:
        """Write one record. ``token``: the pending entry it writes, indexed only if still pending
        once written (a delete during the write leaves it dead on disk; its tombstone follows)."""
        need = record_size(len(key.encode()), len(data))
        with self._lock:
            self._make_room(need)
            if self._active.size + need > self.segment_bytes and self._active.size:
                self._seal(self._active)
                self._active = self._new_segment()
            if self.total_bytes + need > self.capacity_bytes:
                raise OSError(f"no room for a {need}-byte record in {self.capacity_bytes} bytes")
            seg = self._active
        bufs, data_off, crc, algo = frame(key, data, flags)
        n = os.pwritev(seg.fd, bufs, seg.size)
        if n != need:  # nothing is indexed: the next record is written over it
            raise OSError(f"short write {n} != {need}")
        with self._lock:
            loc = _Loc(seg.seg_id, seg.size + data_off, len(data), crc, need, touched, algo)
            seg.size += need
            if flags & FLAG_TOMBSTONE:
                self._tombs[key] = seg.seg_id
                return
            if token is not None:
                if self._pending.get(key, (None,))[0] != token:
                    return  # deleted (or put again) while it was written
                del self._pending[key]
                self._pending_bytes -= len(data)
            if key in self._index:
                self._drop(key)
            self._index[key] = loc
            self._tombs.pop(key, None)
            seg.live_bytes += need
            self._counters["num_written"] += 1
            self._counters["bytes_written"] += need
        self._emit("stored", key, len(data))

    # ---- space management (lock held) ---------------------------------
    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self._segments.values() if not s.doomed)

    def _make_room(self, need: int) -> None:
        while self.total_bytes + need > self.capacity_bytes:
            sealed = sorted(s.seg_id for s in self._segments.values() if s.sealed and not s.doomed)
            if not sealed:
                if not self._active.size:
                    return
                self._seal(self._active)
                self._active = self._new_segment()
                continue
            dead = [i for i in sealed if self._segments[i].live_bytes * 2 <= self._segments[i].size]
            victim = self._segments[dead[0] if dead else sealed[0]]
            self._collect(victim, keep_all=bool(dead))

    def _collect(self, seg: _Segment, keep_all: bool) -> None:
        """Remove a sealed segment; re-queue its live records (all of them when
        compacting, else those read since written) and evict the rest."""
        owned = [(k, loc) for k, loc in self._index.items() if loc.seg_id == seg.seg_id]
        keep = [(k, loc) for k, loc in owned if keep_all or loc.touched]
        if sum(loc.record_bytes for _, loc in keep) > self.segment_bytes // 2 and not keep_all:
            keep = []
        for k, _ in owned:
            del self._index[k]
        for k, loc in keep:  # second chance: written again by the writer thread
            data = bytes(seg.map[loc.data_offset : loc.data_offset + loc.nbytes])
            self._token += 1
            self._pending[k] = (self._token, data)
            self._pending_bytes += len(data)
            self._queue.put((k, self._token))
        kept = {k for k, _ in keep}
        for k, loc in owned:
            if k not in kept:
                self._counters["num_evicted"] += 1
                self._emit("evicted", k, loc.nbytes)
                if self.on_evict is not None:  # NOTE 8
                    self._hand_on(k, bytes(seg.map[loc.data_offset : loc.data_offset + loc.nbytes]))
        # NOTE 6: its tombstones are written again while an older segment may hold their keys
        older = any(i < seg.seg_id and not s.doomed for i, s in self._segments.items())
        for k in [k for k, i in self._tombs.items() if i == seg.seg_id]:
            del self._tombs[k]
            if older and k not in self._index and k not in self._pending:
                self._token += 1
                self._queue.put((k, -self._token))
        self._counters["num_compacted_segments" if keep_all else "num_dropped_segments"] += 1
        seg.doomed = True
        os.unlink(seg.path)
        if seg.readers == 0:
            self._close_segment(seg)

    def _hand_on(self, key: str, data: bytes) -> None:
        try:
            self.on_evict(key, data)
        except Exception:  # noqa: BLE001 - a failing hand-on loses that object only
            log.warning("hand-on of evicted %s failed", key, exc_info=True)

    def _drop(self, key: str) -> None:
        loc = self._index.pop(key)
        self._segments[loc.seg_id].live_bytes -= loc.record_bytes

    def _new_segment(self) -> _Segment:
        seg_id = max(self._segments, default=0) + 1
        path = os.path.join(self.directory, f"{seg_id:010d}.seg.tmp")
        seg = _Segment(seg_id, path, os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600))
        os.fchmod(seg.fd, 0o600)  # a file left by an older run keeps its mode through O_CREAT (NOTE 7)
        self._segments[seg_id] = seg
        return seg

    def _seal(self, seg: _Segment) -> None:
        """Atomic publish: fsync the data, rename "*.tmp" away, fsync the directory."""
        os.fsync(seg.fd)
        sealed_path = seg.path[: -len(".tmp")]
        os.rename(seg.path, sealed_path)
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        seg.map = mmap.mmap(seg.fd, seg.size, prot=mmap.PROT_READ) if seg.size else None
        seg.path, seg.sealed = sealed_path, True

    def _close_segment(self, seg: _Segment) -> None:
        if seg.map is not None:
            seg.map.close()
        os.close(seg.fd)
        self._segments.pop(seg.seg_id, None)

    # ---- restart -------------------------------------------------------
    def _recover(self) -> None:
        names = sorted(os.listdir(self.directory))
        for name in names:
            stem = name.removesuffix(".tmp").removesuffix(".seg")
            if not (name.endswith(".seg") or name.endswith(".seg.tmp")) or not stem.isdigit():
                continue
            path = os.path.join(self.directory, name)
            try:
                self._load_segment(int(stem), path, torn=name.endswith(".tmp"))
            except (OSError, ValueError):
                self._counters["corrupt_files_skipped"] += 1

    def _load_segment(self, seg_id: int, path: str, torn: bool) -> None:
        fd = os.open(path, os.O_RDWR)
        os.fchmod(fd, 0o600)  # written by an older version with 0644 (NOTE 7)
        size = os.fstat(fd).st_size
        if size == 0:  # an active segment that never got a record
            os.close(fd)
            os.unlink(path)
            return
        buf = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else b""
        result = scan_all(memoryview(buf) if size else b"", size)
        if size and not result.records and result.num_corrupt:
            self._counters["corrupt_files_skipped"] += 1
        self._counters["corrupt_records_skipped"] += result.num_corrupt
        if isinstance(buf, mmap.mmap):
            buf.close()
        if torn:  # a crashed writer's active segment: keep its valid prefix and seal it
            os.ftruncate(fd, result.valid_end)
            size = result.valid_end
        seg = _Segment(seg_id, path, fd, size=size)
        self._segments[seg_id] = seg
        for rec in result.records:
            if rec.key in self._index:
                self._drop(rec.key)
            if rec.tombstone:
                self._tombs[rec.key] = seg_id
                continue
            self._tombs.pop(rec.key, None)
            need = rec.end - rec.offset
            self._index[rec.key] = _Loc(seg_id, rec.data_offset, rec.data_len, rec.data_crc, need, algo=rec.algo)
            seg.live_bytes += need
        if torn:
            self._seal(seg)
        else:
            seg.sealed = True
            seg.map = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None

    # ---- misc ----------------------------------------------------------
    def _emit(self, kind: str, key: str, nbytes: int) -> None:
        if self.event_log is not None:
            self.event_log.emit(StoreEvent(kind, key, object_kind_of(key), self.name, self.worker_id, nbytes=nbytes))

    def flush(self) -> None:
        """Block until every queued write has reached the segment files."""
        self._queue.join()

    def sync(self) -> None:
        """Drain the queue and seal the active segment: everything put so far is durable."""
        self.flush()
        with self._lock:
            if self._active.size:
                self._seal(self._active)
                self._active = self._new_segment()

    def stats(self) -> dict[str, int | str]:
        with self._lock:
            return {"tier": self.name, "capacity_bytes": self.capacity_bytes, "total_bytes": self.total_bytes,
                    "used_bytes": sum(loc.nbytes for loc in self._index.values()),
                    "num_objects": len(self._index), "num_pending": len(self._pending),
                    "pending_bytes": self._pending_bytes,
                    "num_segments": sum(1 for s in self._segments.values() if not s.doomed),
                    **self._counters}

    def close(self) -> None:
        """Drain the queue, seal the active segment, stop the writer."""
        self.flush()
        self._queue.put(None)
        self._writer.join()
        with self._lock:
            if self._active.size:
                self._seal(self._active)
            else:
                os.unlink(self._active.path)
            for seg in list(self._segments.values()):
                if seg.readers == 0:
                    self._close_segment(seg)
