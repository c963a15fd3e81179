"""Prefill with state publishing on, against off, in the same run.

    python benchmarks/overlap_bench.py [--device cuda --preset small --dtype bfloat16]
        [--prompt 8192] [--batch 4] [--rounds 4] [--json out.json]

A round submits ``--batch`` distinct prompts at once to one engine (the
prefill server's engine and worker, in this process) and times the makespan:

    off   engine.generate(max_tokens=1), state dropped         (prefill only)
    on    StatefulWorker.prefill: compute, then export the prompt's state
          (batched device gather) and put it into the host tier (checksummed),
          while the engine goes on stepping the round's other prompts

Rounds alternate off / on so machine noise hits both alike; the figure is the
median makespan ratio on / off (goal: < 1.05). Every published prompt is
checked to be resumable to its full length from the host tier.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import torch

from disagg.engine.async_engine import AsyncEngine
from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.engine.reference.config import load_preset
from disagg.engine.reference.engine import EngineOptions, ReferenceEngine
from disagg.engine.reference.model import K3ForCausalLM
from disagg.messages import GenerateParams
from disagg.worker import StatefulWorker
from kv_transfer.store import StateStore
from kv_transfer.tiers.host import HostTier


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 259, (n,), generator=g).tolist()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


async def _round(worker: StatefulWorker, engine: AsyncEngine, prompts: list[list[int]], publish: bool, tag: str):
    sp = SamplingParams(max_tokens=1, ignore_eos=True)

    async def off(i: int, p: list[int]) -> None:
        async for _ in engine.generate(EngineRequest(f"{tag}-{i}", p, sp)):
            pass

    async def on(i: int, p: list[int]) -> None:
        await worker.prefill(GenerateParams(f"{tag}-{i}", p, sp))

    t0 = time.perf_counter()
    await asyncio.gather(*((on if publish else off)(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - t0


async def run(args) -> dict:
    model = K3ForCausalLM.random_init(load_preset(args.preset), seed=0, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    opts = EngineOptions(block_size=64, max_num_seqs=max(16, args.batch), max_num_batched_tokens=args.chunk,
                         cache_budget_bytes=args.budget_mb << 20, resident_sessions=False)
    engine = AsyncEngine(ReferenceEngine(model, "bench", opts))
    state_bytes = engine.layout.mla_block_bytes() * (args.prompt // 64 + 1) + engine.layout.kda_checkpoint_bytes()
    host = HostTier(max(512 << 20, 3 * args.batch * state_bytes), pin_memory=args.device.startswith("cuda"))
    store = StateStore([host], engine.layout)
    worker = StatefulWorker(engine, store, "prefill-0", "local")
    await _round(worker, engine, [_ids(args.prompt, 1)], False, "warm-off")  # kernels compiled / autotuned
    await _round(worker, engine, [_ids(args.prompt, 2)], True, "warm-on")
    times: dict[str, list[float]] = {"off": [], "on": []}
    seed = 100
    for r in range(args.rounds):
        for mode in ("off", "on"):
            prompts = [_ids(args.prompt, seed + i) for i in range(args.batch)]
            seed += args.batch
            _sync(args.device)
            times[mode].append(await _round(worker, engine, prompts, mode == "on", f"{mode}{r}"))
            if mode == "on":  # what was published resumes to the prompt's full length
                for p in prompts:
                    got = store.resumable_length(p, worker.hasher, len(p)).position
                    assert got == len(p), f"published state resumes at {got}, not {len(p)}"
            print(f"round {r} {mode:>3}: {times[mode][-1] * 1000:9.1f} ms", flush=True)
    engine.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"device": args.device, "preset": args.preset, "prompt_tokens": args.prompt, "batch": args.batch,
           "rounds": args.rounds, "makespan_off_ms": 1000 * med["off"], "makespan_on_ms": 1000 * med["on"],
           "ratio_on_off": med["on"] / med["off"], "published_bytes": worker.counters["published_bytes"],
           "gil_switch_interval_s": sys.getswitchinterval(),
           "prefill_tok_s_off": args.batch * args.prompt / med["off"],
           "prefill_tok_s_on": args.batch * args.prompt / med["on"]}
    print(json.dumps(out, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--budget-mb", type=int, default=1024)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = asyncio.run(run(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
