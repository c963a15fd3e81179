"""The disk tier under faults and races: failed writes and reads, a delete while its record is
being written, a read while its segment is sealed, tombstones through compaction and restart.

A failing disk is a system boundary these machines cannot produce on demand: the tests swap
the disk module's ``os`` (only its view) for one whose ``pwritev`` / ``pread`` fail or wait.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import types

import pytest

import kv_transfer.tiers.disk as disk_mod
from kv_transfer.tiers.disk import DiskTier

SEG = 1 << 16


def _flushes(tier: DiskTier, timeout: float = 5.0) -> bool:
    t = threading.Thread(target=tier.flush, daemon=True)
    t.start()
    t.join(timeout)
    return not t.is_alive()


def _patch_os(monkeypatch, **calls) -> None:
    proxy = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    for name, fn in calls.items():
        setattr(proxy, name, fn)
    monkeypatch.setattr(disk_mod, "os", proxy)


def test_a_failed_write_loses_that_object_only(tmp_path, monkeypatch):
    tier = DiskTier(str(tmp_path), capacity_bytes=64 << 20, segment_bytes=1 << 20)
    fail = {"n": 1}

    def pwritev(fd, bufs, off):
        if fail["n"]:
            fail["n"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.pwritev(fd, bufs, off)

    _patch_os(monkeypatch, pwritev=pwritev)
    assert tier.put_bytes("a", b"a" * 4096)
    assert _flushes(tier)
    assert tier.put_bytes("b", b"b" * 4096)
    assert _flushes(tier), "the writer stopped after one failed write"
    st = tier.stats()
    assert st["num_write_errors"] == 1 and st["pending_bytes"] == 0 and st["num_pending"] == 0
    assert tier.get_bytes("a") is None and tier.get_bytes("b") == b"b" * 4096
    tier.close()


def test_a_record_larger_than_the_tier_is_refused_at_put(tmp_path):
    tier = DiskTier(str(tmp_path), capacity_bytes=SEG, segment_bytes=SEG)
    assert not tier.put_bytes("big", b"y" * SEG)  # the data fits a segment, its record does not
    assert tier.put_bytes("small", b"x" * 1000) and _flushes(tier)
    assert tier.get_bytes("small") == b"x" * 1000 and tier.stats()["num_write_errors"] == 0
    tier.close()


def test_a_failed_read_is_a_miss(tmp_path, monkeypatch):
    tier = DiskTier(str(tmp_path), capacity_bytes=64 << 20, segment_bytes=1 << 20)
    assert tier.put_bytes("a", b"a" * 4096) and _flushes(tier)  # in the active segment: pread

    def pread(*_):
        raise OSError(errno.EIO, "Input/output error")

    _patch_os(monkeypatch, pread=pread)
    assert tier.get_bytes("a") is None and tier.stats()["num_read_errors"] == 1
    monkeypatch.undo()
    assert tier.get_bytes("a") == b"a" * 4096  # a read error does not drop the record
    tier.close()


def test_a_delete_while_the_record_is_written_stays_deleted(tmp_path, monkeypatch):
    """delete() lands between the record's write and its indexing: the record must not be
    indexed afterwards, nor come back after a restart."""
    tier = DiskTier(str(tmp_path), capacity_bytes=64 << 20, segment_bytes=1 << 20)
    writing, go = threading.Event(), threading.Event()

    def pwritev(fd, bufs, off):
        n = os.pwritev(fd, bufs, off)
        if not writing.is_set():
            writing.set()
            go.wait(5)
        return n

    _patch_os(monkeypatch, pwritev=pwritev)
    assert tier.put_bytes("k", b"v" * 1000)
    assert writing.wait(5)  # the record is on disk, not yet indexed
    assert tier.delete("k")
    go.set()
    assert _flushes(tier)
    assert tier.contains(["k"]) == [False] and tier.get_bytes("k") is None
    assert tier.stats()["pending_bytes"] == 0
    tier.close()
    monkeypatch.undo()
    again = DiskTier(str(tmp_path), capacity_bytes=64 << 20, segment_bytes=1 << 20)
    assert again.contains(["k"]) == [False]
    again.close()


def test_a_read_while_its_segment_is_sealed(tmp_path, monkeypatch):
    """The writer seals the active segment (maps it) while a reader is between taking its
    place and reading: the reader gets the bytes, never an error."""
    tier = DiskTier(str(tmp_path), capacity_bytes=64 << 20, segment_bytes=SEG)
    assert tier.put_bytes("a", b"a" * 1000) and _flushes(tier)
    past_lock, sealing, read_done = threading.Event(), threading.Event(), threading.Event()
    armed = {"on": True}
    real_lock = tier._lock

    class Gate:  # the reader waits right after get_bytes' first locked section
        def __enter__(self):
            real_lock.acquire()

        def __exit__(self, *exc):
            real_lock.release()
            if threading.current_thread().name == "reader" and armed["on"]:
                armed["on"] = False
                past_lock.set()
                sealing.wait(5)

    tier._lock = Gate()

    def slow_mmap(*a, **k):  # the writer inside _seal, before the map exists
        if threading.current_thread().name.endswith("writer"):
            sealing.set()
            read_done.wait(5)
        return mmap.mmap(*a, **k)

    monkeypatch.setattr(disk_mod, "mmap", types.SimpleNamespace(mmap=slow_mmap, PROT_READ=mmap.PROT_READ))
    out: dict = {}

    def read():
        try:
            out["data"] = tier.get_bytes("a")
        except Exception as exc:  # noqa: BLE001 - the failure under test
            out["error"] = exc
        finally:
            read_done.set()

    t = threading.Thread(target=read, name="reader")
    t.start()
    assert past_lock.wait(5)
    assert tier.put_bytes("b", b"b" * (SEG - 1000))  # fills the segment: the writer seals it
    t.join(10)
    assert _flushes(tier)
    assert "error" not in out and out["data"] == b"a" * 1000
    tier._lock = real_lock
    tier.close()


@pytest.mark.parametrize("restart_twice", [False, True])
def test_a_delete_survives_compaction_of_its_tombstone_and_restarts(tmp_path, restart_twice):
    """The tombstone's segment is compacted while the deleted record's older segment stays:
    the tombstone is written again, and the key stays deleted after restarts."""
    d, data = str(tmp_path), 16000
    tier = DiskTier(d, capacity_bytes=4 * SEG, segment_bytes=SEG)
    for i in range(4):  # segment 1: A0 (to delete), A1..A3 (stay live)
        tier.put_bytes(f"A{i}", bytes([i]) * data)
    assert _flushes(tier)
    for i in range(3):  # segment 2: B0..B2, then A0's tombstone
        tier.put_bytes(f"B{i}", b"b" * data)
    assert _flushes(tier)
    assert tier.delete("A0") and all(tier.delete(f"B{i}") for i in range(3))  # segment 2: all dead
    assert _flushes(tier)
    i = 0
    while tier.stats()["num_compacted_segments"] == 0 and i < 40:
        tier.put_bytes(f"C{i}", b"c" * data)
        assert _flushes(tier)
        i += 1
    assert tier.stats()["num_compacted_segments"] >= 1
    assert tier.contains(["A0", "A1", "A2", "A3"]) == [False, True, True, True]  # segment 1 survived
    tier.close()
    for _ in range(2 if restart_twice else 1):
        tier = DiskTier(d, capacity_bytes=4 * SEG, segment_bytes=SEG)
        assert tier.contains(["A0", "A1"]) == [False, True]
        tier.close()
