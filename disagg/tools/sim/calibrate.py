"""Calibration: engine profiles from timing the reference engine, from saved figures, from bench runs.

Three sources, one output (an ``EngineProfile``, see ``disagg.costs.profile``):

- ``time_engine``: the reference engine timed in this process. A prefill
  point is one request of n new tokens after ctx resumed tokens (the state
  of ctx tokens imported, as a host-tier hit is); a decode point is the
  median step of ``batch`` sequences at ``context`` tokens (their state
  imported, so no long prefills are needed to set them up); the host tier
  is timed with kv_transfer's ``StateStore`` (put + get of real states), and
  two engines in two processes at once give the node's compute slots
  (``limits.node_compute_slots``: replicas of one CPU machine share its cores).
- ``from_engine_bench``: the JSON that ``benchmarks/engine_bench.py`` writes
  (e.g. docs/perf/h200-2026-11-29/engine_fla.json, with transfer.json).
- ``from_bench_runs``: the saved requests of ``disagg bench`` runs (one
  ``runs/<label>/requests.jsonl`` per run). Requests that ran alone (no
  other request in flight during their TTFT / decode) are fitted::

      TTFT = o + o_d * remote + s_p * prefill_engine(n, ctx)       n = prompt - cached, ctx = cached
      ITL  = s_d * decode_engine(1, prompt + output / 2)

  against a base profile (the engine timed alone): o is the serving path's
  overhead, o_d the extra of a remote (disaggregated) prefill, s_p and s_d
  how much slower the engine runs inside the serving processes. Without a
  base profile the engine terms are fitted directly. These fits minimize
  absolute error (unlike the profile fit's relative error): a serving run is
  noisy, and the simulator should reproduce its means.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from disagg.costs.profile import DecodePoint, EngineProfile, PrefillPoint, nnls_relative

DEFAULT_PREFILL_GRID = ((64, 0), (256, 0), (1024, 0), (64, 1024), (256, 1024), (1024, 1024))
DEFAULT_DECODE_GRID = ((1, 256), (1, 1024), (4, 256), (4, 1024), (16, 256), (16, 1024))


# ---- timing the reference engine ---------------------------------------------------------
def _ids(n: int, seed: int, vocab: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 259), (n,), generator=g).tolist()


def time_engine(
    preset: str = "tiny",
    *,
    dtype: str = "float32",
    device: str = "cpu",
    threads: int = 1,
    block_size: int = 64,
    max_num_batched_tokens: int = 1024,
    max_num_seqs: int = 16,
    cache_budget_mb: int = 256,
    prefill_grid: tuple[tuple[int, int], ...] = DEFAULT_PREFILL_GRID,
    decode_grid: tuple[tuple[int, int], ...] = DEFAULT_DECODE_GRID,
    reps: int = 3,
    decode_steps: int = 8,
    host_sizes: tuple[int, int] = (256, 4096),
    parallel_check: bool = True,
    progress: bool = True,
) -> EngineProfile:
    """Time the reference engine (one process, ``threads`` torch threads); a ``measured`` profile."""
    import torch

    from disagg.config import ModelConfig
    from disagg.engine.factory import load_reference_model
    from disagg.engine.protocol import EngineRequest, SamplingParams
    from disagg.engine.reference.engine import EngineOptions, ReferenceEngine

    torch.set_num_threads(threads)
    model, model_id = load_reference_model(ModelConfig(name=preset, dtype=dtype, device=device))
    vocab = model.config.vocab_size

    def engine(seqs: int = max_num_seqs) -> ReferenceEngine:
        opts = EngineOptions(block_size=block_size, max_num_seqs=max(seqs, 1), max_num_batched_tokens=max_num_batched_tokens,
                             cache_budget_bytes=cache_budget_mb << 20, resident_sessions=False)
        return ReferenceEngine(model, model_id, opts)

    def state_of(tokens: list[int]):
        eng = engine(1)
        eng.generate(EngineRequest("s", tokens, SamplingParams(max_tokens=1, ignore_eos=True), keep_state=True))
        return eng.export_state("s")

    def log(msg: str) -> None:
        if progress:
            print(msg, flush=True)

    engine().generate(EngineRequest("warm", _ids(32, 0, vocab), SamplingParams(max_tokens=2, ignore_eos=True)))
    prefill: list[PrefillPoint] = []
    for n, ctx in prefill_grid:
        base = _ids(ctx + n, 1 + ctx, vocab)
        state = state_of(base[:ctx]) if ctx else None
        times = []
        for r in range(reps):
            eng = engine(1)
            t0 = time.perf_counter()
            eng.generate(EngineRequest(f"p{r}", base, SamplingParams(max_tokens=1, ignore_eos=True), resume=state))
            times.append(time.perf_counter() - t0)
        prefill.append(PrefillPoint(n, ctx, min(times)))
        log(f"prefill {n:>6} new after {ctx:>6}: {1000 * prefill[-1].seconds:9.1f} ms")
    decode: list[DecodePoint] = []
    for batch, ctx in decode_grid:
        prompt = _ids(ctx, 7 + ctx, vocab)
        state = state_of(prompt)
        eng = engine(batch)
        for i in range(batch):
            eng.add_request(EngineRequest(f"d{i}", prompt + [5 + i % 200], SamplingParams(max_tokens=decode_steps + 4,
                                                                                       ignore_eos=True), resume=state))
        started: set[str] = set()
        while len(started) < batch:  # every sequence has its first token: the batch is decoding
            started.update(o.request_id for o in eng.step() if o.new_token_ids)
        times = []
        for _ in range(decode_steps):
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
        decode.append(DecodePoint(batch, ctx, min(times[1:] if len(times) > 2 else times)))
        log(f"decode batch {batch:>3} at {ctx:>6}: {1000 * decode[-1].seconds:9.2f} ms/step")
    host, state = _time_host_tier(state_of, vocab, block_size, host_sizes)
    slots = _parallel_slots(lambda: engine(1).generate(EngineRequest(
        "par", _ids(256, 5, vocab), SamplingParams(max_tokens=1, ignore_eos=True)))) if parallel_check else None
    if slots is not None:
        log(f"two engines at once run at {slots / 2:.2f} of one alone: {slots:.2f} compute slots")
    mla_bytes = sum(b.rows.nbytes for b in state.mla_blocks) / max(len(state.mla_blocks) * block_size, 1)
    kda_bytes = sum(k.conv.nbytes + k.recurrent.nbytes for k in state.kda)
    log(f"host tier: {host['gbps']:.2f} GB/s, {1e3 * host['latency_s']:.2f} ms per state")
    return EngineProfile(
        f"{'cpu' if device == 'cpu' else device}-{preset}",
        {"kind": "measured", "command": f"disagg sim calibrate --engine {preset} --threads {threads}",
         "date": dt.date.today().isoformat(), "machine": f"{platform.machine()} {device}, torch {torch.__version__}",
         "notes": [f"reference engine, {preset} preset, {dtype}, {threads} torch thread(s); block {block_size}, "
                   f"{max_num_batched_tokens} tokens per step; fastest of {reps} runs / {decode_steps} steps "
                   "(on a shared machine the fastest run is the engine's own cost; a bench fit scales it)"]},
        model=preset, hardware=device, block_size=block_size, prefill=prefill, decode=decode,
        transfer={"host": host},
        state={"bytes_per_token": float(mla_bytes), "checkpoint_bytes": float(kda_bytes)},
        limits={"max_prefill_tokens_per_step": max_num_batched_tokens, "max_decode_batch": max_num_seqs,
                **({"node_compute_slots": round(slots, 3)} if slots is not None else {})},
        description=f"reference engine ({preset}) timed on {device}",
    )


def _parallel_slots(work, reps: int = 3) -> float:
    """Engines this machine runs at full speed at once: 2 x (time of ``work`` alone) / (time of two at once).

    Two forked processes run ``work`` together (one torch thread each, as two replicas of one node
    do); on a machine with spare cores the result is ~2, on a loaded one less.
    """
    import multiprocessing as mp

    _PARALLEL["work"] = work  # forked children find it here
    try:
        work()
        alone = min(_timed(1) for _ in range(reps))
        with mp.get_context("fork").Pool(2) as pool:
            together = max(pool.map(_timed, [reps, reps]))
    finally:
        _PARALLEL.clear()
    return max(0.5, min(2.0, 2 * alone / together))


_PARALLEL: dict[str, Any] = {}


def _timed(n: int) -> float:
    work = _PARALLEL["work"]
    t0 = time.perf_counter()
    for _ in range(n):
        work()
    return (time.perf_counter() - t0) / n


def _time_host_tier(state_of, vocab: int, block_size: int, sizes: tuple[int, int]) -> tuple[dict[str, float], Any]:
    """Put + load of real states through kv_transfer's host tier: ({latency, GB/s} from two sizes, the last state)."""
    import tempfile

    from kv_transfer.keys import BlockHasher, KeyExtras
    from kv_transfer.store import StateStore
    from kv_transfer.tiers.host import HostTier

    points = []
    for n in sizes:
        tokens = _ids(n, 11 + n, vocab)
        state = state_of(tokens)
        nbytes = sum(b.rows.nbytes for b in state.mla_blocks) + sum(k.conv.nbytes + k.recurrent.nbytes
                                                                  for k in state.kda)
        times = []
        for r in range(3):
            store = StateStore([HostTier(max(64 << 20, 4 * nbytes), arena_dir=tempfile.gettempdir(),
                                         pin_memory=False)], state.layout)
            hasher = BlockHasher(block_size, KeyExtras(f"calib{r}"))
            t0 = time.perf_counter()
            store.put_state(tokens, state, hasher)
            loaded = store.load_state(tokens, state.position, hasher, state.layout)
            times.append(time.perf_counter() - t0)
            assert loaded is not None, "host tier lost a state"
        points.append((nbytes, statistics.median(times)))
    (b0, t0_), (b1, t1) = points
    if t1 > t0_:  # a fixed cost per state plus bytes / bandwidth
        inv_bw = (t1 - t0_) / (b1 - b0)
        return {"gbps": 1.0 / inv_bw / 1e9, "latency_s": max(t0_ - b0 * inv_bw, 0.0)}, state
    return {"gbps": b1 / t1 / 1e9, "latency_s": 0.0}, state  # noise hid the size effect: bandwidth only


