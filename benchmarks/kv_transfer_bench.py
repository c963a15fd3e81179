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

State path (``--state``): ``StateStore.put_state`` and ``resumable_length`` +
``load_state(contiguous=True)`` of one resume state of the ``small`` preset
(bf16 MLA blocks of 64 tokens + the KDA checkpoint) at ``--context`` tokens,
as a multiple of one single-threaded memcpy of the same bytes into a touched
buffer (1.0 = as cheap as one copy; lower is better), for each path measured
in the same run: the batched path (batch reserve / pin, ``BlockCodec``) with
CRC32C and with CRC-32, and the per-object path (a tier wrapper that hides the
batch operations, as fault injection does); in-process (``HostTier``) and
through a node store process (``HostTierServer`` in a child process, reached
by ``HostTierClient``).

    python benchmarks/kv_transfer_bench.py --state [--context 32768] [--io-threads 2] [--no-ipc]
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


# ---- state path -------------------------------------------------------------------------
class _PerObject:
    """A tier seen without its batch operations (the per-object path of ``StateStore``)."""

    def __init__(self, tier):
        self._tier = tier

    def __getattr__(self, name: str):
        return getattr(self._tier, name)


def _small_layout():
    from disagg.engine.reference.config import load_preset
    from kv_transfer.objects import StateLayout

    c = load_preset("small")
    return StateLayout("bench-small", 64, len(c.mla_layer_ids), c.latent_dim, len(c.kda_layer_ids),
                       c.kda_num_heads, c.kda_head_dim, c.kda_head_dim, c.conv_width,
                       "bfloat16", "bfloat16", "float32")


def _state(layout, context: int):
    import torch

    from kv_transfer.objects import KDACheckpoint, MLABlock, ResumeState

    g = torch.Generator().manual_seed(0)
    bs, n = layout.block_size, context // layout.block_size
    rows = torch.randn((layout.num_mla_layers, n * bs, layout.latent_dim), generator=g).to(torch.bfloat16)
    blocks = [MLABlock(rows[:, i * bs : (i + 1) * bs], i * bs, bs) for i in range(n)]
    h = layout.kda_heads
    conv = torch.randn((layout.num_kda_layers, layout.conv_width - 1, 3 * h * layout.head_k), generator=g)
    rec = torch.randn((layout.num_kda_layers, h, layout.head_k, layout.head_v), generator=g)
    kda = KDACheckpoint(conv.to(torch.bfloat16), rec, n * bs)
    return ResumeState(layout, n * bs, blocks, 0, None, [kda], mla_rows=rows)


def _serve_host(capacity: int, conn) -> None:
    """Child process: own a host tier and serve it until told to stop (the node's store process)."""
    from kv_transfer.tiers.host_ipc import HostTierServer

    tier = HostTier(capacity, prefault=True)
    server = HostTierServer(tier)
    conn.send(server.socket_path)
    conn.recv()
    server.close()
    tier.close()


