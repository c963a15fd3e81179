"""Ray Serve + HTTP path figures, each against a baseline measured in the same run.

    python benchmarks/serve_bench.py [--contexts 2048,8192] [--reps 12] [--json out.json]
    python benchmarks/serve_bench.py --contexts ''      # the overhead part only

1. Overhead: TTFT and per-token latency of the same prompts streamed through
   HTTP -> ingress -> decode replica (aggregated app, so no prefill hop) against
   calling the same engine directly in this process (same torch thread count, and
   the replicas at this process's scheduler priority: see ``disagg.local``). The
   two alternate prompt by prompt (which goes first alternates too), each starts
   on an idle system (a short pause lets the previous HTTP request's background
   turn-end publish finish), the HTTP client keeps its connection alive like an
   SDK client, and the TTFT gap is reported both as a difference of medians and
   as the median of per-prompt differences (steadier on a shared machine).
2. Turn-2 TTFT through the whole disaggregated system at each context length:
   state resumed from the host tier (device residency off, so the state really
   moves through the node's host tier) against a full recompute of the same
   prompt (a fresh cache salt, so nothing stored matches).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx
import torch

from disagg.config import load_config
from disagg.engine.async_engine import AsyncEngine
from disagg.engine.factory import build_reference_engine
from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.local import free_port, local_app, wait_healthy

MODEL = "disagg-tiny"
SETTLE_S = 0.1  # pause before each measured request: the previous one's turn-end publish lands first


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


async def _direct(engine: AsyncEngine, prompt: list[int], n: int, rid: str) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    stamps = []
    async for out in engine.generate(EngineRequest(rid, prompt, SamplingParams(max_tokens=n, ignore_eos=True))):
        if out.new_token_ids:
            stamps.append(time.perf_counter())
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def _http(client: httpx.Client, url: str, prompt: list[int], n: int, salt: str = "", session: str | None = None):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True, "cache_salt": salt, "session_id": session,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, ids, cached = [], [], 0
    with client.stream("POST", url + "/v1/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            for ch in ev.get("choices", []):
                if ch.get("token_ids"):
                    stamps.append(time.perf_counter())
                    ids.extend(ch["token_ids"])
            if ev.get("usage"):
                cached = ev["usage"]["prompt_tokens_details"]["cached_tokens"]
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:], strict=False)], ids, cached



def overhead(reps: int, prompt_len: int, out_len: int) -> dict:
    """Direct engine calls and HTTP requests interleaved prompt by prompt (noise hits both alike)."""
    cfg = _cfg("aggregated", resident=False, port=free_port())
    torch.set_num_threads(cfg.engine.num_threads or torch.get_num_threads())
    prompts = [_ids(prompt_len, 1000 + i) for i in range(reps)]
    d_ttft, d_itl, h_ttft, h_itl = [], [], [], []
    with local_app(cfg) as url, httpx.Client() as client:
        wait_healthy(url)
        engine = AsyncEngine(build_reference_engine(cfg))
        loop = asyncio.new_event_loop()

        def direct(p: list[int], rid: str) -> None:
            time.sleep(SETTLE_S)
            t, itl = loop.run_until_complete(_direct(engine, p, out_len, rid))
            d_ttft.append(t)
            d_itl.extend(itl)

        def http(p: list[int]) -> None:
            time.sleep(SETTLE_S)
            t, itl, _, _ = _http(client, url, p, out_len)
            h_ttft.append(t)
            h_itl.extend(itl)

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
        finally:
            engine.shutdown()
            loop.close()
    return {"prompt_tokens": prompt_len, "output_tokens": out_len, "reps": reps,
            "direct_ttft_p50_ms": _p50(d_ttft), "http_ttft_p50_ms": _p50(h_ttft),
            "added_ttft_p50_ms": _p50(h_ttft) - _p50(d_ttft),
            "added_ttft_paired_p50_ms": _p50([h - d for h, d in zip(h_ttft, d_ttft, strict=True)]),
            "direct_itl_p50_ms": _p50(d_itl), "http_itl_p50_ms": _p50(h_itl),
            "added_itl_p50_ms": _p50(h_itl) - _p50(d_itl),
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
            _, _, out, _ = _http(client, url, turn1, 8, salt="resume", session=f"ctx{c}")
            turn2 = turn1 + out + _ids(followup, c + 1)
            t_res, _, ids_res, cached = _http(client, url, turn2, 4, salt="resume", session=f"ctx{c}")
            t_rec, _, ids_rec, cached_rec = _http(client, url, turn2, 4, salt=f"fresh-{c}",
                                                  session=f"ctx{c}-fresh")
            assert ids_res == ids_rec, "resumed and recomputed outputs differ"
            rows.append({"context": c, "turn2_prompt": len(turn2), "cached_tokens_resumed": cached,
                         "cached_tokens_recompute": cached_rec, "ttft_resumed_ms": 1000 * t_res,
                         "ttft_recompute_ms": 1000 * t_rec, "speedup": t_rec / t_res})
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
    print(json.dumps({k: v for k, v in figures["overhead"].items() if k != "samples"}, indent=2), flush=True)
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