# ---- saved engine_bench figures -------------------------------------------------------------
def from_engine_bench(path: str | Path, transfer: str | Path | None = None, name: str | None = None,
                      decode_context: int = 2048, block_size: int = 64, chunk: int = 8192) -> EngineProfile:
    """A profile from ``benchmarks/engine_bench.py --json`` output (and ``gpu_transfer_bench.py``'s JSON)."""
    path = Path(path)
    d = json.loads(path.read_text())
    prefill, decode = [], []
    for key, val in d.items():
        if key.startswith("prefill_tok_s_"):
            n = int(key.rsplit("_", 1)[1])
            prefill.append(PrefillPoint(n, 0, n / float(val)))
        elif key.startswith("decode_step_ms_b"):
            decode.append(DecodePoint(int(key[len("decode_step_ms_b"):]), decode_context, float(val) / 1000.0))
        elif key.startswith("resume_") and isinstance(val, dict) and "ttft_resume_memory_ms" in val:
            prefill.append(PrefillPoint(int(val["followup"]), int(val["context"]), val["ttft_resume_memory_ms"] / 1000))
    if not prefill or not decode:
        raise ValueError(f"{path}: no prefill_tok_s_* / decode_step_ms_b* figures")
    tr: dict[str, dict[str, float]] = {}
    if transfer is not None:
        t = json.loads(Path(transfer).read_text())
        gbps = min(t["mla"]["scatter_GBps"], t["kda"]["scatter_GBps"])
        tr["host"] = {"gbps": float(gbps), "latency_s": 50e-6}
    return EngineProfile(
        name or f"{d.get('device', 'dev')}-{d.get('preset', 'model')}",
        {"kind": "measured", "command": f"disagg sim calibrate --from-engine-bench {path.name}",
         "date": dt.date.today().isoformat(), "machine": str(d.get("device", "")),
         "notes": [f"converted from {path.name} ({d.get('preset')} preset, {d.get('dtype')}, torch {d.get('torch')}); "
                   f"decode steps measured at {decode_context} tokens of context; prefill with {chunk}-token chunks"]},
        model=str(d.get("preset", "")), hardware=str(d.get("device", "")), block_size=block_size,
        prefill=prefill, decode=decode, transfer=tr, limits={"max_prefill_tokens_per_step": chunk},
    )


