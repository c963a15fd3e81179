"""Ray Serve + HTTP path figures, each against a baseline measured in the same run.

    python benchmarks/serve_bench.py [--contexts 2048,8192] [--reps 12] [--json out.json]
    python benchmarks/serve_bench.py --contexts ''      # the overhead part only

1. Overhead: TTFT and per-token latency of the same prompts streamed through
   HTTP -> ingress -> decode replica (aggregated app, so no prefill hop) against
   calling the same engine directly in this process (same torch thread count, and
   the replicas at this process's scheduler priority: see ``disagg.launch.local``). The
   two alternate prompt by prompt (which goes first alternates too), each starts
   on an idle system (a short pause lets the previous HTTP request's background
   turn-end publish finish), the HTTP client keeps its connection alive like an
   SDK client, and the TTFT gap is reported both as a difference of medians and
   as the median of per-prompt differences (steadier on a shared machine).
   Where the added TTFT goes: each request's first-token stamps along the path
   (``deployments.timings``: client, ingress, decode replica and its engine,
   on the host's one monotonic clock) as a table of hop medians, HTTP beside
   direct, including the prefill step's wall and CPU time in either process.
2. Turn-2 TTFT through the whole disaggregated system at each context length:
   state resumed from the host tier (device residency off, so the state really
   moves through the node's host tier) against a full recompute of the same
   prompt (a fresh cache salt, so nothing stored matches).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
import torch
from ray import serve

from disagg.config import load_config
from disagg.engine.async_engine import AsyncEngine
from disagg.engine.factory import build_reference_engine
from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.launch.local import APP_NAME, free_port, local_app, wait_healthy

MODEL = "disagg-tiny"
SETTLE_S = 0.1  # pause before each measured request: the previous one's turn-end publish lands first

# (label, from stamp, to stamp) of each hop to the first token, in path order (deployments.timings)
HOPS = [
    ("client -> ingress ASGI (HAProxy, uvicorn, Serve)", "send", "http_in"),
    ("ingress ASGI -> backend (middleware, FastAPI, validation)", "http_in", "handler"),
    ("backend -> Serve handle call", "handler", "call"),
    ("handle call -> replica entry (router, gRPC)", "call", "entry"),
    ("replica entry -> engine admit (worker plan)", "entry", "admit"),
    ("engine admit -> prefill step start", "admit", "step_start"),
    ("prefill step (wall)", "step_start", "step_end"),
    ("step end -> engine consumer", "step_end", "first_out"),
    ("engine consumer -> replica yield", "first_out", "first_yield"),
    ("replica yield -> ingress (gRPC stream)", "first_yield", "chunk_in"),
    ("ingress chunk -> SSE body sent", "chunk_in", "body_out"),
    ("body sent -> client receives", "body_out", "recv"),
]
DIRECT_HOPS = [("call -> engine admit", "send", "admit"), ("engine admit -> prefill step start", "admit", "step_start"),
               ("prefill step (wall)", "step_start", "step_end"), ("step end -> consumer", "step_end", "first_out"),
               ("consumer -> caller", "first_out", "recv")]


@dataclass(slots=True)
class StreamResult:
    """One streamed request as the client saw it."""

    ttft: float  # seconds from send to the first token
    itl: list[float]  # seconds between successive tokens
    token_ids: list[int] = field(default_factory=list)  # the output
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    stamps: dict = field(default_factory=dict)  # send / recv (perf_counter), request_id, + the path's stamps


def _cfg(mode: str, resident: bool, port: int):
    cfg = load_config("deployments/configs/local-cpu.yaml")
    cfg.deployment.mode = mode
    cfg.engine.resident_sessions = resident
    cfg.http.port = port
    return cfg


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 260) for _ in range(n)]


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


async def _direct(engine: AsyncEngine, prompt: list[int], n: int, rid: str) -> StreamResult:
    t0 = time.perf_counter()
    stamps = []
    async for out in engine.generate(EngineRequest(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True))):
        if out.new_token_ids:
            stamps.append(time.perf_counter())
    return StreamResult(stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
                        stamps={"send": t0, "recv": stamps[0], **(engine.trace(rid) or {})})


def _http(client: httpx.Client, url: str, prompt: list[int], n: int, salt: str = "",
          session: str | None = None) -> StreamResult:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "cache_salt": salt, "session_id": session,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, ids, cached, request_id = [], [], 0, ""
    with client.stream("POST", url + "/v1/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            request_id = request_id or ev.get("id", "")
            for ch in ev.get("choices", []):
                if ch.get("token_ids"):
                    stamps.append(time.perf_counter())
                    ids.extend(ch["token_ids"])
            if ev.get("usage"):
                cached = ev["usage"]["prompt_tokens_details"]["cached_tokens"]
    return StreamResult(stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:], strict=False)], ids, cached,
                        {"send": t0, "recv": stamps[0], "request_id": request_id})


def _path_stamps(results: list[StreamResult]) -> None:
    """Add the ingress's and the decode replica's stamps of each request (one replica of each)."""
    ids = [r.stamps["request_id"] for r in results]
    found = {}
    for deployment in ("Ingress", "DecodeServer"):
        handle = serve.get_deployment_handle(deployment, app_name=APP_NAME)
        for rid, stamps in handle.timings.remote(ids).result().items():
            found.setdefault(rid, {}).update(stamps)
    for r in results:
        r.stamps.update(found.get(r.stamps["request_id"], {}))


def _outside_prefill(r: StreamResult) -> float | None:
    """TTFT less the wall time of the step that computed the first token (the prefill)."""
    if "step_start" not in r.stamps or "step_end" not in r.stamps:
        return None
    return r.ttft - (r.stamps["step_end"] - r.stamps["step_start"])


def _p50_known(xs: list[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return _p50(known) if known else None


def _hop_table(http: list[StreamResult], direct: list[StreamResult]) -> dict:
    """Median of each hop (ms) over the requests that have both its stamps."""

    def median_of(results, a, b):
        xs = [r.stamps[b] - r.stamps[a] for r in results if a in r.stamps and b in r.stamps]
        return _p50(xs) if xs else None

    def cpu(results):
        xs = [r.stamps["step_cpu"] for r in results if "step_cpu" in r.stamps]
        return _p50(xs) if xs else None

    return {"http": {label: median_of(http, a, b) for label, a, b in HOPS},
            "direct": {label: median_of(direct, a, b) for label, a, b in DIRECT_HOPS},
            "http_prefill_cpu_ms": cpu(http), "direct_prefill_cpu_ms": cpu(direct),
            "http_outside_prefill_ms": _p50_known([_outside_prefill(r) for r in http]),
            "direct_outside_prefill_ms": _p50_known([_outside_prefill(r) for r in direct])}


def _print_hops(hops: dict) -> None:
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    print("\n| hop to the first token (HTTP) | median ms |\n|---|---|")
    for label, v in hops["http"].items():
        print(f"| {label} | {fmt(v)} |")
    print("\n| hop to the first token (direct) | median ms |\n|---|---|")
    for label, v in hops["direct"].items():
        print(f"| {label} | {fmt(v)} |")
    print(f"\nprefill step CPU: HTTP {fmt(hops['http_prefill_cpu_ms'])} ms, direct {fmt(hops['direct_prefill_cpu_ms'])} ms;"
          f" TTFT outside the prefill step: HTTP {fmt(hops['http_outside_prefill_ms'])} ms,"
          f" direct {fmt(hops['direct_outside_prefill_ms'])} ms", flush=True)



def overhead(reps: int, prompt_len: int, out_len: int) -> dict:
    """Direct engine calls and HTTP requests interleaved prompt by prompt (noise hits both alike)."""
    cfg = _cfg("aggregated", resident=False, port=free_port())
    torch.set_num_threads(cfg.engine.num_threads or torch.get_num_threads())
    prompts = [_ids(prompt_len, 1000 + i) for i in range(reps)]
    direct_runs: list[StreamResult] = []
    http_runs: list[StreamResult] = []
    load_before = os.getloadavg()
    with local_app(cfg) as url, httpx.Client() as client:
        wait_healthy(url)
        engine = AsyncEngine(build_reference_engine(cfg))
        loop = asyncio.new_event_loop()

        def direct(p: list[int], rid: str) -> None:
            time.sleep(SETTLE_S)
            direct_runs.append(loop.run_until_complete(_direct(engine, p, out_len, rid)))

        def http(p: list[int]) -> None:
            time.sleep(SETTLE_S)
            http_runs.append(_http(client, url, p, out_len))

        try:
            loop.run_until_complete(_direct(engine, _ids(64, 1), 4, "warm"))
            _http(client, url, _ids(64, 1), 4)
            for i, p in enumerate(prompts):
                if i % 2:
                    http(p)
                    direct(p, f"d{i}")
                else:
                    direct(p, f"d{i}")
                    http(p)
            _path_stamps(http_runs)
        finally:
            engine.shutdown()
            loop.close()
    d_ttft, h_ttft = [r.ttft for r in direct_runs], [r.ttft for r in http_runs]
    d_itl, h_itl = [x for r in direct_runs for x in r.itl], [x for r in http_runs for x in r.itl]
    return {"prompt_tokens": prompt_len, "output_tokens": out_len, "reps": reps,
            "direct_ttft_p50_ms": _p50(d_ttft), "http_ttft_p50_ms": _p50(h_ttft),
            "added_ttft_p50_ms": _p50(h_ttft) - _p50(d_ttft),
            "added_ttft_paired_p50_ms": _p50([h - d for h, d in zip(h_ttft, d_ttft, strict=True)]),
            "direct_itl_p50_ms": _p50(d_itl), "http_itl_p50_ms": _p50(h_itl),
            "added_itl_p50_ms": _p50(h_itl) - _p50(d_itl),
            "added_ttft_outside_prefill_paired_p50_ms": _p50_known([
                None if None in (_outside_prefill(h), _outside_prefill(d)) else _outside_prefill(h) - _outside_prefill(d)
                for h, d in zip(http_runs, direct_runs, strict=True)]),
            "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "hops": _hop_table(http_runs, direct_runs),
            "samples": {"direct_ttft_ms": [round(1000 * t, 1) for t in d_ttft],
                        "http_ttft_ms": [round(1000 * t, 1) for t in h_ttft]}}


def resume_vs_recompute(contexts: list[int], followup: int) -> list[dict]:
    cfg = _cfg("disaggregated", resident=False, port=free_port())
    rows = []
    with local_app(cfg) as url, httpx.Client() as client:
        wait_healthy(url)
        _http(client, url, _ids(64, 1), 2)
        for c in contexts:
            turn1 = _ids(c, c)
            out = _http(client, url, turn1, 8, salt="resume", session=f"ctx{c}").token_ids
            turn2 = turn1 + out + _ids(followup, c + 1)
            res = _http(client, url, turn2, 4, salt="resume", session=f"ctx{c}")
            rec = _http(client, url, turn2, 4, salt=f"fresh-{c}", session=f"ctx{c}-fresh")
            assert res.token_ids == rec.token_ids, "resumed and recomputed outputs differ"
            rows.append({"context": c, "turn2_prompt": len(turn2), "cached_tokens_resumed": res.cached_tokens,
                         "cached_tokens_recompute": rec.cached_tokens, "ttft_resumed_ms": 1000 * res.ttft,
                         "ttft_recompute_ms": 1000 * rec.ttft, "speedup": rec.ttft / res.ttft})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--followup", type=int, default=64)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    figures = {"overhead": overhead(args.reps, args.prompt_len, args.out_len)}
    print(json.dumps({k: v for k, v in figures["overhead"].items() if k not in ("samples", "hops")}, indent=2),
          flush=True)
    _print_hops(figures["overhead"]["hops"])
    contexts = [int(c) for c in args.contexts.split(",") if c]
    figures["resume"] = resume_vs_recompute(contexts, args.followup) if contexts else []
    print("\n| context | turn-2 TTFT resumed (ms) | recompute (ms) | speedup | cached tokens |")
    print("|---|---|---|---|---|")
    for r in figures["resume"]:
        print(f"| {r['context']} | {r['ttft_resumed_ms']:.0f} | {r['ttft_recompute_ms']:.0f} | "
              f"{r['speedup']:.1f}x | {r['cached_tokens_resumed']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
