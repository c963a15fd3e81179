from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kv_transfer.events import EventLog
from kv_transfer.tiers.base import ByteStore
from kv_transfer.tiers.disk import ADMISSION_POLICIES, DiskTier

KiB, MiB = 1 << 10, 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def payload(key: str, size: int) -> bytes:
    unit = (key + "|").encode()
    return (unit * (size // len(unit) + 1))[:size]


def segment_files(d: str, suffix: str = ".seg") -> list[str]:
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(suffix))


def test_round_trip_write_behind_and_restart(tmp_path) -> None:
    d = str(tmp_path)
    tier = DiskTier(d, 8 * MiB, segment_bytes=256 * KiB)
    assert isinstance(tier, ByteStore)
    for i in range(30):
        assert tier.put_bytes(f"k{i}", payload(f"k{i}", 20_000 + i))
    assert tier.get_bytes("k29") == payload("k29", 20_029)  # readable while still queued
    assert tier.put_bytes("k0", b"ignored")  # immutable
    tier.flush()
    st = tier.stats()
    assert (st["num_objects"], st["num_pending"], st["num_written"]) == (30, 0, 30)
    assert st["num_segments"] >= 2 and st["total_bytes"] <= tier.capacity_bytes
    assert all(tier.get_bytes(f"k{i}") == payload(f"k{i}", 20_000 + i) for i in range(30))
    assert tier.contains(["k3", "zz"]) == [True, False]
    assert tier.delete("k3") and not tier.delete("k3")
    tier.close()
    assert not segment_files(d, ".tmp")  # clean close seals the active segment
    again = DiskTier(d, 8 * MiB, segment_bytes=256 * KiB)
    assert again.stats()["num_objects"] == 29
    assert again.get_bytes("k3") is None  # the tombstone survived the restart
    assert again.get_bytes("k7") == payload("k7", 20_007)
    assert again.stats()["corrupt_records_skipped"] == 0
    again.close()


CRASHER = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, sys.argv[2])
    from kv_transfer.tiers.disk import DiskTier
    tier = DiskTier(sys.argv[1], 8 << 20, segment_bytes=256 << 10)
    for i in range(25):
        tier.put_bytes(f"k{i}", bytes([i % 251]) * 30000)
    tier.flush()
    os._exit(0)   # crash: no close, the active segment stays "*.tmp"
    """
)


def test_recovery_after_a_writer_crash_and_a_torn_tail(tmp_path) -> None:
    d = str(tmp_path)
    subprocess.run([sys.executable, "-c", CRASHER, d, ROOT], check=True, timeout=60)
    (tmp,) = segment_files(d, ".tmp")
    size = os.path.getsize(tmp)
    with open(tmp, "r+b") as f:  # the last record was half written when power went
        f.truncate(size - 1000)
    tier = DiskTier(d, 8 * MiB, segment_bytes=256 * KiB)
    st = tier.stats()
    assert st["corrupt_records_skipped"] == 1
    assert st["num_objects"] == 24
    assert tier.get_bytes("k24") is None
    assert all(tier.get_bytes(f"k{i}") == bytes([i]) * 30000 for i in range(24))
    assert not os.path.exists(tmp) and os.path.exists(tmp[: -len(".tmp")])  # valid prefix sealed
    tier.close()


def test_flipped_byte_in_a_sealed_segment_is_skipped_and_counted(tmp_path) -> None:
    d = str(tmp_path)
    tier = DiskTier(d, 8 * MiB, segment_bytes=256 * KiB)
    for i in range(20):
        tier.put_bytes(f"k{i}", payload(f"k{i}", 30_000))
    tier.close()
    first = segment_files(d)[0]
    with open(first, "r+b") as f:
        f.seek(5000)  # inside the first record's data
        b = f.read(1)
        f.seek(5000)
        f.write(bytes([b[0] ^ 0x40]))
    with open(os.path.join(d, "0000000099.seg"), "wb") as f:
        f.write(b"garbage" * 100)  # a damaged file: skipped and counted
    tier = DiskTier(d, 8 * MiB, segment_bytes=256 * KiB)
    st = tier.stats()
    assert st["corrupt_records_skipped"] >= 2 and st["corrupt_files_skipped"] == 1
    assert st["num_objects"] == 19 and tier.get_bytes("k0") is None
    assert all(tier.get_bytes(f"k{i}") == payload(f"k{i}", 30_000) for i in range(1, 20))
    tier.close()


def test_corruption_after_open_turns_into_a_miss(tmp_path) -> None:
    d = str(tmp_path)
    tier = DiskTier(d, 8 * MiB, segment_bytes=128 * KiB)
    for i in range(10):
        tier.put_bytes(f"k{i}", payload(f"k{i}", 30_000))
    tier.flush()
    with open(segment_files(d)[0], "r+b") as f:  # sealed and mapped: the map sees the change
        f.seek(200)
        f.write(b"\xff\xff")
    assert tier.get_bytes("k0") is None
    assert tier.stats()["num_corrupt_reads"] == 1 and not tier.contains(["k0"])[0]
    tier.close()


def test_capacity_gc_compaction_and_second_chance(tmp_path) -> None:
    log = EventLog()
    tier = DiskTier(str(tmp_path), 1 * MiB, segment_bytes=128 * KiB, event_log=log)
    for i in range(100):  # 100 x 30 KB = 3 MB through a 1 MB tier
        tier.put_bytes(f"k{i}", payload(f"k{i}", 30_000))
        if i % 10 == 0:
            tier.flush()
            assert tier.get_bytes("k0") is not None  # read since written: second chance at GC
        tier.flush()
        assert tier.stats()["total_bytes"] <= tier.capacity_bytes
    st = tier.stats()
    assert st["num_dropped_segments"] > 0 and st["num_evicted"] > 0
    assert tier.contains(["k0", "k1", "k99"]) == [True, False, True]
    evicted = [e.key for e in log.take() if e.kind == "evicted"]
    assert "k1" in evicted and "k0" not in evicted
    for i in range(60, 100):  # dead bytes -> compaction instead of dropping live data
        tier.delete(f"k{i}")
    for i in range(100, 110):
        tier.put_bytes(f"k{i}", payload(f"k{i}", 30_000))
    tier.flush()
    assert tier.stats()["num_compacted_segments"] > 0
    assert tier.get_bytes("k0") == payload("k0", 30_000)
    tier.close()


def test_admission_second_touch_and_backpressure(tmp_path) -> None:
    assert set(ADMISSION_POLICIES) == {"always", "second_touch"}
    tier = DiskTier(str(tmp_path / "a"), 4 * MiB, admission="second_touch", max_pending_bytes=100_000)
    assert tier.put_bytes("x", b"1" * 100) is False  # first offer: remembered, not admitted
    assert tier.put_bytes("x", b"1" * 100) is True
    assert tier.stats()["num_not_admitted"] == 1
    tier.close()
    with pytest.raises(ValueError):
        DiskTier(str(tmp_path / "b"), 4 * MiB, admission="never")


def test_crc32_records_of_older_files_read_beside_crc32c_ones(tmp_path, monkeypatch) -> None:
    """Segments of "DKR1" records (CRC-32: files from before CRC32C frames, or a machine without
    the native CRC32C) are recovered and verified beside "DKR2" (CRC32C) ones."""
    from kv_transfer.tiers import disk_format

    d = str(tmp_path)
    with monkeypatch.context() as m:  # a writer of the older format
        m.setattr(disk_format, "RECORD_MAGIC", b"DKR1")
        old = DiskTier(d, 8 * MiB, segment_bytes=256 * KiB)
        for i in range(12):
            assert old.put_bytes(f"old{i}", payload(f"old{i}", 30_000))
        old.flush()
        assert old.get_bytes("old3") == payload("old3", 30_000), "verified with the CRC it was written with"
        old.close()
    def magics(files: list[str]) -> set[bytes]:
        out = set()
        for path in files:
            with open(path, "rb") as f:
                out.add(f.read(4))
        return out

    older = segment_files(d)
    assert magics(older) == {b"DKR1"}
    tier = DiskTier(d, 8 * MiB, segment_bytes=256 * KiB)
    for i in range(12):
        assert tier.put_bytes(f"new{i}", payload(f"new{i}", 30_000))
    tier.close()
    assert magics([p for p in segment_files(d) if p not in older]) == {disk_format.RECORD_MAGIC}
    again = DiskTier(d, 8 * MiB, segment_bytes=256 * KiB)
    assert again.stats()["num_objects"] == 24 and again.stats()["corrupt_records_skipped"] == 0
    assert all(again.get_bytes(f"{k}{i}") == payload(f"{k}{i}", 30_000) for k in ("old", "new") for i in range(12))
    again.close()


# -- permissions: tenants' state is the owner's alone (DiskTier NOTE 7) ----------------------------
def _mode(path) -> int:
    return os.stat(path).st_mode & 0o777


def test_segments_and_directory_are_owner_only(tmp_path):
    d = tmp_path / "tier"
    tier = DiskTier(str(d), 1 << 22)
    try:
        tier.put_bytes("k", b"x" * 1000)
        tier.flush()
        assert _mode(d) == 0o700
        files = list(d.iterdir())
        assert files and all(_mode(f) == 0o600 for f in files), [(f.name, oct(_mode(f))) for f in files]
    finally:
        tier.close()


def test_an_older_runs_open_directory_and_files_are_closed_up(tmp_path):
    d = tmp_path / "tier"
    tier = DiskTier(str(d), 1 << 22)
    tier.put_bytes("k", b"x" * 1000)
    tier.flush()
    tier.close()
    d.chmod(0o755)
    for f in d.iterdir():
        f.chmod(0o644)  # as an older version left them
    again = DiskTier(str(d), 1 << 22)
    try:
        assert again.get_bytes("k") == b"x" * 1000
        assert _mode(d) == 0o700 and all(_mode(f) == 0o600 for f in d.iterdir())
    finally:
        again.close()


def test_a_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "planted"
    d.mkdir(mode=0o777)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(d).st_uid + 1)  # as if someone else had made it
    with pytest.raises(PermissionError, match="belongs to uid"):
        DiskTier(str(d), 1 << 22)


def test_evicted_records_are_handed_on_with_their_bytes(tmp_path) -> None:
    """``on_evict`` gets exactly the records the tier reports evicted, with the bytes put (NOTE 8);
    a failing receiver loses nothing else."""
    log, handed = EventLog(), {}

    def receive(key: str, data: bytes) -> None:
        if key == "k3":
            raise RuntimeError("receiver down")
        handed[key] = data

    tier = DiskTier(str(tmp_path), 1 * MiB, segment_bytes=128 * KiB, event_log=log, on_evict=receive)
    for i in range(60):  # 60 x 30 KB through a 1 MB tier
        tier.put_bytes(f"k{i}", payload(f"k{i}", 30_000 + i))
        tier.flush()
    evicted = {e.key for e in log.take() if e.kind == "evicted"}
    assert len(evicted) > 10 and "k3" in evicted
    assert set(handed) == evicted - {"k3"}
    assert all(data == payload(k, 30_000 + int(k[1:])) for k, data in handed.items())
    assert tier.get_bytes("k59") == payload("k59", 30_059), "the tier goes on after a failed hand-on"
    tier.close()