# ---- bench runs -------------------------------------------------------------------------------
def load_bench_requests(paths: list[str | Path]) -> list[dict[str, Any]]:
    """Request rows of ``disagg bench`` results: a results dir (runs/*/), a run dir, or a requests.jsonl."""
    rows: list[dict[str, Any]] = []
    for p in map(Path, paths):
        files = ([p] if p.is_file() else sorted(p.glob("runs/*/requests.jsonl")) or sorted(p.glob("requests.jsonl")))
        if not files:
            raise ValueError(f"{p}: no requests.jsonl (expected a disagg bench results or run directory)")
        for f in files:
            for line in f.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    r["_run"] = str(f.parent)
                    rows.append(r)
    return rows


def _alone(rows: list[dict[str, Any]]) -> tuple[list[dict], list[dict]]:
    """(requests whose TTFT overlapped no other request, whose decode overlapped no other request)."""
    by_run: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("error") is None and (r.get("ttft_ms") or 0) > 0 and r.get("e2e_ms") is not None:
            by_run.setdefault(r["_run"], []).append(r)
    ttft_alone, decode_alone = [], []
    for rs in by_run.values():
        spans = [(r["send_s"], r["send_s"] + r["e2e_ms"] / 1000) for r in rs]
        for i, r in enumerate(rs):
            a, first, end = r["send_s"], r["send_s"] + r["ttft_ms"] / 1000, spans[i][1]
            others = [s for j, s in enumerate(spans) if j != i]
            if not any(s < first and e > a for s, e in others):
                ttft_alone.append(r)
            if (r.get("itl_ms") or 0) > 0 and not any(s < end and e > first for s, e in others):
                decode_alone.append(r)
    return ttft_alone, decode_alone


