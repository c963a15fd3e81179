"""Harness timing error at high concurrency, against a zero-latency local test server.

The test server runs in its own process with ``record_timings``: for every
SSE chunk it logs when the handler wrote it and when its bytes left the
server's TCP stack (the kernel's software transmit stamp, ``SO_TIMESTAMPING``
keyed by byte offset; on loopback, when the client's kernel received them).
Client lanes run in one or more child processes, each sending back-to-back
streamed requests for ``--duration`` seconds after one warm-up request per
lane (which opens its keep-alive connection). All stamps are on one
system-wide monotonic clock. Truth, per request::

    chunk i sent   = transmit stamp of chunk i on the server (write time if none)
    request sent   = transmit stamp of the request on the client (raw transport)
    TTFT truth     = chunk 0 sent - request sent
    ITL truth      = (chunk n-1 sent - chunk 0 sent) / (n - 1)

and the harness's errors are ``client TTFT - TTFT truth`` and ``client ITL -
ITL truth``, reported as median and P90 of their absolute values. Also shown:

- rx lag: client chunk stamp - chunk sent (the receive side of the error);
- send: client send stamp -> request sent (the send side); aiohttp gives no
  access to a kernel stamp, so its TTFT error is the receive side alone (a
  lower bound, marked ``>=``);
- loop lag (raw): Python's read - kernel arrival of the read's newest byte,
  i.e. how late a client stamping with its own clock would be;
- held: handler write -> transmit (the server's TCP holding bytes back:
  congestion window, the client's delayed ACKs). Not a harness error;
- CPU of the client processes and the server (cores busy).

Configurations (all in one run, the first is the baseline for the ratios):
``--transports aiohttp,raw``, ``--processes 1,2`` (lanes split over client
processes), ``--loops uvloop,asyncio``; ``--itl-ms`` sets the server pacing;
``--repeat N`` runs every configuration N times in alternating order (the
host's load drifts) and pools them.

    python benchmarks/bench_client_overhead.py --streams 256 --duration 4
    python benchmarks/bench_client_overhead.py --parse   # parsing cost, bulk vs per event
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import time
import urllib.request
from dataclasses import dataclass

import numpy as np

from disagg.tools.bench.client import OpenAIClient, RequestResult
from disagg.tools.bench.testserver import TestServerConfig, TestServerProcess


@dataclass(slots=True)
class ClientJob:
    url: str
    transport: str  # raw | aiohttp
    loop: str  # uvloop | asyncio
    proc: int  # index of this client process
    lanes: int  # lanes in this process
    duration_s: float
    start_at_s: float  # time.time() at which all processes start measuring
    prompt_tokens: int
    output_tokens: int


@dataclass(slots=True)
class ClientOutput:
    results: list[RequestResult]
    read_lags_ns: list[int]  # raw: python read - kernel arrival, every read
    cpu_s: float  # this process's CPU during the measurement
    wall_s: float


async def _client(job: ClientJob) -> ClientOutput:
    prompt = np.arange(100, 100 + job.prompt_tokens, dtype=np.int64)
    raw = job.transport == "raw"
    async with OpenAIClient(
        job.url, model="m", max_connections=job.lanes, transport=job.transport, send_stamps=raw
    ) as client:
        bodies = [
            client.build_body(prompt + 7 * job.proc + lane, job.output_tokens)
            for lane in range(job.lanes)
        ]
        # Warm-up: every lane opens its connection (not measured).
        await asyncio.gather(
            *(client.send(bodies[i], f"w{job.proc}-{i}") for i in range(job.lanes))
        )
        await asyncio.sleep(max(0.0, job.start_at_s - time.time()))
        if client.pool is not None:
            client.pool.read_lags_ns = []
        cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        deadline = t0 + job.duration_s
        results: list[RequestResult] = []

        async def lane(i: int) -> None:
            k = 0
            while time.perf_counter() < deadline:
                results.append(await client.send(bodies[i], f"p{job.proc}-l{i}-r{k}"))
                k += 1

        await asyncio.gather(*(lane(i) for i in range(job.lanes)))
        cpu1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
        lags = list(client.pool.read_lags_ns or []) if client.pool is not None else []
    cpu = cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    return ClientOutput(results, lags, cpu, wall)


def run_client(job: ClientJob) -> ClientOutput:
    """Entry point of one client process."""
    if job.loop == "uvloop":
        import uvloop

        return uvloop.run(_client(job))
    return asyncio.run(_client(job))


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=120) as resp:
        return json.loads(resp.read())


def _q(values: list[float], qs: tuple[float, ...] = (50, 90)) -> list[float]:
    return (
        [float(v) for v in np.percentile(np.asarray(values, dtype=float), qs)]
        if values
        else [float("nan")] * len(qs)
    )


def measure(
    server: TestServerProcess, transport: str, loop: str, processes: int, args: argparse.Namespace
) -> dict:
    lanes = [args.streams // processes + (i < args.streams % processes) for i in range(processes)]
    start_at = time.time() + 1.5 + 0.5 * processes  # after every process has warmed up
    jobs = [
        ClientJob(
            server.url,
            transport,
            loop,
            i,
            n,
            args.duration,
            start_at,
            args.prompt_tokens,
            args.output_tokens,
        )
        for i, n in enumerate(lanes)
    ]
    _get_json(server.url + "/debug/timings?clear=1")
    with mp.get_context("spawn").Pool(processes) as pool:
        pending = pool.map_async(run_client, jobs)
        while time.time() < start_at:
            time.sleep(0.01)
        s_cpu0 = _proc_cpu_s(server.pid)
        outs: list[ClientOutput] = pending.get(timeout=args.duration + 120)
        s_cpu = _proc_cpu_s(server.pid) - s_cpu0
    timings = _get_json(server.url + "/debug/timings?clear=1")
    wall = max(o.wall_s for o in outs)
    ttft_true, ttft_err, itl_err, rx_lag, send_err, held = [], [], [], [], [], []
    failed = chunks = no_tx = 0
    for out in outs:
        for r in out.results:
            t = timings.get(r.request_id)
            if (
                not r.ok
                or t is None
                or len(t["write_ns"]) != len(r.chunk_ns)
                or len(r.chunk_ns) < 2
            ):
                failed += 1
                continue
            writes = t["tx_ns"] or t["write_ns"]  # truth: when each chunk left the server
            if t["tx_ns"]:
                held.extend((x - w) / 1e6 for x, w in zip(t["tx_ns"], t["write_ns"], strict=True))
            else:
                no_tx += 1
            chunks += len(writes)
            rx_first = (r.chunk_ns[0] - writes[0]) / 1e6
            if r.send_kernel_ns is not None:  # truth: the kernel's transmit stamp
                send_err.append((r.send_kernel_ns - r.send_ns) / 1e6)
                ttft_true.append((writes[0] - r.send_kernel_ns) / 1e6)
                ttft_err.append(r.ttft_ms - ttft_true[-1])
            else:  # no send truth: the receive side alone, a lower bound of the error
                ttft_err.append(rx_first)
            itl_err.append(r.itl_ms - (writes[-1] - writes[0]) / 1e6 / (len(writes) - 1))
            rx_lag.extend((c - w) / 1e6 for c, w in zip(r.chunk_ns, writes, strict=True))
    return {
        "requests": sum(len(o.results) for o in outs),
        "failed": failed,
        "without_tx_stamps": no_tx,
        "chunks": chunks,
        "wall_s": wall,
        "client_cpu_s": sum(o.cpu_s for o in outs),
        "server_cpu_s": s_cpu,
        "ttft_true": ttft_true,
        "ttft_err": ttft_err,
        "itl_err": itl_err,
        "rx_lag": rx_lag,
        "send_err": send_err,
        "loop_lag": [v / 1e6 for o in outs for v in o.read_lags_ns],
        "held": held,
    }


def summarize(label: str, samples: list[dict]) -> dict:
    """One row from every repeat of a configuration (their measurements pooled)."""

    def pooled(key: str) -> list[float]:
        return [v for sample in samples for v in sample[key]]

    def total(key: str) -> float:
        return sum(sample[key] for sample in samples)

    wall = total("wall_s")
    return {
        "label": label,
        "requests": int(total("requests")),
        "failed": int(total("failed")),
        "without_tx_stamps": int(total("without_tx_stamps")),
        "chunks_per_s": total("chunks") / wall,
        "client_cpu": total("client_cpu_s") / wall,
        "server_cpu": total("server_cpu_s") / wall,
        "ttft_true_p50": _q(pooled("ttft_true"), (50,))[0],
        "ttft_abs": _q([abs(v) for v in pooled("ttft_err")]),
        "ttft_abs_p50_per_repeat": [_q([abs(v) for v in s["ttft_err"]], (50,))[0] for s in samples],
        "ttft_bound": not pooled("send_err"),  # True: receive side only (lower bound)
        "itl_abs": _q([abs(v) for v in pooled("itl_err")]),
        "rx_lag": _q(pooled("rx_lag")),
        "send": _q(pooled("send_err")),
        "loop_lag": _q(pooled("loop_lag")),
        "held": _q(pooled("held"), (50, 90, 99)),
    }


def _print(rows: list[dict]) -> None:
    print(
        f"{'config':26} {'req':>6} {'fail':>4} {'chunks/s':>8} {'cpu c/s':>9} {'TTFT':>8} "
        f"{'|TTFT err| p50/p90':>19} {'|ITL err| p50/p90':>17} {'rx lag p50/p90':>15} "
        f"{'send p50/p90':>13} {'loop lag p50/p90':>16} {'held p50/p99':>13}"
    )

    def pair(v: list[float], digits: int = 2) -> str:
        return "n/a" if np.isnan(v[0]) else f"{v[0]:.{digits}f}/{v[1]:.{digits}f}"

    for r in rows:
        ttft = (">=" if r["ttft_bound"] else "") + pair(r["ttft_abs"], 3)
        print(
            f"{r['label']:26} {r['requests']:6d} {r['failed']:4d} {r['chunks_per_s']:8,.0f} "
            f"{r['client_cpu']:4.2f}/{r['server_cpu']:.2f} {r['ttft_true_p50']:8.1f} {ttft:>19} "
            f"{pair(r['itl_abs'], 4):>17} {pair(r['rx_lag']):>15} {pair(r['send'], 3):>13} "
            f"{pair(r['loop_lag']):>16} {pair(r['held'][::2]):>13}"
        )
        if len(r["ttft_abs_p50_per_repeat"]) > 1:
            per = ", ".join(f"{v:.3f}" for v in r["ttft_abs_p50_per_repeat"])
            print(f"  |TTFT err| p50 of each repeat: {per}")
        if r["without_tx_stamps"]:
            print(
                f"  ({r['without_tx_stamps']} requests without transmit stamps: truth = write time)"
            )
    base = rows[0]
    print(f"\nratios against the baseline {base['label']} (p50 |error|, lower is better):")
    for r in rows[1:]:
        ratios = [
            r[k][0] / base[k][0] if base[k][0] > 0 else float("nan")
            for k in ("ttft_abs", "itl_abs")
        ]
        print(f"  {r['label']:26} TTFT x{ratios[0]:.3f}  ITL x{ratios[1]:.3f}")
    print(
        "ms. TTFT: true TTFT p50 (request's transmit stamp -> first token's transmit stamp;\n"
        "n/a without send stamps). >=: receive side only (first-token stamp - its transmit\n"
        "stamp), a lower bound. held: server write -> transmit (the server's TCP holding\n"
        "data). cpu c/s: cores busy in the client processes / the server."
    )


def parse_cost(rounds: int = 10, responses: int = 300) -> None:
    """CPU time to parse one 64-token response arriving in one read: bulk fast paths vs per event.

    The baseline is the same parser with its two bulk paths (whole-chunk
    decoding, counting plain token events) switched off, so every chunk and
    event goes through the per-item loop; rounds alternate between the two.
    """
    import socket

    from disagg.tools.bench import rawhttp, sse
    from disagg.tools.bench.client import _RawExchange

    head = b'{"id":"r","object":"text_completion","model":"test"'
    token = b"data: " + head + b',"choices":[{"index":0,"text":" x","finish_reason":null}]}\n\n'
    last = token.replace(b"null", b'"length"')
    usage = (
        b"data: "
        + head
        + b',"choices":[],"usage":{"prompt_tokens":2048,"completion_tokens":64}}\n\n'
    )
    events = [token] * 63 + [last, usage, b"data: [DONE]\n\n"]
    response = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
        + b"0\r\n\r\n"
    )
    bulk = (sse.all_plain_tokens, rawhttp._whole_chunks)
    per_item = (lambda events: 0, lambda data: None)

    async def run(paths: tuple) -> float:
        sse.all_plain_tokens, rawhttp._whole_chunks = paths
        a, b = socket.socketpair()
        pool = rawhttp.RawHTTPPool("127.0.0.1", 1)
        conn = rawhttp._Connection(pool, a)
        t0 = time.process_time()
        for _ in range(responses):
            result = RequestResult("r", 0)
            exchange = _RawExchange(result, chat=False)
            conn.begin(exchange, asyncio.get_running_loop().create_future())
            conn._feed(response, 1)
            exchange.stream.close()
            assert result.output_tokens == 64 and len(result.chunk_ns) == 64
        cost = (time.process_time() - t0) / responses
        conn.close()
        b.close()
        return cost

    costs: dict[str, list[float]] = {"per event": [], "bulk": []}
    try:
        for _ in range(rounds):
            costs["per event"].append(asyncio.run(run(per_item)))
            costs["bulk"].append(asyncio.run(run(bulk)))
    finally:
        sse.all_plain_tokens, rawhttp._whole_chunks = bulk
    base, new = (float(np.median(v)) * 1e6 for v in costs.values())
    print(
        f"parse one 64-token response (one read), CPU us: per event (baseline) {base:.0f}, "
        f"bulk {new:.0f}; x{base / new:.2f} faster"
    )


def _speed_probe_ms() -> float:
    """Milliseconds for a 1M-step Python loop: how much CPU this host gives a process now."""
    t0, x = time.perf_counter(), 0
    for i in range(1_000_000):
        x += i
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=256, help="concurrent lanes")
    parser.add_argument("--duration", type=float, default=4.0, help="measured seconds per config")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--itl-ms", type=float, default=0.0, help="server ITL (0: zero latency)")
    parser.add_argument("--transports", default="aiohttp,raw")
    parser.add_argument("--processes", default="1", help="client process counts, e.g. 1,2")
    parser.add_argument("--loops", default="uvloop", help="uvloop and/or asyncio")
    parser.add_argument("--repeat", type=int, default=1, help="runs per config, order alternating")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--parse", action="store_true", help="only the parsing cost comparison")
    args = parser.parse_args()
    if args.parse:
        parse_cost()
        return
    if args.streams < 1 or args.duration <= 0 or args.repeat < 1:
        parser.error("--streams and --repeat must be >= 1 and --duration > 0")
    config = TestServerConfig(
        ttft_ms=0.0, itl_ms=args.itl_ms, record_timings=True, cache_block_size=0
    )
    configs = [
        (transport, loop, int(procs))
        for transport in args.transports.split(",")
        for loop in args.loops.split(",")
        for procs in args.processes.split(",")
    ]
    samples: dict[tuple, list[dict]] = {c: [] for c in configs}
    probe = _speed_probe_ms()
    with TestServerProcess(config) as server:
        for rep in range(args.repeat):  # alternate the order: load drifts during a run
            for c in configs if rep % 2 == 0 else configs[::-1]:
                samples[c].append(measure(server, *c, args))
                print(f"  done {c} repeat {rep + 1}", flush=True)
    rows = [
        summarize(f"{t}/{loop}/x{procs}/itl{args.itl_ms:g}", samples[(t, loop, procs)])
        for t, loop, procs in configs
    ]
    print(
        f"\n{args.streams} streams, server TTFT 0 ms, ITL {args.itl_ms:g} ms, "
        f"{args.output_tokens} tokens/request, {args.repeat} x {args.duration:g} s per config, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs, "
        f"1M-step Python loop {probe:.0f} ms before / {_speed_probe_ms():.0f} ms after"
    )
    _print(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
