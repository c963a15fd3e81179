"""Reference engine figures: prefill / decode throughput and resume vs recompute.

    python benchmarks/engine_bench.py                       # CPU, tiny preset
    python benchmarks/engine_bench.py --device cuda --preset small --prefill-lens 8192,32768 \
        --decode-batches 1,16,64 --context 32768

Prints a table; every ratio is measured against a baseline in the same run.
Resume vs recompute: TTFT of a follow-up turn (``--followup`` new tokens) on a
``--context``-token conversation when its state is imported (from memory, and
through the host tier with checksums when kv_transfer's store is available)
against recomputing the whole conversation.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.engine.reference.config import load_preset
from disagg.engine.reference.engine import EngineOptions, ReferenceEngine
from disagg.engine.reference.model import K3ForCausalLM


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 259), (n,), generator=g).tolist()


def make_engine(model, device: str, budget_mb: int, chunk: int, **kw) -> ReferenceEngine:
    gc.collect()  # drop the previous engine's cache before sizing a new one
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    opts = EngineOptions(block_size=64, max_num_seqs=max(64, kw.pop("max_num_seqs", 64)),
                         max_num_batched_tokens=chunk, cache_budget_bytes=budget_mb << 20, **kw)
    return ReferenceEngine(model, "bench", opts)


def ttft(engine: ReferenceEngine, rid: str, prompt: list[int], device: str, **kw) -> tuple[float, int]:
    _sync(device)
    t0 = time.perf_counter()
    out, last = engine.generate(EngineRequest(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True), **kw))
    _sync(device)
    return time.perf_counter() - t0, out[0]


def bench_prefill(model, device, budget_mb, chunk, length, reps) -> float:
    times = []
    for r in range(reps):
        eng = make_engine(model, device, budget_mb, chunk, resident_sessions=False)
        t, _ = ttft(eng, f"p{r}", _ids(length, r, model.config.vocab_size), device)
        times.append(t)
    return length / statistics.median(times)


def _moe_nonzero_loop(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Baseline for ``--moe-ab``: the routed experts' loop as it was, one ``nonzero`` (a host wait) per expert."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=weights.dtype, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        out.index_add_(0, tok, self.experts[e](x[tok]).to(out.dtype) * weights[tok, slot].unsqueeze(-1))
    return out


def bench_prefill_moe_ab(model, device, budget_mb, chunk, length, reps) -> dict:
    """Prefill tok/s with the MoE grouped by one sort (moe NOTE 4) against the per-expert
    ``nonzero`` loop, interleaved rep by rep; the first tokens must agree."""
    from disagg.engine.reference.moe import SparseMoE

    grouped = SparseMoE._grouped
    times: dict[str, list[float]] = {"grouped": [], "nonzero": []}
    first = set()
    try:
        for r in range(reps):
            for name, fn in (("nonzero", _moe_nonzero_loop), ("grouped", grouped))[:: 1 if r % 2 else -1]:
                SparseMoE._grouped = fn
                eng = make_engine(model, device, budget_mb, chunk, resident_sessions=False)
                t, tok = ttft(eng, f"ab{r}{name}", _ids(length, r, model.config.vocab_size), device)
                times[name].append(t)
                first.add((r, tok))
    finally:
        SparseMoE._grouped = grouped
    assert len(first) == reps, "the two MoE loops sampled different first tokens"
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"grouped_tok_s": round(length / med["grouped"], 1), "nonzero_tok_s": round(length / med["nonzero"], 1),
            "speedup": round(med["nonzero"] / med["grouped"], 3)}


def decoding_engine(model, device, budget_mb, chunk, batch, context, max_tokens, **kw) -> ReferenceEngine:
    """An engine with ``batch`` sequences of ``context`` tokens, prefilled: its next step decodes them all."""
    eng = make_engine(model, device, budget_mb, max(chunk, batch), resident_sessions=False, max_num_seqs=batch, **kw)
    for i in range(batch):
        eng.add_request(EngineRequest(f"d{i}", _ids(context, i, model.config.vocab_size),
                                      SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    while any(len(r.token_ids) == r.num_prompt for r in eng._running) or eng._waiting:  # finish prefills
        eng.step()
    return eng


def bench_decode(model, device, budget_mb, chunk, batch, context, steps, graphs: bool = True,
                 decode_graphs: bool = True) -> float:
    """Median decode step time (s) with ``batch`` sequences at ``context`` tokens."""
    eng = decoding_engine(model, device, budget_mb, chunk, batch, context, steps + 8, cuda_graphs=graphs,
                          decode_graphs=decode_graphs)
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        eng.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:] if len(times) > 4 else times)


def bench_resume(model, device, budget_mb, chunk, context, followup, reps) -> dict:
    vocab = model.config.vocab_size
    first = _ids(context, 7, vocab)
    src = make_engine(model, device, budget_mb, chunk)
    out, _ = src.generate(EngineRequest("t1", first, SamplingParams(max_tokens=1, ignore_eos=True), keep_state=True))
    state = src.export_state("t1")
    turn2 = first + out + _ids(followup, 8, vocab)
    res: dict[str, list[float]] = {"recompute": [], "resume_memory": [], "resume_host_tier": [],
                                   "resume_host_tier_staged": []}
    nbytes = sum(b.rows.nbytes for b in state.mla_blocks) + sum(k.conv.nbytes + k.recurrent.nbytes for k in state.kda)
    store = _store(src.layout, nbytes + (state.tail.rows.nbytes if state.tail else 0))
    hasher = None
    if store is not None:
        store.warm(device)  # as a serving worker does at start: not in the first rep's load
        from kv_transfer.keys import BlockHasher, KeyExtras

        hasher = BlockHasher(64, KeyExtras("bench"))
        store.put_state(src.computed_tokens("t1"), state, hasher)
    tok = {}
    # untimed: the follow-up's graph bucket is captured here, not in the first timed rep
    ttft(make_engine(model, device, budget_mb, chunk, resident_sessions=False), "warm-resume", turn2, device,
         resume=state)
    for r in range(reps):
        t, tok["recompute"] = ttft(make_engine(model, device, budget_mb, chunk, resident_sessions=False),
                                   f"r{r}", turn2, device)
        res["recompute"].append(t)
        t, tok["resume_memory"] = ttft(make_engine(model, device, budget_mb, chunk, resident_sessions=False),
                                       f"m{r}", turn2, device, resume=state)
        res["resume_memory"].append(t)
        # through the host tier: rows straight to the device (kv_transfer.direct), and through
        # host staging (the CPU path), one after the other
        variants = [("resume_host_tier", device if device.startswith("cuda") else None)]
        if device.startswith("cuda"):
            variants.append(("resume_host_tier_staged", None))
        for name, to_device in variants if store is not None else []:
            eng = make_engine(model, device, budget_mb, chunk, resident_sessions=False)
            gc.collect()  # the previous variant's buffers go back to torch's caches first
            _sync(device)
            t0 = time.perf_counter()
            point = store.resumable_length(turn2, hasher, max_position=len(turn2) - 1)
            loaded = store.load_state(turn2, point.position, hasher, eng.layout, contiguous=True, device=to_device)
            assert loaded is not None and point.position == state.position
            t_load = time.perf_counter() - t0
            t, tok[name] = ttft(eng, f"h{r}{name}", turn2, device, resume=loaded)
            res[name].append(t_load + t)
            del loaded
    assert len(set(tok.values())) == 1, f"resumed and recomputed first tokens differ: {tok}"
    med = {k: statistics.median(v) for k, v in res.items() if v}
    return {"context": context, "followup": followup, **{f"ttft_{k}_ms": 1000 * v for k, v in med.items()},
            **{f"speedup_{k}": med["recompute"] / v for k, v in med.items() if k != "recompute"}}


def profile_resume(model, device, budget_mb, chunk, context, followup, path: str) -> None:
    """torch.profiler table of one resumed follow-up (where the resumed TTFT goes)."""
    from torch.profiler import ProfilerActivity, profile

    vocab = model.config.vocab_size
    first = _ids(context, 7, vocab)
    src = make_engine(model, device, budget_mb, chunk)
    out, _ = src.generate(EngineRequest("t1", first, SamplingParams(max_tokens=1, ignore_eos=True), keep_state=True))
    state = src.export_state("t1")
    turn2 = first + out + _ids(followup, 8, vocab)
    del src
    for i in range(2):  # the second one is profiled (kernels compiled and autotuned by the first)
        eng = make_engine(model, device, budget_mb, chunk, resident_sessions=False)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        with profile(activities=acts, with_stack=True,
                     experimental_config=torch._C._profiler._ExperimentalConfig(verbose=True)) as prof:
            ttft(eng, f"p{i}", turn2, device, resume=state)
    table = _write_profile(prof, device, path)
    print(table, flush=True)


def profile_decode(model, device, budget_mb, chunk, batch, context, path: str) -> None:
    """torch.profiler table of one decode step of ``batch`` sequences at ``context`` tokens."""
    from torch.profiler import ProfilerActivity, profile

    eng = decoding_engine(model, device, budget_mb, chunk, batch, context, 16)
    for _ in range(3):
        eng.step()
    _sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts, with_stack=True) as prof:
        eng.step()
        _sync(device)
    _write_profile(prof, device, path)


def _write_profile(prof, device: str, path: str) -> str:
    key = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25)
    cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    # where the host waits for the device and copies small tensors, by Python call site
    waits = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "aten::_to_copy", "aten::item",
             "aten::_local_scalar_dense", "aten::nonzero"}
    sites = sorted((e for e in prof.key_averages(group_by_stack_n=6) if e.key in waits),
                   key=lambda e: e.self_cpu_time_total, reverse=True)
    lines = [f"{e.count:5d} x {e.key:<28} self CPU {e.self_cpu_time_total / 1e3:8.2f} ms  <- "
             + " | ".join(fr for fr in (e.stack or [])[:6]) for e in sites[:40]]
    ops = sorted(prof.key_averages(), key=lambda e: e.count, reverse=True)
    n_aten = sum(e.count for e in ops if e.key.startswith("aten::"))
    launches = sum(e.count for e in ops if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel"))
    head = f"aten ops {n_aten}, kernel launches {launches}\n"
    with open(path, "w") as f:
        f.write(head + table + "\n\n" + cpu + "\n\nhost waits and small copies by call site (count, op, self CPU, "
                "stack):\n" + "\n".join(lines) + "\n")
    return table


def _store(layout, nbytes: int):
    try:
        from kv_transfer.store import StateStore
        from kv_transfer.tiers.host import HostTier
    except ImportError:
        return None
    cap = max(256 << 20, 2 * nbytes)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * cap else None
    host = HostTier(cap, arena_dir=shm or tempfile.gettempdir(), pin_memory=torch.cuda.is_available())
    return StateStore([host], layout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--budget-mb", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--prefill-lens", default="1024,4096")
    ap.add_argument("--decode-batches", default="1,16")
    ap.add_argument("--decode-context", type=int, default=512)
    ap.add_argument("--context", default="4096", help="resume-vs-recompute context lengths (comma list)")
    ap.add_argument("--followup", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--profile-resume", help="write a profiler table of one resumed follow-up at the first --context")
    ap.add_argument("--profile-decode", help="write a profiler table of one decode step at the first --decode-batches")
    ap.add_argument("--graphs-ab", action="store_true", help="also time each decode batch without CUDA graphs, and with the token-wise graphs only")
    ap.add_argument("--moe-ab", action="store_true",
                    help="also time each --prefill-lens with the former per-expert nonzero MoE loop (same run)")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = K3ForCausalLM.random_init(load_preset(args.preset), seed=0, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    figures: dict = {"preset": args.preset, "device": args.device, "dtype": args.dtype,
                     "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
                     "torch": torch.__version__, "threads": torch.get_num_threads()}
    ttft(make_engine(model, args.device, args.budget_mb, args.chunk), "warm", _ids(256, 0, 300), args.device)
    for n in [int(x) for x in args.prefill_lens.split(",") if x]:
        figures[f"prefill_tok_s_{n}"] = round(bench_prefill(model, args.device, args.budget_mb, args.chunk, n,
                                                            args.reps), 1)
        print(f"prefill {n:>6} tokens: {figures[f'prefill_tok_s_{n}']:>10.1f} tok/s", flush=True)
        if args.moe_ab:
            ab = figures[f"prefill_moe_ab_{n}"] = bench_prefill_moe_ab(model, args.device, args.budget_mb,
                                                                      args.chunk, n, args.reps)
            print(f"prefill {n:>6} tokens, MoE grouped vs nonzero loop: {ab['grouped_tok_s']:.1f} vs "
                  f"{ab['nonzero_tok_s']:.1f} tok/s ({ab['speedup']:.3f}x)", flush=True)
    for b in [int(x) for x in args.decode_batches.split(",") if x]:
        step = bench_decode(model, args.device, args.budget_mb, args.chunk, b, args.decode_context, 12)
        figures[f"decode_step_ms_b{b}"] = round(1000 * step, 3)
        figures[f"decode_tok_s_b{b}"] = round(b / step, 1)
        print(f"decode batch {b:>3} @ {args.decode_context} ctx: step {1000 * step:8.2f} ms  "
              f"{b / step:10.1f} tok/s", flush=True)
        if args.graphs_ab:
            eager = bench_decode(model, args.device, args.budget_mb, args.chunk, b, args.decode_context, 12,
                                 graphs=False)
            figures[f"decode_step_ms_b{b}_no_graphs"] = round(1000 * eager, 3)
            print(f"decode batch {b:>3} @ {args.decode_context} ctx, no CUDA graphs: step {1000 * eager:8.2f} ms "
                  f"({eager / step:.2f}x the step with graphs)", flush=True)
            piece = bench_decode(model, args.device, args.budget_mb, args.chunk, b, args.decode_context, 12,
                                 decode_graphs=False)
            figures[f"decode_step_ms_b{b}_piecewise"] = round(1000 * piece, 3)
            print(f"decode batch {b:>3} @ {args.decode_context} ctx, token-wise graphs only (mixing eager): step "
                  f"{1000 * piece:8.2f} ms ({piece / step:.2f}x the whole-step graph)", flush=True)
    for c in [int(x) for x in args.context.split(",") if x]:
        r = bench_resume(model, args.device, args.budget_mb, args.chunk, c, args.followup, args.reps)
        figures[f"resume_{c}"] = r
        line = "  ".join(f"{k}={v:.1f}" for k, v in r.items() if isinstance(v, float))
        print(f"resume vs recompute @ {c}: {line}", flush=True)
    if args.profile_resume:
        ctx = int(args.context.split(",")[0])
        profile_resume(model, args.device, args.budget_mb, args.chunk, ctx, args.followup, args.profile_resume)
    if args.profile_decode:
        b = int(args.decode_batches.split(",")[0])
        profile_decode(model, args.device, args.budget_mb, args.chunk, b, args.decode_context, args.profile_decode)
    print(json.dumps(figures, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