def bench_state(context: int, io_threads: int, repeat: int, ipc: bool) -> list[tuple[str, float, float]]:
    """(path, put / memcpy, load / memcpy) per path: medians over ``repeat`` rounds; each round
    measures the memcpy baseline and then every path once (interleaved, so load on the machine
    hits them alike); stored objects are deleted after each measurement (a long-lived arena)."""
    import multiprocessing as mp
    import statistics

    import numpy as np
    import torch

    from kv_transfer import checksum, codec
    from kv_transfer.keys import BlockHasher, KeyExtras
    from kv_transfer.store import StateStore
    from kv_transfer.tiers.host_ipc import HostTierClient

    layout = _small_layout()
    state = _state(layout, context)
    tokens = list(range(3, 3 + context + 16))
    hasher = BlockHasher(layout.block_size, KeyExtras(layout.model_id))
    srcs = [state.mla_rows, state.kda[0].conv, state.kda[0].recurrent]
    nbytes = sum(t.nbytes for t in srcs)
    dsts = [torch.zeros_like(t) for t in srcs]
    capacity = max(256 * MiB, 2 * nbytes)
    paths = [("batched crc32c", True, checksum.CRC32C), ("batched crc32", True, checksum.CRC32),
             ("per-object crc32", False, checksum.CRC32)]
    if checksum.WRITE_ALGO != checksum.CRC32C:
        paths = [p for p in paths if p[2] == checksum.CRC32]
    tiers = {"in-process": HostTier(capacity, prefault=True)}
    stop = None
    if ipc:  # the node's store process owns the arena; this process is a client
        parent, child = mp.Pipe()
        proc = mp.get_context("spawn").Process(target=_serve_host, args=(capacity, child), daemon=True)
        proc.start()
        tiers["store process"] = HostTierClient(parent.recv())
        stop = (parent, proc)
    names = [f"{place}, {name}" for place in tiers for name, _, _ in paths]
    t_copy: list[float] = []
    ratios: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in names}
    write_algo = checksum.WRITE_ALGO
    try:
        for _ in range(repeat):
            t_copy.append(_best(lambda: [codec.host_copy(d, t) for d, t in zip(dsts, srcs, strict=True)], 3))
            for place, tier in tiers.items():
                for name, batched, algo in paths:
                    checksum.WRITE_ALGO = algo
                    codec.block_codec.cache_clear()
                    store = StateStore([tier if batched else _PerObject(tier)], layout, io_threads=io_threads)
                    t0 = time.perf_counter()
                    put = store.put_state(tokens[:context], state, hasher)
                    t_put = time.perf_counter() - t0
                    assert put.num_stored == len(state.mla_blocks) + 1, put
                    t0 = time.perf_counter()
                    point = store.resumable_length(tokens, hasher, context)
                    got = store.load_state(tokens, point.position, hasher, contiguous=True)
                    t_load = time.perf_counter() - t0
                    assert got is not None and point.position == context
                    assert np.array_equal(codec._as_numpy(got.mla_rows), codec._as_numpy(state.mla_rows))
                    del got
                    for key in put.keys_stored:
                        assert tier.delete(key)
                    ratios[f"{place}, {name}"][0].append(t_put / t_copy[-1])
                    ratios[f"{place}, {name}"][1].append(t_load / t_copy[-1])
    finally:
        checksum.WRITE_ALGO = write_algo
        codec.block_codec.cache_clear()
        for tier in tiers.values():
            tier.close()
        if stop is not None:
            stop[0].send("stop")
            stop[1].join()
    copy = statistics.median(t_copy)
    print(f"context {context} tokens: {len(state.mla_blocks)} blocks + 1 KDA checkpoint, {nbytes / 1e6:.0f} MB; "
          f"memcpy {1e3 * copy:.1f} ms ({nbytes / copy / 1e9:.2f} GB/s); io_threads={io_threads}; "
          f"crc32c via {checksum.IMPLEMENTATION}; medians of {repeat} rounds")
    rows = []
    for n in names:
        put_x, load_x = statistics.median(ratios[n][0]), statistics.median(ratios[n][1])
        rows.append((n, put_x, load_x))
        print(f"  {n:<34} put {put_x:6.2f}x  (~{put_x * copy * 1e3:7.1f} ms)   "
              f"load {load_x:6.2f}x  (~{load_x * copy * 1e3:7.1f} ms)", flush=True)
    return rows


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
    ap.add_argument("--state", action="store_true", help="run the state-path figures only")
    ap.add_argument("--context", type=int, nargs="+", default=[32768], help="--state: context lengths")
    ap.add_argument("--io-threads", type=int, default=min(8, os.cpu_count() or 1), help="--state: I/O threads")
    ap.add_argument("--no-ipc", action="store_true", help="--state: skip the store-process rows")
    args = ap.parse_args()
    total = args.total_mib * MiB
    if args.state:
        print("state path (time as a multiple of one memcpy of the same bytes; lower is better)")
        for c in args.context:
            bench_state(c, args.io_threads, args.repeat, not args.no_ipc)
        return

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
