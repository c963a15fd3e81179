"""Throughput of the host and disk tiers against same-run baselines.

Host tier: put (reserve + copy into the shared arena + commit, with eviction in
steady state) and get (``get_bytes``: a copy out; ``get_view``: a zero-copy
pinned view, then one pass of CRC over it, as a decode would do) for 1, 4, 16
and 64 MiB objects, each as a ratio to a plain memory copy of the same bytes
into (put) or out of (get) an already-touched buffer of the same footprint,
measured in the same run (goal >= 0.7).

Disk tier: write (put into the write-behind queue, drain, seal = fsync) and
read (``get_bytes`` from the memory-mapped segments, page cache warm) against
a dd-style sequential write (+ fsync) and read of a plain file of the same
total size in the same directory.

    python benchmarks/kv_transfer_bench.py [--total-mib 512] [--dir /mnt/nvme/tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kv_transfer.tiers.disk import DiskTier  # noqa: E402
from kv_transfer.tiers.host import HostTier  # noqa: E402

MiB = 1 << 20


def _best(fn, repeat: int) -> float:
    """Best wall time of ``repeat`` runs (seconds)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_host(size: int, total: int, repeat: int) -> dict[str, float]:
    count = max(total // size, 2)
    capacity = max(16 * size, 256 * MiB)
    slab = max(4 * size, capacity // 16)
    src = bytearray(os.urandom(size))
    small = bytearray(size)
    big = bytearray(count * size)  # baseline buffers span the same footprint as the arena traffic
    big[:] = bytes(len(big))
    small[:] = src
    mv_src, mv_small, mv_big = memoryview(src), memoryview(small), memoryview(big)

    def memcpy_in() -> None:
        for i in range(count):
            mv_big[i * size : (i + 1) * size] = mv_src

    def memcpy_out() -> None:
        for i in range(count):
            mv_small[:] = mv_big[i * size : (i + 1) * size]

    t_in, t_out = _best(memcpy_in, repeat), _best(memcpy_out, repeat)
    out: dict[str, float] = {"memcpy_gbs": count * size / t_in / 1e9}
    with HostTier(capacity, slab_bytes=slab, prefault=True) as tier:
        gen = iter(range(1 << 30))

        def put() -> None:
            for _ in range(count):
                assert tier.put_bytes(f"k{next(gen)}", mv_src)

        t_put = _best(put, repeat)
        keys = tier.keys()
        reads = [keys[i % len(keys)] for i in range(count)]

        def get_copy() -> None:
            for k in reads:
                _copy_out(tier, k, mv_small)

        def get_view_crc() -> None:
            for k in reads:
                with tier.get_view(k) as lease:
                    zlib.crc32(lease.view)

        t_get = _best(get_copy, repeat)
        t_view = _best(get_view_crc, repeat)
        t_crc = _best(lambda: [zlib.crc32(mv_big[i * size : (i + 1) * size]) for i in range(count)], repeat)
    out.update(put_ratio=t_in / t_put, get_ratio=t_out / t_get, view_crc_ratio=t_crc / t_view)
    return out


def _copy_out(tier: HostTier, key: str, dst: memoryview) -> memoryview:
    """get into a caller buffer (what a loader does): pin, one copy, release."""
    with tier.get_view(key) as lease:
        dst[: lease.nbytes] = lease.view
    return dst


def bench_disk(size: int, total: int, directory: str) -> dict[str, float]:
    count = max(total // size, 2)
    data = os.urandom(size)
    base = os.path.join(directory, "dd.bin")

    t0 = time.perf_counter()
    fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for _ in range(count):
        os.write(fd, data)
    os.fsync(fd)
    os.close(fd)
    t_dd_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    fd = os.open(base, os.O_RDONLY)
    while os.read(fd, size):
        pass
    os.close(fd)
    t_dd_read = time.perf_counter() - t0
    os.unlink(base)

    seg_dir = os.path.join(directory, "segments")
    tier = DiskTier(seg_dir, capacity_bytes=2 * count * size + (256 * MiB),
                    segment_bytes=max(256 * MiB, 2 * size), max_pending_bytes=4 * count * size)
    t0 = time.perf_counter()
    for i in range(count):
        assert tier.put_bytes(f"k{i}", data)
    t_enqueue = time.perf_counter() - t0
    tier.sync()  # drain + seal (fsync), like the baseline's final fsync
    t_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(count):
        assert tier.get_bytes(f"k{i}") is not None
    t_read = time.perf_counter() - t0
    tier.verify_reads = False  # the codec verifies its own CRC on decode anyway
    t0 = time.perf_counter()
    for i in range(count):
        assert tier.get_bytes(f"k{i}") is not None
    t_read_raw = time.perf_counter() - t0
    tier.close()
    shutil.rmtree(seg_dir)
    return {"dd_write_gbs": count * size / t_dd_write / 1e9, "write_ratio": t_dd_write / t_write,
            "dd_read_gbs": count * size / t_dd_read / 1e9, "read_ratio": t_dd_read / t_read,
            "read_raw_ratio": t_dd_read / t_read_raw,
            "enqueue_ms": 1e3 * t_enqueue / count}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-mib", type=int, default=512, help="bytes moved per object size")
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="directory for the disk benchmark")
    args = ap.parse_args()
    total = args.total_mib * MiB

    print("host tier (ratio to a same-run memcpy of the same bytes; goal >= 0.7)")
    print(f"{'object':>8} {'memcpy GB/s':>12} {'put':>6} {'get':>6} {'view+crc':>9}")
    for s in args.sizes_mib:
        r = bench_host(s * MiB, total, args.repeat)
        print(f"{s:>5}MiB {r['memcpy_gbs']:>12.2f} {r['put_ratio']:>6.2f} {r['get_ratio']:>6.2f} "
              f"{r['view_crc_ratio']:>9.2f}", flush=True)

    directory = tempfile.mkdtemp(prefix="kvt-bench-", dir=args.dir)
    try:
        print("\ndisk tier (ratio to a same-run dd-style sequential write/read of the same size)")
        print(f"{'object':>8} {'dd write GB/s':>14} {'write':>6} {'dd read GB/s':>13} {'read':>6} "
              f"{'read(no crc)':>13} {'enqueue ms':>11}")
        for s in args.sizes_mib:
            r = bench_disk(s * MiB, total, directory)
            print(f"{s:>5}MiB {r['dd_write_gbs']:>14.2f} {r['write_ratio']:>6.2f} {r['dd_read_gbs']:>13.2f} "
                  f"{r['read_ratio']:>6.2f} {r['read_raw_ratio']:>13.2f} {r['enqueue_ms']:>11.2f}", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
