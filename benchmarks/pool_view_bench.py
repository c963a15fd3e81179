"""Cost of the prefill pool's view for the decode side's P/D decision (``disagg.flow`` NOTE 5).

``StateAwareRequestRouter.pool_view(params)`` runs once per request on the decode replica's
event loop: it syncs the pool's replica reports, computes effective loads, hashes the prompt
(salted block digests, tail probes) and walks the prefix index. This script builds the
adapter's pure part (no Serve controller: replica records are plain objects) with N prefill
replicas whose device snapshots fill the index with about B blocks, then times, per prompt
length, alternating call by call over the same requests:

    view (hashes)        pool_view(PoolQuery(params))       hashing the prompt itself
    view (flow digests)  pool_view(PoolQuery(params,        what the decode flow calls: its
                           hasher, hashes))                 ReuseTicket's digests, same key space
    place                choose_replicas(candidates, req)   the prefill placement (hashes the prompt)
    place after view     the same, for the request just viewed (its digests reused)
    loads                pool_loads()                       what the flow called before (loads only)

and prints p50 / p90 / p99 wall time per call and the views' ratios to the placement.

    python benchmarks/pool_view_bench.py                       # 16 replicas, ~100K blocks
    python benchmarks/pool_view_bench.py --replicas 64 --blocks 1000000 --prompt-tokens 32768
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.request_router import StateAwareRequestRouter  # noqa: E402
from disagg.engine.protocol import SamplingParams  # noqa: E402
from disagg.messages import GenerateParams  # noqa: E402
from disagg.router.metrics import PoolQuery  # noqa: E402
from kv_transfer.keys import BlockHasher, KeyExtras  # noqa: E402

MODEL = "bench-model"


def build(num_replicas: int, num_blocks: int, block_size: int, session_blocks: int, seed: int):
    """A prefill pool's router whose index holds ~num_blocks device blocks; the sessions' tokens."""
    rng = np.random.default_rng(seed)
    hasher = BlockHasher(block_size, KeyExtras(MODEL))
    per_replica = max(1, num_blocks // (num_replicas * session_blocks))
    sessions: list[list[int]] = []
    replicas = {}
    now = time.time()
    for r in range(num_replicas):
        held = []
        for _ in range(per_replica):
            tokens = rng.integers(4, 100_000, session_blocks * block_size + block_size // 2).tolist()
            sessions.append(tokens)
            held.append(tokens)
        stats = {"role": "prefill", "node_id": f"n{r // 8}", "time": now, "model_id": MODEL,
                 "block_size": block_size, "device_version": 1,
                 "load": {"queued_prefill_tokens": int(rng.integers(0, 20_000))},
                 "device_sessions": [[h.hex() for h in hasher.block_hashes(t)] for t in held],
                 "device_tails": [[len(t), hasher.prefix_digest(t, len(t)).hex()] for t in held]}
        rid = f"prefill-{r}"
        replicas[rid] = SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats=stats)
    rr = object.__new__(StateAwareRequestRouter)  # its pure part: no Serve controller
    rr.initialize_state()
    rr._replicas = replicas
    rr.pool_loads()  # first sync: snapshots into the index (not timed)
    return rr, sessions, hasher


def requests(sessions: list[list[int]], prompt_tokens: int, n: int, seed: int) -> list[GenerateParams]:
    """Half next turns of resident sessions (cut or extended to prompt_tokens), half cold prompts."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            base = rng.choice(sessions)[:prompt_tokens]
            prompt = base + [rng.randrange(4, 100_000) for _ in range(prompt_tokens - len(base))]
        else:
            prompt = [rng.randrange(4, 100_000) for _ in range(prompt_tokens)]
        out.append(GenerateParams(f"r{i}", prompt, SamplingParams(max_tokens=256), session_id=f"s{i}"))
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure(rr, hasher: BlockHasher, reqs: list[GenerateParams]) -> dict[str, list[float]]:
    """Per request, each on its own copy of the prompt list unless said (the adapter reuses the
    digests of the last prompt list it saw): the view hashing the prompt, the view given the
    flow's digests, then the placement of that same request, a placement of a fresh copy, loads."""
    times: dict[str, list[float]] = {k: [] for k in ("view", "view_given", "place_after", "place", "loads")}
    candidates = list(rr._replicas.values())
    loop = asyncio.new_event_loop()
    clock = time.perf_counter
    gc.collect()
    try:
        for params in reqs:
            a, b, c = (replace(params, prompt_token_ids=list(params.prompt_token_ids)) for _ in range(3))
            digests = hasher.block_hashes(b.prompt_token_ids)  # the flow's (ReuseTicket.hashes), not timed
            t0 = clock()
            rr.pool_view(PoolQuery(a))
            t1 = clock()
            rr.pool_view(PoolQuery(b, hasher, digests))
            t2 = clock()
            loop.run_until_complete(rr.choose_replicas(candidates, SimpleNamespace(args=[b])))
            t3 = clock()
            loop.run_until_complete(rr.choose_replicas(candidates, SimpleNamespace(args=[c])))
            t4 = clock()
            rr.pool_loads()
            t5 = clock()
            for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                times[key].append(dt)
    finally:
        loop.close()
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=100_000, help="device blocks indexed (about)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--session-blocks", type=int, default=500, help="blocks per resident session")
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[2048, 32768, 131072])
    ap.add_argument("--calls", type=int, default=200, help="timed calls per prompt length")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    rr, sessions, hasher = build(args.replicas, args.blocks, args.block_size, args.session_blocks, args.seed)
    print(f"pool: {args.replicas} replicas, {rr._index.num_objects()} indexed objects "
          f"(built in {time.perf_counter() - t0:.1f} s)", flush=True)
    print("ms per call, p50 / p90 / p99; ratios of p50s against the placement of the same prompt")
    print(f"{'prompt':>7} | {'view (hashes)':>22} | {'view (flow digests)':>22} | {'place':>22} | "
          f"{'place after view':>16} | {'loads':>6} | {'view/place':>10} | {'given/place':>11}")
    for n_tok in args.prompt_tokens:
        reqs = requests(sessions, n_tok, args.calls, args.seed + n_tok)
        measure(rr, hasher, reqs[: max(4, len(reqs) // 10)])  # warm-up
        t = measure(rr, hasher, reqs)
        ms = {k: [x * 1e3 for x in v] for k, v in t.items()}
        p50 = {k: statistics.median(v) for k, v in ms.items()}
        trio = {k: f"{p50[k]:6.3f} / {pct(v, 0.9):6.3f} / {pct(v, 0.99):6.3f}" for k, v in ms.items()}
        print(f"{n_tok:>7} | {trio['view']} | {trio['view_given']} | {trio['place']} | {p50['place_after']:16.3f} | "
              f"{p50['loads']:6.3f} | {p50['view'] / p50['place']:10.2f} | {p50['view_given'] / p50['place']:11.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
