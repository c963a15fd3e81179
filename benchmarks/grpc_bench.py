"""Loopback throughput of the gRPC state transport against a plain memory copy.

For each object size, one StateServer (in-memory store) and one RemoteStore
on 127.0.0.1 move the object ``--reps`` times each way; the same run times a
plain copy of the same bytes into a preallocated buffer. The server runs in
a child process (as it would on another node) unless ``--same-process``, in
which case both ends share one interpreter (and its GIL). Reported: median
GB/s (1e9 bytes/s) of Fetch (server -> client), Push (client -> server) and
memcpy, and each transport rate as a fraction of memcpy.

    python -m benchmarks.grpc_bench --sizes-mib 1 16 64 --reps 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from kv_transfer.tiers.memory import DictByteStore
from kv_transfer.transport.grpc_transport import (
    RemoteStore,
    RemoteStoreConfig,
    StateServer,
    StateServerConfig,
)

MiB = 1 << 20


def _median_gbps(num_bytes: int, reps: int, fn: Callable[[], object]) -> float:
    fn()  # warm-up (connection, allocator)
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return num_bytes / statistics.median(seconds) / 1e9


def _measure(client: RemoteStore, size_mib: int, reps: int) -> dict[str, float]:
    num_bytes = size_mib * MiB
    data = np.random.default_rng(size_mib).bytes(num_bytes)
    dst = bytearray(num_bytes)

    def copy() -> None:
        memoryview(dst)[:] = data

    def push() -> None:
        assert client.put_bytes("bench:obj", data)

    def fetch() -> None:
        got = client.get_bytes("bench:obj")
        assert got is not None and len(got) == num_bytes

    memcpy = _median_gbps(num_bytes, reps, copy)
    push_gbps = _median_gbps(num_bytes, reps, push)
    fetch_gbps = _median_gbps(num_bytes, reps, fetch)
    assert client.get_bytes("bench:obj") == data, "round trip is not bit-exact"
    return {
        "size_mib": size_mib,
        "fetch": fetch_gbps,
        "push": push_gbps,
        "memcpy": memcpy,
        "fetch_ratio": fetch_gbps / memcpy,
        "push_ratio": push_gbps / memcpy,
    }


def _serve(config: StateServerConfig, port_queue, stop_event) -> None:
    server = StateServer(DictByteStore(), config)
    port_queue.put(server.start())
    stop_event.wait()
    server.stop(0)


@contextmanager
def _server(config: StateServerConfig, same_process: bool) -> Iterator[str]:
    """Yields the address of a running server (in this process or a child)."""
    if same_process:
        server = StateServer(DictByteStore(), config)
        server.start()
        try:
            yield server.address
        finally:
            server.stop(0)
        return
    ctx = mp.get_context("spawn")
    port_queue, stop_event = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_serve, args=(config, port_queue, stop_event), daemon=True)
    child.start()
    try:
        yield f"127.0.0.1:{port_queue.get(timeout=60)}"
    finally:
        stop_event.set()
        child.join(10)


def run(
    sizes_mib: list[int], reps: int, chunk_mib: int, same_process: bool = False
) -> list[dict[str, float]]:
    chunk_bytes = chunk_mib * MiB
    max_message = 2 * chunk_bytes + MiB
    server_config = StateServerConfig(
        token="bench", chunk_bytes=chunk_bytes, max_message_bytes=max_message
    )
    rows = []
    with _server(server_config, same_process) as address:
        client = RemoteStore(
            RemoteStoreConfig(
                address,
                token="bench",
                timeout_s=60.0,
                chunk_bytes=chunk_bytes,
                max_message_bytes=max_message,
            )
        )
        try:
            assert client.wait_ready(30), f"no server at {address}"
            for size_mib in sizes_mib:
                rows.append(_measure(client, size_mib, reps))
            stats = client.stats()
            assert stats["timeouts"] == stats["errors"] == stats["corrupt_frames"] == 0, stats
        finally:
            client.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--chunk-mib", type=int, default=2)
    parser.add_argument("--same-process", action="store_true", help="server in this process")
    args = parser.parse_args()
    rows = run(args.sizes_mib, args.reps, args.chunk_mib, args.same_process)
    where = "same process" if args.same_process else "server in a child process"
    print(
        f"gRPC loopback ({where}), chunk {args.chunk_mib} MiB, median of {args.reps} "
        "(GB/s = 1e9 B/s)"
    )
    header = f"{'size':>8} | {'fetch GB/s':>10} | {'push GB/s':>9} | {'memcpy GB/s':>11} | {'fetch/memcpy':>12} | {'push/memcpy':>11}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['size_mib']:>4} MiB | {r['fetch']:>10.3f} | {r['push']:>9.3f} | "
            f"{r['memcpy']:>11.2f} | {r['fetch_ratio']:>12.3f} | {r['push_ratio']:>11.3f}"
        )


if __name__ == "__main__":
    main()
