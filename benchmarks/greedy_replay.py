"""Greedy outputs of an agentic replay through the in-process workers, checked against fresh runs.

A small synthetic agentic trace (``disagg.tools.bench.synth``: shared prefix, growing
sessions, tool results) is replayed turn by turn through ``InProcessBackend``
(tiny reference model on CPU, disaggregated, a low local-prefill threshold so
both local and remote prefills, state loads and device-resident resumes run).
Every request decodes greedily; its tokens are compared with an uninterrupted
run of the same prompt on a fresh engine (no cache). The outputs are written as
JSON, so two code versions can be compared request by request::

    PYTHONPATH=<tree> python benchmarks/greedy_replay.py --out /tmp/after.json
    PYTHONPATH=<other tree> python benchmarks/greedy_replay.py --out /tmp/before.json
    cmp /tmp/before.json /tmp/after.json   (the "outputs" part; "worker" counters may differ)

Prints the number of requests, the mismatches against the fresh runs, and the
worker's counters (remote / local prefills, cached tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import torch

from disagg.config import load_config
from disagg.engine.factory import engine_limits
from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.engine.reference.engine import ReferenceEngine
from disagg.launch.inprocess import InProcessBackend
from disagg.messages import GenerateParams
from disagg.tools.bench.synth import synthesize
from disagg.tools.bench.tokens import TokenFactory


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--scale", type=float, default=0.02, help="token-length scale of the synthetic trace")
    ap.add_argument("--turn-scale", type=float, default=0.1, help="turn-count scale of the synthetic trace")
    ap.add_argument("--max-turns", type=int, default=6, help="turns replayed per session")
    ap.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per request")
    ap.add_argument("--local-prefill-max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write outputs and counters here (JSON)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config({"model": {"name": "tiny"},
                       "engine": {"block_size": 64, "cache_budget_mb": 128, "max_num_batched_tokens": 512},
                       "transfer": {"host": {"capacity_mb": 256, "pin_memory": False}},
                       "router": {"local_prefill_max_tokens": args.local_prefill_max_tokens},
                       "deployment": {"mode": "disaggregated"}})
    records = synthesize(args.sessions, args.seed, block_size=64, scale=args.scale, turn_scale=args.turn_scale,
                         subagents=False)
    records = sorted((r for r in records if r.turn < args.max_turns), key=lambda r: (r.session_id, r.turn))
    tokens = TokenFactory(block_size=64, vocab_size=engine_limits(cfg).vocab_size, first_id=4)
    backend = InProcessBackend(cfg)
    model_engine = backend.decode.engine.engine
    fresh = ReferenceEngine(model_engine.model, model_engine.model_id, model_engine.options)
    outputs: dict[str, list[int]] = {}
    mismatches = []
    t0 = time.perf_counter()

    async def replay() -> None:
        for i, rec in enumerate(records):
            prompt = [int(t) for t in tokens.prompt_ids(rec)]
            rid = f"{rec.session_id}/t{rec.turn}"
            params = GenerateParams(f"q{i}", prompt, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
                                    session_id=rec.session_id)
            got = [t async for c in backend.stream(params) for t in c.token_ids]
            want, _ = fresh.generate(EngineRequest(f"ref{i}", prompt,
                                                   SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)))
            outputs[rid] = got
            if got != list(want):
                mismatches.append(rid)
            print(f"[{i + 1}/{len(records)}] {rid}: prompt {len(prompt)} tokens, "
                  f"{'ok' if got == list(want) else 'MISMATCH'}", file=sys.stderr)
        await backend.decode.drain()

    try:
        asyncio.run(replay())
        stats = backend.decode.stats()["worker"]
    finally:
        backend.shutdown()
    print(json.dumps({"requests": len(records), "mismatches_vs_fresh": len(mismatches),
                      "seconds": round(time.perf_counter() - t0, 1), "worker": stats}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"outputs": outputs, "mismatches_vs_fresh": mismatches, "worker": stats}, f, indent=1,
                      sort_keys=True)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
