"""What a delta hand-off saves on a GPU: a session's next turn, prefilled by the prefill worker,
opened by the decode worker that decoded its last turn (``disagg.flow`` NOTE 11).

    python benchmarks/gpu/delta_handoff.py --context 8192,32768 --suffix 512 --json OUT/delta.json

Per context (``small`` preset, bf16, 64-token blocks, one host tier shared by both workers as on
one node): the decode worker runs turn 1 (``context`` tokens, prefilled there) and keeps it
resident; turn 2 adds ``suffix`` tokens and goes to the prefill worker (its suffix passes the
decider's local limit). Turn 2's hand-off is opened twice per repetition, alternating, on fresh
decode workers holding the same turn 1:

    delta   the load skips the rows the decode engine holds (the default)
    whole   the engine reports no resident rows, so the load carries the whole state (as before)

Printed: bytes moved, the load's time (``StreamChunk.transfer_seconds``) and turn 2's time from
the handle to its last token, medians over ``--reps``; both outputs must be equal. Ratios are
against ``whole`` in the same run; absolute times are this GPU's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from disagg.config import load_config  # noqa: E402
from disagg.engine.async_engine import AsyncEngine  # noqa: E402
from disagg.engine.factory import build_reference_engine  # noqa: E402
from disagg.engine.protocol import SamplingParams  # noqa: E402
from disagg.engine.reference.engine import ReferenceEngine  # noqa: E402
from disagg.flow import FlowOptions  # noqa: E402
from disagg.messages import GenerateParams  # noqa: E402
from disagg.router.decider import DeciderConfig  # noqa: E402
from disagg.workers.tiered import StatefulWorker  # noqa: E402
from kv_transfer.store import StateStore  # noqa: E402
from kv_transfer.tiers.host import HostTier  # noqa: E402


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 259, (n,), generator=g).tolist()


async def _stream(worker, params, prefill_fn=None):
    out, last, t0 = [], None, time.perf_counter()
    async for chunk in worker.generate(params, prefill_fn):
        out.extend(chunk.token_ids)
        last = chunk
    await worker.drain()
    return out, last, time.perf_counter() - t0


def run(context: int, suffix: int, reps: int, device: str, budget_mb: int, preset: str = "small") -> dict:
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    cfg = load_config({"model": {"name": preset, "device": device, "dtype": dtype},
                       "engine": {"cache_budget_mb": budget_mb, "max_num_batched_tokens": 8192}})
    base = build_reference_engine(cfg)
    store = StateStore([HostTier(max(8 << 30, context * 200_000), pin_memory=device.startswith("cuda"))],
                       base.layout)
    options = FlowOptions(DeciderConfig(local_prefill_max_tokens=suffix - 1, local_harm_weight=0))

    def engine():
        return AsyncEngine(ReferenceEngine(base.model, base.model_id, base.options))

    prefill = StatefulWorker(engine(), store, "prefill", "n")
    sampling = SamplingParams(max_tokens=16, ignore_eos=True)
    turn1 = _ids(context, 1)
    rows: dict[str, list[dict]] = {"delta": [], "whole": []}
    outputs = {}
    try:
        for rep in range(reps):
            for mode in (("delta", "whole") if rep % 2 == 0 else ("whole", "delta")):
                decode = StatefulWorker(engine(), store, f"decode-{mode}-{rep}", "n", options=options)
                if mode == "whole":  # the engine reports no resident rows: the load carries everything
                    real = decode.engine.resident_extent

                    async def no_rows(tokens, salt="", real=real):
                        length, _ = await real(tokens, salt)
                        return length, 0

                    decode.engine.resident_extent = no_rows
                try:
                    salt = f"{mode}-{rep}"  # a key space per run: no run resumes another's publishes
                    p1 = GenerateParams(f"t1-{salt}", turn1, SamplingParams(max_tokens=8, ignore_eos=True),
                                        session_id="s", cache_salt=salt)
                    out1, _, _ = asyncio.run(_stream(decode, p1))
                    turn2 = turn1 + out1 + _ids(suffix, 2 + rep)
                    p2 = GenerateParams(f"t2-{salt}", turn2, sampling, session_id="s", cache_salt=salt)
                    out2, last, wall = asyncio.run(_stream(decode, p2, prefill.prefill))
                    assert decode.counters["remote_prefills"] == 1, f"turn 2 was not disaggregated: {decode.flow.decisions}"
                    outputs.setdefault(mode, out2)
                    rows[mode].append({"bytes": last.transfer_bytes, "load_s": last.transfer_seconds, "turn_s": wall,
                                       "misses": decode.engine.engine.counters["delta_base_misses"]})
                finally:
                    decode.engine.shutdown()
                    del decode
                    gc.collect()  # the engine's device cache goes before the next one is sized
                    if device.startswith("cuda"):
                        torch.cuda.empty_cache()
    finally:
        prefill.engine.shutdown()
    assert outputs["delta"] == outputs["whole"], "delta and whole loads disagree"

    def med(mode, key):
        return statistics.median(r[key] for r in rows[mode])

    out = {"context": context, "suffix": suffix, "reps": reps}
    for mode in rows:
        out[mode] = {"bytes": med(mode, "bytes"), "load_ms": round(1000 * med(mode, "load_s"), 2),
                     "turn_ms": round(1000 * med(mode, "turn_s"), 1), "base_misses": sum(r["misses"] for r in rows[mode])}
    out["bytes_ratio"] = round(out["delta"]["bytes"] / out["whole"]["bytes"], 4)
    out["load_ratio"] = round(out["delta"]["load_ms"] / out["whole"]["load_ms"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", default="8192,32768", help="turn 1 lengths, comma list")
    ap.add_argument("--suffix", type=int, default=512, help="turn 2's new tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--preset", default="small", help="model preset (tiny: a CPU check of the script)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budget-mb", type=int, default=12000, help="each engine's cache budget")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    results = []
    for ctx in (int(x) for x in args.context.split(",")):
        r = run(ctx, args.suffix, args.reps, args.device, args.budget_mb, args.preset)
        results.append(r)
        print(f"context {ctx:>7} + {args.suffix}: delta {r['delta']['bytes'] / 1e6:9.1f} MB "
              f"load {r['delta']['load_ms']:8.2f} ms | whole {r['whole']['bytes'] / 1e6:9.1f} MB "
              f"load {r['whole']['load_ms']:8.2f} ms | bytes x{r['bytes_ratio']} load x{r['load_ratio']} | "
              f"turn 2 {r['delta']['turn_ms']} vs {r['whole']['turn_ms']} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