def from_bench_runs(paths: list[str | Path], base: EngineProfile | None = None,
                    local_prefill_max_tokens: int | None = None, name: str | None = None) -> EngineProfile:
    """A ``bench-fit`` profile from saved benchmark requests (see the module docstring)."""
    rows = [r for r in load_bench_requests(paths) if not r.get("warmup")]
    ttft_rows, dec_rows = _alone(rows)
    if len(ttft_rows) < 4:
        raise ValueError(f"only {len(ttft_rows)} requests ran alone: a calibration run needs concurrency 1 "
                         "(or long think times) and a few dozen requests")
    cm = base.cost_model() if base is not None else None
    n = np.array([r["prompt_tokens"] - (r.get("cached_tokens") or 0) for r in ttft_rows], np.float64)
    ctx = np.array([r.get("cached_tokens") or 0 for r in ttft_rows], np.float64)
    ttft = np.array([r["ttft_ms"] / 1000 for r in ttft_rows])
    remote = (n > local_prefill_max_tokens).astype(np.float64) if local_prefill_max_tokens is not None else np.zeros_like(n)
    coeff: dict[str, Any] = {}
    notes = [f"fitted on {len(ttft_rows)} requests that ran alone (TTFT) and {len(dec_rows)} (decode), "
             f"from {len({r['_run'] for r in rows})} run(s)"]
    if cm is not None:
        steps = np.array([1 + int(x) // max(cm.max_prefill_tokens_per_step, 1) for x in n])
        engine = np.array([cm.prefill_base_s * s + cm.prefill_job_time(int(a), int(b)) for s, a, b in zip(steps, n, ctx,
                                                                                                      strict=True)])
        cols = [np.ones_like(n), engine] + ([remote] if remote.any() and not remote.all() else [])
        sol = nnls_relative(np.column_stack(cols), ttft, relative=False)
        over, scale = float(sol[0]), float(sol[1])
        coeff.update(prefill_base_s=cm.prefill_base_s * scale, prefill_per_token_s=cm.prefill_per_token_s * scale,
                     prefill_attn_s=cm.prefill_attn_s * scale)
        dis = float(sol[2]) if len(sol) > 2 else 0.0
        notes.append(f"prefill runs {scale:.2f}x the base profile's time; serving overhead {1e3 * over:.0f} ms"
                     + (f", remote prefill +{1e3 * dis:.0f} ms" if len(sol) > 2 else ""))
    else:
        cols = [np.ones_like(n), n, n * (ctx + n / 2)] + ([remote] if remote.any() and not remote.all() else [])
        sol = nnls_relative(np.column_stack(cols), ttft, relative=False)
        over = float(sol[0])
        dis = float(sol[3]) if len(sol) > 3 else 0.0
        coeff.update(prefill_base_s=0.0, prefill_per_token_s=float(sol[1]), prefill_attn_s=float(sol[2]))
    pred = np.column_stack(cols) @ sol
    notes.append(f"TTFT fit: median |error| {100 * float(np.median(np.abs(pred - ttft) / ttft)):.1f}%")
    coeff.update(request_overhead_s=over, disagg_overhead_s=dis)
    if dec_rows:
        itl = np.array([r["itl_ms"] / 1000 for r in dec_rows])
        c = np.array([r["prompt_tokens"] + r["output_tokens"] / 2 for r in dec_rows], np.float64)
        if cm is not None:
            eng = np.array([cm.decode_step_time(1, int(x)) for x in c])
            s_d = float(nnls_relative(eng[:, None], itl, relative=False)[0])
            coeff.update(decode_base_s=cm.decode_base_s * s_d, decode_per_seq_s=cm.decode_per_seq_s * s_d,
                         decode_per_ctx_token_s=cm.decode_per_ctx_token_s * s_d)
            if cm.decode_batch_curve:
                coeff["decode_batch_curve"] = [(b, g * s_d) for b, g in cm.decode_batch_curve]
            notes.append(f"decode runs {s_d:.2f}x the base profile's step time")
        else:
            d, f = nnls_relative(np.column_stack([np.ones_like(c), c]), itl, relative=False)
            coeff.update(decode_base_s=float(d), decode_per_seq_s=0.0, decode_per_ctx_token_s=float(f))
    src_paths = ", ".join(str(p) for p in paths)
    prof = EngineProfile(
        name or (f"{base.name}-bench" if base is not None else "bench-fit"),
        {"kind": "bench-fit", "command": f"disagg sim calibrate --from-bench {src_paths}"
                                         + (f" --base {base.name}" if base is not None else ""),
         "date": dt.date.today().isoformat(), "notes": notes},
        model=base.model if base else "", hardware=base.hardware if base else "",
        gpus_per_worker=base.gpus_per_worker if base else 1, block_size=base.block_size if base else 64,
        prefill=list(base.prefill) if base else [], decode=list(base.decode) if base else [],
        transfer=dict(base.transfer) if base else {}, state=dict(base.state) if base else {},
        limits=dict(base.limits) if base else {}, memory=dict(base.memory) if base else {},
        coefficients=coeff, description="engine profile adjusted to a serving run's requests",
    )
    return prof
