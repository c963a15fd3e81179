"""Agentic trace replay on one GPU, no Ray: prefill and decode engines in one process.

    python benchmarks/gpu/e2e_inprocess.py --out OUT [--concurrency 4,16,48] [--requests 64]

Serves the OpenAI API (uvicorn, this process) over ``InProcessBackend`` with
the ``small`` preset on CUDA, twice, one after the other in the same run:

    disaggregated + host tier   a prefill engine and a decode engine sharing the
                                GPU and the model weights; state hands off and
                                persists across turns through a pinned host tier
    aggregated, no host tier    one engine that prefills and decodes; only its
                                device-resident sessions carry state across turns

and replays one synthetic agentic trace against each with the ``disagg bench``
harness (closed loop, a request-bounded point per concurrency). Prints P90
interactivity and total tokens/s/GPU per point; tok/s/GPU counts the one GPU
both stacks run on. Ray's wheel is not needed (it is too large to bring).
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from disagg.api.app import create_app
from disagg.config import AppConfig
from disagg.engine.factory import engine_limits
from disagg.launch.inprocess import InProcessBackend
from disagg.tools.bench.sweep import BenchParams, run_bench_sync
from disagg.tools.bench.synth import synthesize
from disagg.tools.bench.trace import save_trace

STACKS = ("disaggregated_host_tier", "aggregated_no_host_tier")


def app_config(mode: str, port: int, args) -> AppConfig:
    cuda = args.device.startswith("cuda")
    return AppConfig.model_validate({
        "model": {"name": args.preset, "dtype": args.dtype, "device": args.device, "seed": 0},
        "engine": {"backend": "reference", "block_size": 64, "max_num_seqs": 64, "max_num_batched_tokens": 8192,
                   "cache_budget_mb": args.cache_mb},
        "transfer": {"host": {"capacity_mb": args.host_mb, "policy": "s3fifo", "pin_memory": cuda}},
        "router": {"local_prefill_max_tokens": 256},
        "deployment": {"mode": mode},
        "http": {"host": "127.0.0.1", "port": port},
    })


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn in a thread over one backend."""

    def __init__(self, backend: InProcessBackend, cfg: AppConfig):
        self.backend = backend
        config = uvicorn.Config(create_app(backend, cfg.http), host="127.0.0.1", port=cfg.http.port,
                                log_level="warning", loop="asyncio")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{cfg.http.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server did not come up")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.backend.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--concurrency", default="4,16,48")
    ap.add_argument("--requests", type=int, default=64, help="measured requests per concurrency point")
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--scale", type=float, default=0.1, help="trace token scale (1.0 = published lengths)")
    ap.add_argument("--max-input", type=int, default=24000)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cache-mb", type=int, default=24000, help="engine cache budget per engine")
    ap.add_argument("--host-mb", type=int, default=16000, help="host tier capacity")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = synthesize(args.sessions, 0, block_size=64, scale=args.scale, turn_scale=0.25,
                         max_input=args.max_input, subagents=False)
    trace = out / "trace.jsonl"
    save_trace(records, trace)
    conc = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for k, stack in enumerate(STACKS):
        cfg = app_config("disaggregated" if stack.startswith("disagg") else "aggregated", _port(), args)
        t0 = time.monotonic()
        backend = InProcessBackend(cfg, host_tier=stack == "disaggregated_host_tier")
        with Server(backend, cfg) as url:
            warm = {"model": cfg.model.openai_name, "prompt": [3 + i % 250 for i in range(1024)], "max_tokens": 4,
                    "ignore_eos": True}
            httpx.post(url + "/v1/completions", json=warm, timeout=600).raise_for_status()
            print(f"=== {stack}: up in {time.monotonic() - t0:.0f} s", flush=True)
            params = BenchParams(url=url, trace=str(trace), out=str(out / stack), concurrency=conc,
                                 max_requests=args.requests, warmup_requests=4, think_cap_ms=2000,
                                 sample_start_turn=True, salt=1 + 100 * k, num_gpus=1, vocab_size=engine_limits(cfg).vocab_size,
                                 first_token_id=3, default_block_size=64, progress=False, quiet=True)
            doc = run_bench_sync(params, records)
        for e in doc["runs"]:
            s = e["summary"]
            row = {"stack": stack, "run": e["label"], "requests": s["num_requests"], "failed": s["num_failed"],
                   "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p90_ms": s["ttft_ms"]["p90"],
                   "itl_p90_ms": s["itl_ms"]["p90"], "p90_interactivity": s["p90_interactivity"],
                   "total_tps_per_gpu": s["total_tps_per_gpu"], "cache_hit_usage": s["cache_hit_usage"],
                   "cache_hit_theoretical": s["cache_hit_theoretical"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out / "e2e.json").write_text(json.dumps(rows, indent=2))
    print("| stack | run | req (failed) | TTFT P50 ms | TTFT P90 ms | ITL P90 ms | P90 tok/s/user | tok/s/GPU | hit |")
    print("|---|---|---|---|---|---|---|---|---|")
    f = lambda v, spec: "n/a" if v is None else format(v, spec)
    for r in rows:
        print(f"| {r['stack']} | {r['run']} | {r['requests']} ({r['failed']}) | {f(r['ttft_p50_ms'], '.0f')} | "
              f"{f(r['ttft_p90_ms'], '.0f')} | {f(r['itl_p90_ms'], '.1f')} | {f(r['p90_interactivity'], '.1f')} | "
              f"{f(r['total_tps_per_gpu'], ',.0f')} | {f(r['cache_hit_usage'], '.1%')} |")


if __name__ == "__main__":
    main()
