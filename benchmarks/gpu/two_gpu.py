"""Two-GPU disaggregation on one host: prefill on GPU 0, decode on GPU 1, separate processes.

    python benchmarks/gpu/two_gpu.py --out OUT [--part transfer|e2e|all]

transfer  One prefill process (cuda:0) and one decode process (cuda:1), the
          ``small`` preset. For each context (8K, 32K, 128K tokens) the prefill
          computes a request and hands its state over, repeated ``--reps`` times:
            device   export into buffers on GPU 0, CUDA IPC descriptor to the decode
                     process, one peer copy per buffer onto GPU 1, fingerprints checked
            host     export to pinned host memory, put into the node's shared host
                     tier (checksummed), load from it in the decode process, copy to GPU 1
          against a raw peer copy of the same bytes (GPU 0 -> GPU 1, one buffer,
          in the decode process): the hand-off as a fraction of that ceiling.
e2e       An agentic trace replayed over HTTP (client in this process; front and
          engines in their own processes), three layouts, three concurrencies:
            1p1d_device   prefill GPU 0 + decode GPU 1, device-to-device hand-off
            1p1d_host     prefill GPU 0 + decode GPU 1, hand-off through the host tier
            2x_aggregated one engine per GPU, sessions sticky to one of them
          all with a node host tier for turn-end checkpoints; and, for one GPU,
            1x_aggregated_nohost  one engine, device-resident sessions only
            1x_aggregated_host    the fair aggregated baseline: one engine with the same
                                  host tier, its step budget ``--agg-chunk`` tuned for ITL
          A layout suffixed ``:before`` runs with ``engine.learned_checkpoints``
          off (the engine's own checkpoints only), for a before/after in one run.
          Each layout's rows carry the miss-reason table read from its /metrics
          (``disagg.reuse.misses``; realized / theoretical in prompt tokens).
          Prints TTFT, ITL, P90 interactivity and total tokens/s/GPU (GPUs =
          distinct ``--devices``; ``--devices cuda:0,cuda:0`` puts both engines
          on one GPU).

Writes ``transfer.json``, ``e2e.json`` and the trace under ``--out``. NVLink
multicast is never used (plain peer copies and IPC only).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BLOCK = 64
T0 = time.monotonic()


def _cfg(args, device: str = "cuda:0", chunk: int | None = None, learned: bool = True):
    from disagg.config import AppConfig

    return AppConfig.model_validate({
        "model": {"name": args.preset, "dtype": args.dtype, "device": device, "seed": 0},
        "engine": {"backend": "reference", "block_size": BLOCK, "max_num_seqs": 64,
                   "max_num_batched_tokens": chunk or args.chunk, "cache_budget_mb": args.cache_mb,
                   "learned_checkpoints": learned},
        "transfer": {"host": {"capacity_mb": args.host_mb, "policy": "s3fifo", "pin_memory": True},
                     "load_deadline_s": 30.0},
        "router": {"local_prefill_max_tokens": 256},
        "deployment": {"mode": "disaggregated"},
    })


# -- transfer -----------------------------------------------------------------------------------
def _sync():
    import torch

    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)


def _producer(args, host_socket, conn) -> None:
    import torch

    from disagg.engine.factory import build_reference_engine
    from disagg.engine.protocol import EngineRequest, SamplingParams
    from kv_transfer.keys import BlockHasher, KeyExtras
    from kv_transfer.store import StateStore
    from kv_transfer.tiers.host_ipc import HostTierClient
    from kv_transfer.transport.device_ipc import DeviceShares

    if args.devices[0].startswith("cuda"):
        torch.cuda.set_device(torch.device(args.devices[0]))
    engine = build_reference_engine(_cfg(args, args.devices[0]))
    store = StateStore([HostTierClient(host_socket)], engine.layout, write_behind=False, io_threads=args.io_threads)
    hasher = BlockHasher(engine.block_size, KeyExtras(engine.model_id))
    variants = {"device": DeviceShares(pool_bytes=args.pool_mb << 20), "device_nopool": DeviceShares()}
    for ctx in args.contexts:
        tokens = [3 + (i * 7919) % 250 for i in range(ctx)]
        rid = f"ctx{ctx}"
        engine.add_request(EngineRequest(rid, tokens, SamplingParams(max_tokens=1), keep_state=True))
        while engine.has_work():
            engine.step()
        for rep in range(args.reps):
            for name, shares in variants.items():
                _sync()
                t0 = time.perf_counter()
                desc = shares.share(engine.export_state(rid, ctx, 0, on_device=True))
                t_dev = time.perf_counter() - t0
                conn.send(("device", ctx, rep, desc, t_dev, name))
                assert shares.release(conn.recv())
            salted = hasher.with_salt(f"r{rep}")  # fresh keys every rep: nothing is deduplicated
            _sync()
            t0 = time.perf_counter()
            state = engine.export_state(rid, ctx, 0)
            result = store.put_state(tokens, state, salted)
            t_host = time.perf_counter() - t0
            conn.send(("host", ctx, rep, (tokens, engine.model_id, f"r{rep}"), t_host, result.bytes_stored))
            conn.recv()
        engine.release(rid, keep_resident=False)
    conn.send(("done",))


def _consumer(args, host_socket, conn, out_q) -> None:
    import torch

    from kv_transfer.keys import BlockHasher, KeyExtras
    from kv_transfer.store import StateStore
    from kv_transfer.tiers.host_ipc import HostTierClient
    from kv_transfer.transport.device_ipc import open_shared

    dst, src_dev = torch.device(args.devices[1]), torch.device(args.devices[0])
    peer = None
    if dst.type == "cuda":
        torch.cuda.set_device(dst)
        peer = torch.cuda.can_device_access_peer(dst, src_dev)
    layout = None
    rows = []
    while True:
        msg = conn.recv()
        if msg[0] == "done":
            break
        if msg[0] == "device":
            _, ctx, rep, desc, t_export, name = msg
            layout = desc.layout
            _sync()
            t0 = time.perf_counter()
            state = open_shared(desc, dst)
            _sync()
            t_copy = time.perf_counter() - t0
            nbytes = desc.nbytes
            del state
            conn.send(desc.share_id)
            # the ceiling: one raw peer copy of the same bytes, GPU 0 -> GPU 1, in this process
            src = torch.empty(nbytes, dtype=torch.uint8, device=src_dev)
            out = torch.empty(nbytes, dtype=torch.uint8, device=dst)
            out.copy_(src)
            _sync()
            t0 = time.perf_counter()
            out.copy_(src, non_blocking=True)
            _sync()
            t_raw = time.perf_counter() - t0
            del src, out
            rows.append({"context": ctx, "rep": rep, "path": name, "bytes": nbytes, "export_s": t_export,
                         "copy_s": t_copy, "raw_peer_s": t_raw, "peer_access": peer})
        else:
            _, ctx, rep, (tokens, model_id, salt), t_put, stored = msg
            store = StateStore([HostTierClient(host_socket)], layout, write_behind=False, io_threads=args.io_threads)
            hasher = BlockHasher(layout.block_size, KeyExtras(model_id, cache_salt=salt))
            _sync()
            t0 = time.perf_counter()
            state = store.load_state(tokens, len(tokens), hasher, layout, contiguous=True)
            assert state is not None, "host-tier load missed"
            on_dev = state.mla_rows.to(dst, non_blocking=True)
            kda = [(k.conv.to(dst, non_blocking=True), k.recurrent.to(dst, non_blocking=True)) for k in state.kda]
            _sync()
            t_load = time.perf_counter() - t0
            nbytes = state.mla_rows.nbytes + sum(k.conv.nbytes + k.recurrent.nbytes for k in state.kda)
            del on_dev, kda, state
            conn.send("ok")
            rows.append({"context": ctx, "rep": rep, "path": "host", "bytes": nbytes, "put_s": t_put,
                         "load_s": t_load, "stored_bytes": stored})
    out_q.put(rows)


def run_transfer(args, out: Path) -> dict:
    import torch

    from kv_transfer.tiers.host import HostTier
    from kv_transfer.tiers.host_ipc import HostTierServer

    if any(d.startswith("cuda") for d in args.devices) and torch.cuda.device_count() < 2:
        raise SystemExit("the transfer part needs two GPUs")
    host = HostTier(args.host_mb << 20, eviction="lru")
    server = HostTierServer(host)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    q = ctx.Queue()
    prod = ctx.Process(target=_producer, args=(args, server.socket_path, a))
    cons = ctx.Process(target=_consumer, args=(args, server.socket_path, b, q))
    prod.start()
    cons.start()
    rows = q.get(timeout=args.transfer_timeout_s)
    prod.join(60)
    cons.join(60)
    server.close()
    host.close()
    summary = []
    print("| context | state MB | device hand-off ms | GB/s | raw peer copy GB/s | hand-off / raw | "
          "host-staged put + load ms | GB/s | host / device time | unpooled hand-off ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in args.contexts:
        dev = [r for r in rows if r["context"] == c and r["path"] == "device"][1:] or \
              [r for r in rows if r["context"] == c and r["path"] == "device"]  # first rep warms up
        nopool = [r for r in rows if r["context"] == c and r["path"] == "device_nopool"][1:]
        hst = [r for r in rows if r["context"] == c and r["path"] == "host"][1:] or \
              [r for r in rows if r["context"] == c and r["path"] == "host"]
        nb = dev[0]["bytes"]
        t_dev = statistics.median(r["export_s"] + r["copy_s"] for r in dev)
        t_copy = statistics.median(r["copy_s"] for r in dev)
        t_raw = statistics.median(r["raw_peer_s"] for r in dev)
        t_host = statistics.median(r["put_s"] + r["load_s"] for r in hst)
        s = {"context": c, "bytes": nb, "device_export_ms": 1e3 * statistics.median(r["export_s"] for r in dev),
             "device_copy_ms": 1e3 * t_copy, "device_total_ms": 1e3 * t_dev, "device_copy_gbps": nb / t_copy / 1e9,
             "raw_peer_gbps": nb / t_raw / 1e9, "copy_vs_raw": t_raw / t_copy,
             "host_put_ms": 1e3 * statistics.median(r["put_s"] for r in hst),
             "host_load_ms": 1e3 * statistics.median(r["load_s"] for r in hst), "host_total_ms": 1e3 * t_host,
             "host_gbps": nb / t_host / 1e9, "host_over_device": t_host / t_dev, "peer_access": dev[0]["peer_access"],
             "nopool_total_ms": 1e3 * statistics.median(r["export_s"] + r["copy_s"] for r in nopool) if nopool else None}
        summary.append(s)
        print(f"| {c:,} | {nb / 1e6:,.0f} | {s['device_total_ms']:.1f} (export {s['device_export_ms']:.1f} + "
              f"copy {t_copy * 1e3:.1f}) | {s['device_copy_gbps']:.1f} | {s['raw_peer_gbps']:.1f} | "
              f"{s['copy_vs_raw']:.2f} | {t_host * 1e3:.0f} ({s['host_put_ms']:.0f} + {s['host_load_ms']:.0f}) | "
              f"{s['host_gbps']:.1f} | {s['host_over_device']:.1f}x | "
              f"{'n/a' if s['nopool_total_ms'] is None else format(s['nopool_total_ms'], '.1f')} |", flush=True)
    doc = {"rows": rows, "summary": summary}
    (out / "transfer.json").write_text(json.dumps(doc, indent=2))
    return doc


# -- end to end ---------------------------------------------------------------------------------
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _front(args, layout: str, port: int, ready) -> None:
    """The HTTP front (its own process): uvicorn over a ProcessBackend of two engine processes."""
    import uvicorn

    from disagg.api.app import create_app
    from disagg.launch.multiproc import ProcessBackend

    layout, _, variant = layout.partition(":")
    cfg = _cfg(args, chunk=args.agg_chunk if layout == "1x_aggregated_host" else None, learned=variant != "before")
    kind, handoff = {"1p1d_device": ("1p1d", "device"), "1p1d_host": ("1p1d", "host"),
                     "2x_aggregated": ("aggregated", "device"),
                     "1x_aggregated_nohost": ("aggregated", "device"),
                     "1x_aggregated_host": ("aggregated", "device")}[layout]
    devices = args.devices[:1] if layout.startswith("1x") else list(args.devices)
    backend = ProcessBackend(cfg, devices, layout=kind, handoff=handoff, pool_mb=args.pool_mb,
                             host_tier=not layout.endswith("nohost"))
    server = uvicorn.Server(uvicorn.Config(create_app(backend, cfg.http), host="127.0.0.1", port=port,
                                           log_level="warning"))
    ready.send("ok")
    try:
        server.run()
    finally:
        backend.shutdown()


def run_e2e(args, out: Path) -> list[dict]:
    import httpx

    from disagg.engine.factory import engine_limits
    from disagg.tools.bench.sweep import BenchParams, run_bench_sync
    from disagg.tools.bench.synth import synthesize
    from disagg.tools.bench.trace import save_trace

    records = synthesize(args.sessions, 0, block_size=BLOCK, scale=args.scale, turn_scale=0.25,
                         max_input=args.max_input, subagents=False)
    trace = out / "trace.jsonl"
    save_trace(records, trace)
    conc = [int(c) for c in args.concurrency.split(",")]
    cfg = _cfg(args)
    rows = []
    ctx = mp.get_context("spawn")
    for k, layout in enumerate(args.layouts.split(",")):
        if time.monotonic() - T0 > args.deadline_s:
            print(f"=== {layout}: skipped (past --deadline-s {args.deadline_s:.0f})", flush=True)
            continue
        port = _port()
        r, w = ctx.Pipe(duplex=False)
        t0 = time.monotonic()
        front = ctx.Process(target=_front, args=(args, layout, port, w))
        front.start()
        if not r.poll(600) or r.recv() != "ok":
            raise RuntimeError(f"{layout}: front did not start")
        url = f"http://127.0.0.1:{port}"
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        warm = {"model": cfg.model.openai_name, "prompt": [3 + i % 250 for i in range(2048)], "max_tokens": 4,
                "ignore_eos": True}
        httpx.post(url + "/v1/completions", json=warm, timeout=600).raise_for_status()
        print(f"=== {layout}: up in {time.monotonic() - t0:.0f} s", flush=True)
        try:
            params = BenchParams(url=url, trace=str(trace), out=str(out / layout.replace(":", "-")), concurrency=conc,
                                 max_requests=args.requests, warmup_requests=4, think_cap_ms=2000,
                                 sample_start_turn=True, salt=1 + 100 * k, num_gpus=len(set(args.devices)),
                                 vocab_size=engine_limits(cfg).vocab_size, first_token_id=3,
                                 default_block_size=BLOCK, progress=False, quiet=True)
            doc = run_bench_sync(params, records)
            for e in doc["runs"]:
                s = e["summary"]
                row = {"layout": layout, "run": e["label"], "requests": s["num_requests"], "failed": s["num_failed"],
                       "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p90_ms": s["ttft_ms"]["p90"],
                       "itl_p50_ms": s["itl_ms"]["p50"], "itl_p90_ms": s["itl_ms"]["p90"],
                       "p90_interactivity": s["p90_interactivity"], "total_tps_per_gpu": s["total_tps_per_gpu"],
                       "cache_hit_usage": s["cache_hit_usage"], "cache_hit_theoretical": s["cache_hit_theoretical"],
                       "reuse": s.get("reuse") or {}}
                rows.append(row)
                print(json.dumps(row), flush=True)
            try:
                row_stats = httpx.get(url + "/metrics", timeout=10).text
                (out / f"{layout.replace(':', '-')}_metrics.txt").write_text(row_stats)
            except httpx.HTTPError:
                pass
        finally:
            front.terminate()
            front.join(60)
        (out / "e2e.json").write_text(json.dumps(rows, indent=2))
    f = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    print("| layout | run | req (failed) | TTFT P50 ms | TTFT P90 ms | ITL P50 / P90 ms | P90 tok/s/user | "
          "tok/s/GPU | hit (usage / theoretical) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['run']} | {r['requests']} ({r['failed']}) | {f(r['ttft_p50_ms'], '.0f')} | "
              f"{f(r['ttft_p90_ms'], '.0f')} | {f(r['itl_p50_ms'], '.1f')} / {f(r['itl_p90_ms'], '.1f')} | "
              f"{f(r['p90_interactivity'], '.1f')} | {f(r['total_tps_per_gpu'], ',.0f')} | "
              f"{f(r['cache_hit_usage'], '.1%')} / {f(r['cache_hit_theoretical'], '.1%')} |")
    _print_misses(rows)
    return rows


def _print_misses(rows: list[dict]) -> None:
    """Realized / theoretical and the missed tokens by reason, per layout and point (% of prompt tokens)."""
    reasons = sorted({k for r in rows for k in (r.get("reuse") or {}).get("misses", {})})
    if not reasons:
        return
    print("| layout | run | realized / theoretical | " + " | ".join(reasons) + " |")
    print("|---|---|---|" + "---|" * len(reasons))
    for r in rows:
        u = r.get("reuse") or {}
        if not u:
            continue
        prompt = max(u["prompt_tokens"], 1)
        ratio = u["realized_tokens"] / u["theoretical_tokens"] if u["theoretical_tokens"] else float("nan")
        cells = " | ".join(f"{100 * u['misses'].get(k, 0) / prompt:.1f}%" for k in reasons)
        print(f"| {r['layout']} | {r['run']} | {ratio:.3f} | {cells} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--part", choices=("transfer", "e2e", "all"), default="all")
    ap.add_argument("--devices", default="cuda:0,cuda:1", help="prefill's device, decode's device ('cpu,cpu': a "
                    "smoke run of the script itself)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunk", type=int, default=8192, help="max tokens per engine step")
    ap.add_argument("--agg-chunk", type=int, default=2048, help="1x_aggregated_host: its step budget (ITL)")
    ap.add_argument("--cache-mb", type=int, default=40000, help="engine cache budget per engine")
    ap.add_argument("--host-mb", type=int, default=24000, help="node host tier capacity")
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--pool-mb", type=int, default=2048, help="device hand-off staging pool (0: per-buffer IPC)")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--transfer-timeout-s", type=float, default=400)
    ap.add_argument("--layouts", default="1p1d_device,1p1d_host,2x_aggregated")
    ap.add_argument("--concurrency", default="2,8,16")
    ap.add_argument("--requests", type=int, default=24, help="measured requests per concurrency point")
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--scale", type=float, default=0.1, help="trace token scale (1.0 = published lengths)")
    ap.add_argument("--max-input", type=int, default=24000)
    ap.add_argument("--deadline-s", type=float, default=1e9, help="start no new layout after this many seconds")
    args = ap.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",") if c]
    args.devices = args.devices.split(",")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast, ever
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part in ("transfer", "all"):
        try:
            run_transfer(args, out)
        except Exception:  # still run the e2e part, which does not depend on it
            import traceback

            traceback.print_exc()
    if args.part in ("e2e", "all"):
        run_e2e(args, out)


if __name__ == "__main__":
    main()
