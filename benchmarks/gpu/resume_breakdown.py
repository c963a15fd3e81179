"""Where a resume through the host tier spends its time on a GPU, and what the direct path saves.

    python benchmarks/gpu/resume_breakdown.py --context 8192,32768,131072 --json OUT/resume.json

For each context (``small`` preset, bf16): the first turn is prefilled and its state put into a
host tier (page-locked arena, CRC32C objects of one 64-token block each); then, for the same
follow-up turn, each of these is timed ``--reps`` times, interleaved, medians reported:

    recompute         the whole follow-up prompt computed
    memory            state handed to the engine from memory (an export of the first turn)
    staged            host tier -> verify + copy into page-locked host rows -> engine copies up
    direct            host tier -> DMA of the objects to the device, checksummed there (headers
                      on the host) -> rows unpacked on the device (``kv_transfer.direct``)

and with ``--ab`` the same paths without the changes they measure: ``direct_host_checks``
(checksums on the host's I/O threads, as before the device checks), ``memory_eager`` and
``direct_eager`` (every kernel launched from Python: no CUDA graphs).

and the pieces of a load: the prefix lookup, the load itself (staged and direct), and the
primitives on the same bytes: one CRC32C pass (1 thread), one host memcpy into touched memory,
one page-locked allocation of that size, one pinned host-to-device copy. Ratios are against
the recompute measured in the same run; absolute times are this GPU's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from engine_bench import _ids, _store, _sync, make_engine, ttft  # noqa: E402

from disagg.engine.protocol import EngineRequest, SamplingParams  # noqa: E402
from disagg.engine.reference.config import load_preset  # noqa: E402
from disagg.engine.reference.model import K3ForCausalLM  # noqa: E402
from kv_transfer import checksum  # noqa: E402
from kv_transfer.keys import BlockHasher, KeyExtras, ObjectKey  # noqa: E402


def _median_ms(xs: list[float]) -> float:
    return round(1000 * statistics.median(xs), 2)


def primitives(store, keys: list[str], nbytes: int, device: str, reps: int) -> dict:
    tier = store.tiers[0]
    leases = tier.get_views(keys)
    try:
        crc = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for lease in leases:
                checksum.compute(checksum.CRC32C, lease.view)
            crc.append(time.perf_counter() - t0)
    finally:
        tier.release_many(leases)
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    copy = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copy.append(time.perf_counter() - t0)
    out = {"crc32c_1thread_ms": _median_ms(crc), "memcpy_ms": _median_ms(copy)}
    if not device.startswith("cuda"):
        return out
    pin = []
    for r in range(reps):  # a new size each time: torch's host cache would hand back the last one
        t0 = time.perf_counter()
        buf = torch.empty(nbytes + (r + 1) * (nbytes // 2), dtype=torch.uint8, pin_memory=True)
        pin.append(time.perf_counter() - t0)
    h2d = []
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        dev.copy_(buf[:nbytes], non_blocking=True)
        _sync(device)
        h2d.append(time.perf_counter() - t0)
    return {**out, "pinned_alloc_fresh_ms": _median_ms(pin), "h2d_pinned_ms": _median_ms(h2d),
            "h2d_pinned_gb_s": round(nbytes / statistics.median(h2d) / 1e9, 1)}


def run_context(model, args, context: int) -> dict:
    device = args.device
    vocab = model.config.vocab_size
    first = _ids(context, 7, vocab)
    src = make_engine(model, device, args.budget_mb, args.chunk)
    out, _ = src.generate(EngineRequest("t1", first, SamplingParams(max_tokens=1, ignore_eos=True), keep_state=True))
    state = src.export_state("t1")
    turn2 = first + out + _ids(args.followup, 8, vocab)
    mla_bytes = sum(b.rows.nbytes for b in state.mla_blocks)
    nbytes = mla_bytes + sum(k.conv.nbytes + k.recurrent.nbytes for k in state.kda)
    store = _store(src.layout, nbytes + (state.tail.rows.nbytes if state.tail else 0))
    store.io_threads = args.io_threads or store.io_threads
    store.warm(device)  # as a serving worker does at start: not in the first rep's load
    hasher = BlockHasher(64, KeyExtras("bench"))
    t0 = time.perf_counter()
    store.put_state(src.computed_tokens("t1"), state, hasher)
    put_s = time.perf_counter() - t0
    src_layout = src.layout
    del src
    keys = [str(ObjectKey("mla", d)) for d in hasher.block_hashes(turn2[: state.position // 64 * 64])]
    fig = {"context": context, "state_mb": round(nbytes / 1e6, 1), "mla_blocks": len(keys),
           "arena_pinned": bool(getattr(store.tiers[0].arena, "pinned", False)),
           "io_threads": store.io_threads, "put_ms": round(1000 * put_s, 1)}
    fig.update(primitives(store, keys, mla_bytes, device, args.reps))
    # (name, load to the device, checksums on the device, CUDA graphs); --ab adds the paths
    # without this session's changes, interleaved with the rest
    variants = [("staged", False, True, True), ("direct", True, True, True)]
    if args.ab:
        variants += [("direct_host_checks", True, False, True), ("direct_eager", True, True, False)]
    names = ["recompute", "memory"] + (["memory_eager"] if args.ab else []) + [v[0] for v in variants]
    times: dict[str, list[float]] = {k: [] for k in names + ["lookup"] + [f"load_{v[0]}" for v in variants]}
    first_tokens = set()
    # untimed: the follow-up's graph bucket is captured here, not in the first timed rep
    ttft(make_engine(model, device, args.budget_mb, args.chunk, resident_sessions=False), "warm", turn2, device,
         resume=state)
    for r in range(args.reps):
        t, tok = ttft(make_engine(model, device, args.budget_mb, args.chunk, resident_sessions=False),
                      f"r{r}", turn2, device)
        times["recompute"].append(t)
        first_tokens.add(tok)
        for name, graphs in (("memory", True), ("memory_eager", False))[: 2 if args.ab else 1]:
            t, tok = ttft(make_engine(model, device, args.budget_mb, args.chunk, resident_sessions=False,
                                      cuda_graphs=graphs), f"{name}{r}", turn2, device, resume=state)
            times[name].append(t)
            first_tokens.add(tok)
        for name, to_device, device_checks, graphs in variants:
            eng = make_engine(model, device, args.budget_mb, args.chunk, resident_sessions=False, cuda_graphs=graphs)
            store.device_checks = device_checks
            gc.collect()
            _sync(device)
            t0 = time.perf_counter()
            point = store.resumable_length(turn2, hasher, max_position=len(turn2) - 1)
            t1 = time.perf_counter()
            loaded = store.load_state(turn2, point.position, hasher, eng.layout, contiguous=True,
                                      device=device if to_device else None)
            _sync(device)
            t2 = time.perf_counter()
            assert loaded is not None and point.position == state.position
            t, tok = ttft(eng, f"{name}{r}", turn2, device, resume=loaded)
            first_tokens.add(tok)
            times[name].append(t2 - t0 + t)
            times["lookup"].append(t1 - t0)
            times[f"load_{name}"].append(t2 - t1)
            del loaded, eng
    store.device_checks = True
    if args.profile_load:  # where one direct load's time goes, by function (host side)
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        _sync(device)
        prof.enable()
        store.load_state(turn2, state.position, hasher, src_layout, contiguous=True, device=device)
        _sync(device)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(22)
        with open(f"{args.profile_load}_{context}.txt", "w") as f:
            f.write(text.getvalue())
    assert len(first_tokens) == 1, f"resumed and recomputed first tokens differ: {first_tokens}"
    med = {k: _median_ms(v) for k, v in times.items()}
    fig.update({f"{k}_ms": v for k, v in med.items()})
    fig["reps_ms"] = {k: [round(1000 * x, 1) for x in v] for k, v in times.items()}
    for k in names[1:]:
        fig[f"speedup_{k}"] = round(med["recompute"] / med[k], 2)
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", default="8192,32768")
    ap.add_argument("--followup", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--budget-mb", type=int, default=30000)
    ap.add_argument("--io-threads", type=int, default=0, help="the store's I/O threads (0: its default)")
    ap.add_argument("--profile-load", help="write a cProfile of one direct load per context to PREFIX_<context>.txt")
    ap.add_argument("--ab", action="store_true",
                    help="also time direct loads checked on the host, and resumes without CUDA graphs")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = K3ForCausalLM.random_init(load_preset(args.preset), seed=0, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    ttft(make_engine(model, args.device, args.budget_mb, args.chunk), "warm", _ids(512, 0, 300), args.device)
    out = {"preset": args.preset, "device": args.device, "torch": torch.__version__,
           "crc": checksum.NAMES[checksum.WRITE_ALGO], "cpus": os.cpu_count(), "contexts": []}
    if args.device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name()
    for c in [int(x) for x in args.context.split(",") if x]:
        fig = run_context(model, args, c)
        out["contexts"].append(fig)
        print(json.dumps(fig), flush=True)
        print(f"@{c}: recompute {fig['recompute_ms']} ms | memory {fig['memory_ms']} ({fig['speedup_memory']}x) | "
              f"staged {fig['staged_ms']} ({fig['speedup_staged']}x; load {fig['load_staged_ms']}) | "
              f"direct {fig['direct_ms']} ({fig['speedup_direct']}x; load {fig['load_direct_ms']}) | "
              f"lookup {fig['lookup_ms']} | crc1 {fig['crc32c_1thread_ms']} memcpy {fig['memcpy_ms']} "
              f"pin-alloc {fig.get('pinned_alloc_fresh_ms')} h2d {fig.get('h2d_pinned_ms')}", flush=True)
        if args.ab:
            print(f"@{c} A/B: direct, host checks {fig['direct_host_checks_ms']} ms ({fig['speedup_direct_host_checks']}x;"
                  f" load {fig['load_direct_host_checks_ms']}) | direct, no graphs {fig['direct_eager_ms']} "
                  f"({fig['speedup_direct_eager']}x) | memory, no graphs {fig['memory_eager_ms']} "
                  f"({fig['speedup_memory_eager']}x)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
