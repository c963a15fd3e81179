"""Harness timing error at high concurrency, against a zero-latency local test server.

The test server (a child process, so no shared interpreter lock) stamps each
request's arrival and every chunk write with ``perf_counter_ns`` (one
system-wide monotonic clock). The client stamps send, each chunk arrival and
the end. The harness's error per request is::

    TTFT error = client TTFT - server TTFT      (server: first write - arrival)
    ITL error  = client ITL  - server ITL       (server: (last - first write) / (n - 1))
    chunk lag  = client arrival - server write  (every chunk)

and the goal is under 1 ms at 256 concurrent streams. TTFT error includes the
loopback round trip and both event loops' queueing; chunk lag shows how far
behind the client falls while it parses 256 interleaved streams.

    python benchmarks/bench_client_overhead.py --streams 256 --rounds 4 --output-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np
from tqdm import tqdm

from disagg.bench.client import OpenAIClient, RequestResult
from disagg.bench.testserver import TestServerConfig, TestServerProcess


async def _lane(
    client: OpenAIClient,
    lane: int,
    rounds: int,
    prompt: np.ndarray,
    out_tokens: int,
    bar: tqdm,
    start_s: float,
) -> list[RequestResult]:
    await asyncio.sleep(start_s)  # lanes start spread out: measure steady state, not a burst
    results = []
    for k in range(rounds):
        body = client.build_body(prompt + lane, out_tokens)
        results.append(await client.send(body, f"l{lane}-r{k}"))
        bar.update(1)
    return results


async def _measure(
    url: str,
    streams: int,
    rounds: int,
    prompt_tokens: int,
    out_tokens: int,
    progress: bool = True,
    ramp_s: float = 1.0,
) -> tuple[list[RequestResult], dict, float]:
    prompt = np.arange(100, 100 + prompt_tokens, dtype=np.int64)
    async with OpenAIClient(url, model="m", max_connections=streams) as client:
        await client.complete(prompt, 2)  # warm the server and one connection
        await client.get_text("/debug/timings?clear=1")
        t0 = time.perf_counter()
        with tqdm(total=streams * rounds, unit="req", leave=False, disable=not progress) as bar:
            lanes = await asyncio.gather(
                *(
                    _lane(client, i, rounds, prompt, out_tokens, bar, i * ramp_s / streams)
                    for i in range(streams)
                )
            )
        wall = time.perf_counter() - t0
        timings = json.loads(await client.get_text("/debug/timings"))
    return [r for lane in lanes for r in lane], timings, wall


def _row(name: str, values: list[float]) -> str:
    v = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return f"{name:30} {v.mean():8.3f} {p50:8.3f} {p90:8.3f} {p99:8.3f} {v.max():8.3f}"


def report(results: list[RequestResult], timings: dict, wall: float, label: str) -> dict:
    ttft_err, path, first_lag, itl_err, lag = [], [], [], [], []
    failed = 0
    for r in results:
        t = timings.get(r.request_id)
        if not r.ok or t is None or len(t["write_ns"]) != len(r.chunk_ns):
            failed += 1
            continue
        writes = t["write_ns"]
        ttft_err.append(r.ttft_ms - (writes[0] - t["recv_ns"]) / 1e6)
        path.append((t["recv_ns"] - r.send_ns) / 1e6)
        first_lag.append((r.chunk_ns[0] - writes[0]) / 1e6)
        if r.itl_ms is not None and len(writes) > 1:
            itl_err.append(r.itl_ms - (writes[-1] - writes[0]) / 1e6 / (len(writes) - 1))
        lag.extend((c - w) / 1e6 for c, w in zip(r.chunk_ns, writes, strict=False))
    chunks = sum(len(r.chunk_ns) for r in results)
    print(
        f"\n== {label}: {len(results)} requests, {failed} failed/unmatched, "
        f"{chunks / wall:,.0f} chunks/s, {len(results) / wall:,.0f} req/s, wall {wall:.1f} s"
    )
    print(f"{'error (ms)':30} {'mean':>8} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8}")
    rows = (
        ("TTFT: client - server", ttft_err),
        ("  = send -> server handler", path),
        ("  + first write -> stamped", first_lag),
        ("ITL: client - server", itl_err),
        ("every chunk write -> stamped", lag),
    )
    for name, vals in rows:
        if vals:
            print(_row(name, vals))
    out = {name: float(np.median(vals)) for name, vals in rows if vals}
    ok = all(abs(out.get(k, 0.0)) < 1.0 for k in ("TTFT: client - server", "ITL: client - server"))
    print(f"goal |median error| < 1 ms for TTFT and ITL: {'met' if ok else 'NOT met'}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4, help="requests per stream")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--itl-ms", type=float, default=0.0, help="server ITL (0: zero latency)")
    parser.add_argument("--no-uvloop", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--ramp-s", type=float, default=1.0, help="spread of lane start times")
    args = parser.parse_args()
    config = TestServerConfig(
        ttft_ms=0.0, itl_ms=args.itl_ms, record_timings=True, cache_block_size=0
    )
    with TestServerProcess(config) as server:
        coro = _measure(
            server.url,
            args.streams,
            args.rounds,
            args.prompt_tokens,
            args.output_tokens,
            not args.no_progress,
            args.ramp_s,
        )
        if args.no_uvloop:
            out = asyncio.run(coro)
        else:
            try:
                import uvloop
            except ImportError:
                out = asyncio.run(coro)
            else:
                out = uvloop.run(coro)
    report(*out, label=f"{args.streams} streams, server TTFT 0 ms, ITL {args.itl_ms:g} ms")


if __name__ == "__main__":
    main()
