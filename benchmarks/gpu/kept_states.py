"""What the reference engine's kept KDA states cost a device: memory against the cache budget, the
next turns they resume, and the time to keep and read one (engine NOTE 10).

    python benchmarks/gpu/kept_states.py --out OUT [--device cuda] [--preset small] [--budget-mb 1024,2560]
        [--sessions 40,80,120]
    PYTHONPATH=OLD_TREE python benchmarks/gpu/kept_states.py --out OUT_OLD ...   # an older engine, same run

Replay: ``--sessions`` sessions of one ``--prompt-tokens`` prompt each, ``--concurrency`` at a time,
then every session's next turn (its prompt, its reply and 64 new tokens), in the same order,
through one ``ReferenceEngine`` per ``--budget-mb`` of cache. Printed per point: the memory the
engine holds past its budget (``torch.cuda.memory_allocated`` after the replay and its peak, less
what the weights took, less the budget: kept states an engine keeps outside its pool show here; on a
CPU the process's resident set after the replay, less before the engine),
the resident sessions and evictions, and the share of the next turns' prompts resumed on the device
(``device_hit_tokens``). A short replay first, not reported, takes the model's one-time
allocations (``--no-warmup``: the first point carries them). Run under the engine to compare with
(``PYTHONPATH``): the script reads only what every version reports.

Micro: keeping one state (slot -> pages, ``PagedStateCache.save_state``) and reading it back into a
slot (``load_state``), against the per-layer tensor copies an engine that keeps states outside its
pool makes (``clone`` per layer, ``copy_`` per layer), for the preset's layout and the full-size
preset's (``kimi-linear-48b``), median of ``--reps`` timed calls after a warm-up (CUDA events).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from disagg.engine.factory import layout_for
from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.engine.reference.config import load_preset
from disagg.engine.reference.engine import EngineOptions, ReferenceEngine
from disagg.engine.reference.model import K3ForCausalLM
from disagg.engine.reference.paged_cache import PagedStateCache, size_cache


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _allocated(device: str) -> int:
    """Bytes the device holds: CUDA's allocated memory, or on a CPU the process's resident set (Linux;
    the pool's pages count once written, as a filled cache's are)."""
    if device.startswith("cuda"):
        return torch.cuda.memory_allocated()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def replay(model, args, sessions: int, budget_mb: int) -> dict:
    dev = args.device
    gc.collect()  # the last point's engine
    _sync(dev)
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = _allocated(dev)  # the weights (and whatever the process held before the engine)
    eng = ReferenceEngine(model, f"{args.preset}-kept", EngineOptions(
        block_size=64, max_num_seqs=args.concurrency, max_num_batched_tokens=args.chunk,
        cache_budget_bytes=budget_mb << 20))
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(sessions)]
    sp = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = _run(eng, [(f"t1-{i}", p) for i, p in enumerate(prompts)], sp, args.concurrency)
    hits0 = eng.counters["device_hit_tokens"]
    turn2 = [(f"t2-{i}", p + outs[f"t1-{i}"] + torch.randint(3, vocab, (64,), generator=g).tolist())
             for i, p in enumerate(prompts)]
    _run(eng, turn2, sp, args.concurrency)
    _sync(dev)
    wall = time.perf_counter() - t0
    held = _allocated(dev) - base
    peak = (torch.cuda.max_memory_allocated() - base) if dev.startswith("cuda") else 0
    st = eng.stats()
    reachable = sum(len(p) + args.output_tokens - 1 for p in prompts)  # each turn 1's computed tokens
    row = {"sessions": sessions, "budget_mb": budget_mb, "held_mb": held / 2**20, "peak_mb": peak / 2**20,
           "over_budget_mb": (held - (budget_mb << 20)) / 2**20,
           "peak_over_budget_mb": (peak - (budget_mb << 20)) / 2**20 if peak else 0.0,
           "resident_sessions": st["resident_sessions"], "resident_evictions": st["resident_evictions"],
           "next_turn_device_hit": (eng.counters["device_hit_tokens"] - hits0) / reachable,
           "checkpoint_blocks": st.get("checkpoint_blocks"), "num_blocks": st["num_blocks"],
           "checkpoints_dropped": st.get("checkpoints_dropped"),
           "checkpoints_unbudgeted": st.get("checkpoints_unbudgeted"), "wall_s": wall}
    del eng
    return row


def _run(eng, reqs: list[tuple[str, list[int]]], sp: SamplingParams, width: int) -> dict[str, list[int]]:
    """Every request to its end, ``width`` at a time, in order."""
    out: dict[str, list[int]] = {}
    todo = list(reqs)
    live = 0
    while todo or eng.has_work():
        while todo and live < width:
            rid, p = todo.pop(0)
            eng.add_request(EngineRequest(rid, p, sp))
            live += 1
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            live -= o.finished
    return out


def micro(preset: str, dtype: torch.dtype, device: str, reps: int) -> dict:
    """One kept state's keep and read-back, pages against per-layer tensors (ms)."""
    layout = layout_for(load_preset(preset), "m", 64, str(dtype).removeprefix("torch."))  # no weights
    geo = size_cache(layout, max(4 * layout.kda_checkpoint_bytes(), 64 << 20) + 2 * layout.kda_checkpoint_bytes()
                     + 200 * layout.mla_block_bytes(), 2)
    cache = PagedStateCache(layout, geo, device)
    cache.rec_all.normal_()
    cache.conv_all.normal_()
    pages = cache.blocks.allocate(geo.checkpoint_pages)
    kept: list = []

    def clone():  # an engine that keeps states outside its pool
        kept[:] = [[c[0].clone() for c in cache.conv], [r[0].clone() for r in cache.rec]]

    def copy_back():
        for dst, src in zip(cache.conv, kept[0], strict=True):
            dst[1].copy_(src)
        for dst, src in zip(cache.rec, kept[1], strict=True):
            dst[1].copy_(src)

    variants = {"keep_pages": lambda: cache.save_state(cache.conv_all[:, 0], cache.rec_all[:, 0], pages),
                "keep_tensors": clone,
                "load_pages": lambda: cache.load_state(pages, 1),
                "load_tensors": copy_back}
    out = {"preset": preset, "state_mb": layout.kda_checkpoint_bytes() / 2**20, "pages": geo.checkpoint_pages,
           "page_kb": geo.block_bytes / 1024}
    for name, fn in variants.items():
        fn()
        _sync(device)
        times = []
        for _ in range(reps):
            if device.startswith("cuda"):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        out[f"{name}_ms"] = statistics.median(times)
    cache.save_state(cache.conv_all[:, 0], cache.rec_all[:, 0], pages)
    cache.load_state(pages, 1)
    out["exact"] = bool(torch.equal(cache.rec_all[:, 0], cache.rec_all[:, 1])
                        and torch.equal(cache.conv_all[:, 0], cache.conv_all[:, 1]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget-mb", default="1024", help="comma-separated cache budgets (MiB), one replay each")
    ap.add_argument("--sessions", default="40,80,120", help="comma-separated session counts, one replay each")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="measure the first point with the model's one-time allocations in it")
    ap.add_argument("--micro-only", action="store_true")
    ap.add_argument("--replay-only", action="store_true")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    res: dict = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                 "engine_has_pages": hasattr(PagedStateCache, "save_state"), "args": vars(args)}
    if not args.micro_only:
        model = K3ForCausalLM.random_init(load_preset(args.preset), seed=0, dtype=dtype).to(args.device).eval()
        res["replay"] = []
        if args.warmup:  # the model's one-time allocations (CUDA graph pools, workspaces): not a point's
            replay(model, args, min(args.concurrency, 4), int(args.budget_mb.split(",")[0]))
        points = [(b, n) for b in map(int, args.budget_mb.split(",")) for n in map(int, args.sessions.split(","))]
        for budget, n in points:
            row = replay(model, args, n, budget)
            res["replay"].append(row)
            print(f"{n:>4} sessions, budget {budget} MiB: held {row['held_mb']:.0f} MiB "
                  f"(over budget {row['over_budget_mb']:+.0f}), peak over budget {row['peak_over_budget_mb']:+.0f} MiB; "
                  f"residents {row['resident_sessions']}, evictions {row['resident_evictions']}; next turns resumed "
                  f"on the device {row['next_turn_device_hit']:.3f}; kept-state pages {row['checkpoint_blocks']} of "
                  f"{row['num_blocks']}, dropped {row['checkpoints_dropped']}, unbudgeted "
                  f"{row['checkpoints_unbudgeted']}; {row['wall_s']:.1f} s", flush=True)
        del model
    if not args.replay_only and res["engine_has_pages"]:
        res["micro"] = [micro(p, dtype, args.device, args.reps) for p in (args.preset, "kimi-linear-48b")]
        for m in res["micro"]:
            print(f"{m['preset']}: one state {m['state_mb']:.1f} MiB in {m['pages']} pages of {m['page_kb']:.0f} KiB; "
                  f"keep pages {m['keep_pages_ms']:.3f} ms vs tensors {m['keep_tensors_ms']:.3f} ms; "
                  f"load pages {m['load_pages_ms']:.3f} ms vs tensors {m['load_tensors_ms']:.3f} ms; "
                  f"exact {m['exact']}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
