"""Router benchmark: our state-aware router vs every baseline, in the simulator.

For 4, 16 and 64 aggregated workers (8 per node, shared host tier per node),
synthetic agentic sessions (shared system prompt, growing context, ~96%
consecutive-turn reuse) are replayed closed-loop with every policy. Printed
per policy: hit rate as a fraction of the infinite-cache theoretical reuse,
max/mean time-averaged queued prefill (see ``disagg.tools.sim.metrics``), P90 TTFT,
P90 ITL. Then decision latency of ``StateAwareRouter.route`` with 64 workers
and ~1M indexed blocks (wall and thread-CPU time of each call, p50 / p90 / p99
over 2000 calls; the walk's share; what the slowest 1% of calls spent their
time on: CPU, GC pauses, or neither, i.e. the process was not running).

Goals: >= 0.95 of theoretical reuse with max/mean <= 1.25 at 16 workers and a
lower P90 TTFT than every baseline; decision p99 <= 1 ms.

    python benchmarks/router_bench.py --out results/router_bench
    python benchmarks/router_bench.py --out results/router_bench --balance-seeds 1 2 3

``--balance-seeds`` also replays the 16-worker case with other workload seeds
and prints max/mean q per seed: with ~6 first turns per worker the figure
moves by +-0.1 from seed to seed (docs/router.md).

``--sessions-per-worker N`` sets the trace length at the same load (4
closed-loop lanes per worker; default 6, the figures of earlier rounds).
48 is the length chosen for the balance metric: the shortest of 6, 12, 24, 48
at which a clairvoyant placement's own max/mean averages <= 1.10 over seeds
0-7 (``benchmarks/router_balance_study.py``, docs/router.md):

    python benchmarks/router_bench.py --sessions-per-worker 48 --balance-seeds 1 2 3 4 5 6 7 \
        --out results/router_bench_48

``--latency-pd`` measures it with P/D pools instead (a quarter of the workers
prefill, the rest decode: the decode profile, the P/D decision and the
prefill profile per call).

``--latency-engine PROFILE`` measures a router priced with that engine's
figures (``disagg.router.calibration``; ``h200-small``'s decode batch curve is
interpolated per candidate) instead of the built-in constants.

``--latency-reps N`` repeats the decision-latency measurement N times over the
same index (the shared machine's load moves each repetition's p99; the median
over repetitions is printed with every repetition).

``--compare-ref GITREF`` measures decision latency only, as a same-process A/B
against the router committed at GITREF (its ``disagg/router`` files loaded as a
separate package): both versions get the same index, requests, worker stats and
simulated clock, alternate call by call, and every decision is compared field by
field; it prints p50 / p90 / p99 of thread CPU and wall per version and the ratios:

    python benchmarks/router_bench.py --compare-ref HEAD --latency-reps 2 --out results/router_ab

``--ray-replay`` instead replays a small synthetic agentic trace (the CPU-sized
trace of ``benchmarks/e2e_pareto.py``) on the local Ray cluster, once per Serve
request-router policy (``router.policy``: state_aware, power_of_two, affinity),
each on a fresh cluster running the embedded default
(``deployments/configs/local-cpu.yaml``) with two decode replicas, and prints
per policy: cache hit (usage) against the trace's infinite-cache hit, max/mean
over the decode replicas of the requests they served and of the prompt tokens
they computed (replica counters read before and after the run), P90 TTFT and, for
state_aware, the requests Serve ran elsewhere than the router's pick:

    python benchmarks/router_bench.py --ray-replay --out results/router_ray
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

from disagg.costs.profile import cost_profile
from disagg.router.calibration import with_engine_costs
from disagg.router.index import IndexUpdate, PrefixIndex
from disagg.router.router import StateAwareRouter
from disagg.router.types import RouteRequest, WorkerState
from disagg.tools.sim.simulator import ClusterConfig, Simulator
from disagg.tools.sim.workload import SynthConfig, chain_digests, synth_sessions

POLICIES = ["state_aware", "round_robin", "power_of_two", "prefix_affinity", "dynamo_cost"]
METRICS = [("hit_vs_theory", "hit/theory"), ("max_mean_queue", "max/mean q"), ("ttft_p90", "P90 TTFT s")]


SESSIONS_PER_WORKER = 6.0  # the default trace: 6 sessions of 12 turns per worker (4 closed-loop lanes each)


def sim_workload(workers: int, seed: int, scale: float = 1.0, sessions_per_worker: float = SESSIONS_PER_WORKER):
    """(requests, cluster, lanes) of the simulated comparison. The lanes (4 per worker) set the load;
    the sessions per worker set only how long the run lasts."""
    cfg = SynthConfig(num_sessions=max(4, int(sessions_per_worker * workers * scale)), turns=12,
                      system_tokens=8192, first_user_tokens=8192, think_s=3.0)
    reqs = synth_sessions(cfg, seed=seed)
    cluster = ClusterConfig(num_workers=workers, device_blocks=2048, host_blocks=32768)
    return reqs, cluster, 4 * workers


def run_sim(workers: int, seed: int, scale: float,
            sessions_per_worker: float = SESSIONS_PER_WORKER) -> dict[str, dict[str, float]]:
    reqs, cluster, lanes = sim_workload(workers, seed, scale, sessions_per_worker)
    out = {}
    for policy in POLICIES:
        t0 = time.perf_counter()
        res = Simulator(reqs, policy, cluster, lanes=lanes, seed=seed).run()
        out[policy] = dict(res.summary, wall_s=time.perf_counter() - t0)
        print(f"  {workers:>2} workers  {policy:<16} {len(reqs)} requests in {out[policy]['wall_s']:.1f}s",
              file=sys.stderr, flush=True)
    return out


def build_latency_index(num_workers: int = 64, num_blocks: int = 1_000_000, seed: int = 0,
                        mod: dict | None = None, pd: bool = False) -> tuple:
    """The latency bench's index: a 60-block system prompt on every worker, then sessions of 200-500
    blocks (a third on host), a KDA checkpoint every 16 blocks. ``mod`` supplies the classes
    (``PrefixIndex``, ``IndexUpdate``, ``WorkerState``; default: this tree's), so a reference
    version of the router gets the very same index. ``pd``: the first quarter of the workers
    prefill, the rest decode (the router suite's P/D layout). Returns (index, workers, sessions, rng)."""
    mod = mod or {"PrefixIndex": PrefixIndex, "IndexUpdate": IndexUpdate, "WorkerState": WorkerState}
    update = mod["IndexUpdate"]
    rng = random.Random(seed)
    idx = mod["PrefixIndex"]()
    roles = ["prefill" if pd and i < num_workers // 4 else "decode" if pd else "both" for i in range(num_workers)]
    ws = [mod["WorkerState"](f"w{i:02d}", role, f"n{i // 8}") for i, role in enumerate(roles)]
    for w in ws:
        idx.add_worker(w.worker_id, w.node_id)
    shared = chain_digests(list(range(60)), 60, "bench")  # 15K-token system prompt on every worker
    per_worker = (num_blocks - 60 * num_workers) // num_workers
    sessions: dict[str, list[bytes]] = {}
    for w in ws:
        for h in shared:
            idx.apply_update(update("stored", "mla", h, "device", w.worker_id))
        left, k = per_worker, 0
        while left > 0:  # sessions of ~400 blocks (100K tokens) each, checkpoint every 16 blocks
            n_blocks = min(left, rng.randint(200, 500))
            ids = list(range(60)) + [10**9 + hash((w.worker_id, k, j)) % 10**12 for j in range(n_blocks)]
            digs = chain_digests(ids, len(ids), "bench")
            for j, h in enumerate(digs[60:], start=60):
                tier = "device" if j % 3 else "host"
                idx.apply_update(update("stored", "mla", h, tier, w.worker_id))
                if (j + 1) % 16 == 0:
                    idx.apply_update(update("stored", "kda", h, "device", w.worker_id))
            sessions[f"{w.worker_id}/{k}"] = digs
            left -= n_blocks
            k += 1
    return idx, ws, sessions, rng


def decision_latency(num_workers: int = 64, num_blocks: int = 1_000_000, n: int = 2000, seed: int = 0,
                     reps: int = 1, pd: bool = False, engine: str | None = None,
                     router_config: dict | None = None) -> dict:
    """``engine``: a cost profile's name; the router prices time with its figures (a measured decode
    batch curve included, ``disagg.router.calibration``), else with its built-in constants;
    ``router_config``: the router's config (under the engine's figures)."""
    t0 = time.perf_counter()
    idx, ws, sessions, rng = build_latency_index(num_workers, num_blocks, seed, pd=pd)
    build_s = time.perf_counter() - t0
    router = StateAwareRouter(idx, with_engine_costs(router_config, cost_profile(engine).to_dict()) if engine
                              else router_config)
    keys = sorted(sessions)
    out = {"workers": num_workers, "pd": pd, "engine": engine, "indexed_blocks": idx.num_objects()["mla"], "calls": n,
           "checkpoints": idx.num_objects()["kda"], "build_s": round(build_s, 1), "reps": []}
    _time_routes(router, sessions, keys, ws, min(n, 200), rng)  # warm-up: the first walk flushes the build
    gc.collect()
    gc.freeze()  # what a long-lived router process does after loading its index
    for _ in range(reps):
        t = _time_routes(router, sessions, keys, ws, n, rng)
        rep = {f"{prefix}p{q}_ms": float(np.percentile(t[col], q))
               for col, prefix in (("wall", ""), ("cpu", "cpu_"), ("probe", "probe_"), ("walk", "walk_"),
                                   ("probe_cpu", "probe_cpu_"))
               for q in (50, 90, 99)}
        slow = t["wall"] >= np.percentile(t["wall"], 99)  # the tail: what its calls spent their time on
        rep.update(load_average=os.getloadavg()[0], tail_calls=int(slow.sum()),
                   tail_wall_ms=float(t["wall"][slow].mean()), tail_cpu_ms=float(t["cpu"][slow].mean()),
                   tail_walk_cpu_ms=float(t["walk"][slow].mean()), tail_gc_ms=float(t["gc"][slow].mean()),
                   gc_runs=int(t["gc_runs"].sum()), gc_ms_total=float(t["gc"].sum()))
        out["reps"].append(rep)
    gc.unfreeze()
    for key in out["reps"][0]:
        out[key] = float(np.median([r[key] for r in out["reps"]]))
    return out


def load_reference(ref: str) -> dict:
    """The router package as committed at git ``ref``, importable next to this tree's.

    Its files are copied from ``git show REF:disagg/router/...`` into a temporary package
    ``_router_ref`` (imports of ``disagg.router`` rewritten), so one process can run both
    versions on the same requests. Returns its PrefixIndex, IndexUpdate, WorkerState,
    RouteRequest and StateAwareRouter.
    """
    import atexit
    import importlib
    import shutil
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parent.parent
    try:
        files = subprocess.run(["git", "ls-tree", "-r", "--name-only", ref, "disagg/router"], cwd=root,
                               check=True, capture_output=True, text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"--compare-ref needs a git checkout with {ref!r}: {e}") from e
    tmp = tempfile.mkdtemp(prefix="router_ref_")
    atexit.register(shutil.rmtree, tmp, True)
    pkg = Path(tmp) / "_router_ref"
    for name in files:
        if not name.endswith(".py"):
            continue
        src = subprocess.run(["git", "show", f"{ref}:{name}"], cwd=root, check=True, capture_output=True,
                             text=True).stdout
        dst = pkg / Path(name).relative_to("disagg/router")
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(src.replace("disagg.router", "_router_ref"))
    sys.path.insert(0, str(pkg.parent))
    index, types, router = (importlib.import_module(f"_router_ref.{m}") for m in ("index", "types", "router"))
    return {"PrefixIndex": index.PrefixIndex, "IndexUpdate": index.IndexUpdate, "WorkerState": types.WorkerState,
            "RouteRequest": types.RouteRequest, "StateAwareRouter": router.StateAwareRouter}


def _decision_fields(d) -> tuple:
    return (d.request_id, d.decode_worker, d.prefill_worker, d.reason, d.predicted_cached_tokens, d.source_tier,
            d.scores)


def compare_latency(ref: str, num_workers: int = 64, num_blocks: int = 1_000_000, n: int = 2000, seed: int = 0,
                    reps: int = 1, pd: bool = False, router_config: dict | None = None) -> dict:
    """Same-process A/B: this tree's ``route`` against git ``ref``'s, interleaved call by call.

    Both versions get the same index (built twice, once per version's classes), the same
    requests, the same worker stats and one simulated clock; the order alternates each call. Every decision is
    compared field by field (scores included). Thread-CPU and wall ms per call and version.
    """
    ref_mod = load_reference(ref)
    t0 = time.perf_counter()
    idx_new, ws_new, sessions, _ = build_latency_index(num_workers, num_blocks, seed, pd=pd)
    idx_ref, ws_ref, _, _ = build_latency_index(num_workers, num_blocks, seed, ref_mod, pd=pd)
    build_s = time.perf_counter() - t0
    now = [0.0]  # one simulated clock for both (queue averages decay with it): 20 requests/s
    new = StateAwareRouter(idx_new, router_config, clock=lambda: now[0])  # the config: this tree's router only
    old = ref_mod["StateAwareRouter"](idx_ref, clock=lambda: now[0])
    ref_request = ref_mod["RouteRequest"]
    keys = sorted(sessions)
    rng = random.Random(seed + 1)
    total = n * reps + min(n, 200)
    cols = {k: np.zeros(total) for k in ("new_cpu", "new_wall", "ref_cpu", "ref_wall", "probe_cpu")}
    differ = 0
    gc_frozen = False
    for i in range(total):
        if i == min(n, 200):  # after the warm-up (the first walks flush the builds)
            gc.collect()
            gc.freeze()
            gc_frozen = True
        digs = sessions[keys[rng.randrange(len(keys))]] + chain_digests([i, i + 1, i + 2, i + 3], 4, f"new{i}")
        args = (f"q{i}", f"sess{i}", digs, len(digs) * 256 + 17, 256)
        now[0] = 0.05 * i
        for w_new, w_ref in zip(ws_new, ws_ref, strict=True):
            w_new.queued_prefill_tokens = w_ref.queued_prefill_tokens = rng.randrange(0, 50_000)
        runs = [("new", new, RouteRequest(*args), ws_new), ("ref", old, ref_request(*args), ws_ref)]
        got = {}
        for name, router, rr, ws in runs if i % 2 else runs[::-1]:
            c, t = time.thread_time(), time.perf_counter()
            got[name] = router.route(rr, ws)
            cols[f"{name}_wall"][i] = time.perf_counter() - t
            cols[f"{name}_cpu"][i] = time.thread_time() - c
        differ += _decision_fields(got["new"]) != _decision_fields(got["ref"])
        c = time.thread_time()
        _probe_work()  # the machine's speed in this run
        cols["probe_cpu"][i] = time.thread_time() - c
    if gc_frozen:
        gc.unfreeze()
    warm = min(n, 200)
    out = {"ref": ref, "workers": num_workers, "indexed_blocks": idx_new.num_objects()["mla"], "calls": n * reps,
           "build_s": round(build_s, 1), "differing_decisions": differ, "load_average": os.getloadavg()[0]}
    for k, v in cols.items():
        for q in (50, 90, 99):
            out[f"{k}_p{q}_ms"] = float(np.percentile(v[warm:], q)) * 1e3
    for kind in ("cpu", "wall"):
        for q in (50, 90, 99):
            out[f"{kind}_ratio_p{q}"] = out[f"new_{kind}_p{q}_ms"] / out[f"ref_{kind}_p{q}_ms"]
    return out


def compare_text(c: dict) -> str:
    lines = [f"same-process A/B against {c['ref']}: {c['workers']} workers, {c['indexed_blocks']:,} indexed blocks, "
             f"{c['calls']} interleaved calls per version, load average {c['load_average']:.1f}, "
             f"decisions differing: {c['differing_decisions']}; fixed-work probe thread CPU p50 "
             f"{c['probe_cpu_p50_ms']:.3f} ms"]
    for kind, label in (("cpu", "thread CPU"), ("wall", "wall")):
        for who in ("ref", "new"):
            lines.append(f"  {label:<10} {'this tree' if who == 'new' else c['ref']:<10} (ms): "
                         + " ".join(f"p{q} {c[f'{who}_{kind}_p{q}_ms']:.3f}" for q in (50, 90, 99)))
        lines.append(f"  {label:<10} ratio this/ref:  "
                     + " ".join(f"p{q} {c[f'{kind}_ratio_p{q}']:.2f}" for q in (50, 90, 99)))
    return "\n".join(lines)


def _probe_work() -> int:
    """Fixed CPU work (~0.1-0.3 ms): its wall-time spread is the machine's noise, not the router's."""
    acc = 0
    for i in range(3000):
        acc ^= i * 2654435761
    return acc


def _time_routes(router, sessions, keys, ws, n, rng) -> dict[str, np.ndarray]:
    """Per ``route`` call: wall and thread-CPU ms, the walk's CPU ms (``PrefixIndex.match``), GC
    pauses inside the call (ms, and how many collections), and the wall ms of the noise probe
    run between calls."""
    cols = {k: np.zeros(n) for k in ("wall", "cpu", "walk", "gc", "gc_runs", "probe", "probe_cpu")}
    index, walk_cpu, gc_t = router.index, [0.0], [0.0, 0.0, 0]
    match = index.match

    def timed_match(*a, **k):
        c = time.thread_time()
        try:
            return match(*a, **k)
        finally:
            walk_cpu[0] += time.thread_time() - c

    def on_gc(phase, info):
        if phase == "start":
            gc_t[0] = time.perf_counter()
        else:
            gc_t[1] += time.perf_counter() - gc_t[0]
            gc_t[2] += 1

    index.match = timed_match
    gc.callbacks.append(on_gc)
    try:
        for i in range(n):
            digs = sessions[keys[rng.randrange(len(keys))]]
            extra = chain_digests([i, i + 1, i + 2, i + 3], 4, f"new{i}")  # new turn: 4 new blocks
            rr = RouteRequest(f"q{i}", f"sess{i}", digs + extra, (len(digs) + 4) * 256 + 17, 256)
            for w in ws:
                w.queued_prefill_tokens = rng.randrange(0, 50_000)
            walk_cpu[0], gc_t[1], gc_t[2] = 0.0, 0.0, 0
            c, t = time.thread_time(), time.perf_counter()
            router.route(rr, ws)
            cols["wall"][i] = time.perf_counter() - t
            cols["cpu"][i] = time.thread_time() - c
            cols["walk"][i], cols["gc"][i], cols["gc_runs"][i] = walk_cpu[0], gc_t[1], gc_t[2]
            c, t = time.thread_time(), time.perf_counter()
            _probe_work()
            cols["probe"][i] = time.perf_counter() - t
            cols["probe_cpu"][i] = time.thread_time() - c
    finally:
        del index.match
        gc.callbacks.remove(on_gc)
    for k in ("wall", "cpu", "walk", "gc", "probe", "probe_cpu"):
        cols[k] *= 1e3
    return cols


def latency_text(lat: dict) -> str:
    lines = [f"decision latency, {lat['workers']} workers{' (P/D)' if lat.get('pd') else ''}"
             f"{', priced as ' + lat['engine'] if lat.get('engine') else ''}, "
             f"{lat['indexed_blocks']:,} indexed blocks, "
             f"{lat['checkpoints']:,} checkpoints, median of {len(lat['reps'])} repetition(s) of "
             f"{lat['calls']} calls (ms): wall p50 {lat['p50_ms']:.3f} p90 {lat['p90_ms']:.3f} "
             f"p99 {lat['p99_ms']:.3f} | thread CPU p50 {lat['cpu_p50_ms']:.3f} p90 {lat['cpu_p90_ms']:.3f} "
             f"p99 {lat['cpu_p99_ms']:.3f} | walk CPU p50 {lat['walk_p50_ms']:.3f} p99 {lat['walk_p99_ms']:.3f} "
             f"| fixed-work probe p50 {lat['probe_p50_ms']:.3f} p99 {lat['probe_p99_ms']:.3f}"]
    for i, r in enumerate(lat["reps"]):
        lines.append(
            f"  rep {i}: wall p50 {r['p50_ms']:.3f} p90 {r['p90_ms']:.3f} p99 {r['p99_ms']:.3f} | cpu p50 "
            f"{r['cpu_p50_ms']:.3f} p90 {r['cpu_p90_ms']:.3f} p99 {r['cpu_p99_ms']:.3f} | probe p50 "
            f"{r['probe_p50_ms']:.3f} p99 {r['probe_p99_ms']:.3f} (cpu p50 {r['probe_cpu_p50_ms']:.3f}) | load average {r['load_average']:.1f}\n"
            f"         slowest 1% ({r['tail_calls']} calls): wall {r['tail_wall_ms']:.3f}, cpu "
            f"{r['tail_cpu_ms']:.3f} (walk {r['tail_walk_cpu_ms']:.3f}), gc {r['tail_gc_ms']:.3f} ms; "
            f"gc ran {r['gc_runs']} times in all calls, {r['gc_ms_total']:.1f} ms total")
    return "\n".join(lines)


def balance_by_seed(seed0: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    """max/mean q and hit/theory at 16 workers for each workload seed."""
    runs = {args.seed: seed0} | {s: run_sim(16, s, args.scale, args.sessions_per_worker)
                                         for s in args.balance_seeds}
    head = f"{'16 workers, max/mean q (hit/theory) by seed':<44}" + "".join(f"{s:>14}" for s in runs)
    lines = [head, "-" * len(head)]
    for p in POLICIES:
        lines.append(f"{p:<44}" + "".join(f"{r[p]['max_mean_queue']:>7.3f} ({r[p]['hit_vs_theory']:.2f})"
                                           for r in runs.values()))
    return "\n".join(lines)


def table(results: dict[int, dict[str, dict[str, float]]]) -> str:
    head = f"{'workers':>7} {'policy':<16}" + "".join(f"{label:>12}" for _, label in METRICS)
    head += f"{'P90 ITL s':>12}{'tok/s/GPU':>11}"
    lines = [head, "-" * len(head)]
    for w, rows in results.items():
        for p, s in rows.items():
            lines.append(f"{w:>7} {p:<16}" + "".join(f"{s[k]:>12.3f}" for k, _ in METRICS)
                         + f"{s['itl_p90']:>12.4f}{s['tokens_per_s_per_gpu']:>11.0f}")
    return "\n".join(lines)


def plot(results: dict[int, dict[str, dict[str, float]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(15, 4.2))
    sizes = list(results)
    width = 0.8 / len(POLICIES)
    for ax, (key, label) in zip(axes, METRICS, strict=True):
        for j, p in enumerate(POLICIES):
            vals = [results[w][p][key] for w in sizes]
            ax.bar(np.arange(len(sizes)) + j * width, vals, width, label=p)
        ax.set_xticks(np.arange(len(sizes)) + width * (len(POLICIES) - 1) / 2)
        ax.set_xticklabels([f"{w} workers" for w in sizes])
        ax.set_title(label)
        if key == "max_mean_queue":
            ax.set_yscale("log")
            ax.axhline(1.25, color="k", ls="--", lw=0.8)
        if key == "hit_vs_theory":
            ax.set_ylim(0.5, 1.01)
            ax.axhline(0.95, color="k", ls="--", lw=0.8)
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle("Router comparison on synthetic agentic sessions (simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


RAY_POLICIES = ["state_aware", "power_of_two", "affinity"]
RAY_COLUMNS = [("hit/theory", "hit_vs_theory", ".3f"), ("hit", "cache_hit", ".3f"), ("theory", "theoretical", ".3f"),
               ("max/mean req", "max_mean_requests", ".3f"), ("max/mean tok", "max_mean_prefill_tokens", ".3f"),
               ("P90 TTFT ms", "ttft_p90_ms", ".0f"), ("P50 TTFT ms", "ttft_p50_ms", ".0f"), ("ok", "num_ok", "d"),
               ("overridden", "overridden", ".0f"), ("load avg", "load_average", ".1f")]


def _decode_counters(num_replicas: int, app_name: str) -> dict[str, dict[str, int]]:
    """Cumulative counters of every decode replica (stats calls go to any replica: ask until all answered)."""
    from ray import serve

    handle = serve.get_deployment_handle("DecodeServer", app_name=app_name)
    seen: dict[str, dict[str, int]] = {}
    for _ in range(50 * num_replicas):
        s = handle.stats.remote().result(timeout_s=60)
        seen[s["replica_id"]] = {"requests": s["worker"].get("decodes", 0),
                                 "prefill_tokens": s["engine"].get("prefill_tokens", 0)}
        if len(seen) == num_replicas:
            return seen
    raise RuntimeError(f"only {len(seen)} of {num_replicas} decode replicas answered")


def _route_overridden(url: str) -> float | None:
    """Requests Serve ran on another replica than the state-aware router's pick (``/metrics``)."""
    import re

    import httpx

    m = re.search(r"^disagg_route_overridden (\S+)$", httpx.get(url + "/metrics", timeout=30).text, re.M)
    return float(m.group(1)) if m else None


def _max_mean(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else float("nan")


def ray_replay(args: argparse.Namespace) -> dict[str, dict]:
    """Replay the CPU-sized agentic trace once per Serve router policy; returns figures per policy."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # e2e_pareto: the trace and its helpers
    from e2e_pareto import cpu_trace

    from disagg.tools.bench.trace import save_trace

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = cpu_trace(args.replay_sessions, args.seed)
    trace_path = out / "trace.jsonl"
    save_trace(records, trace_path)
    results: dict[str, dict] = {}
    for rnd in range(args.replay_rounds):  # odd rounds reverse the order: the machine's load drifts
        order = args.replay_policies if rnd % 2 == 0 else args.replay_policies[::-1]
        for policy in order:
            results[f"{policy}#{rnd}"] = _replay_with_retry(args, rnd, policy, records, trace_path, out)
    return results


def _replay_with_retry(args: argparse.Namespace, rnd: int, policy: str, records, trace_path: Path, out: Path) -> dict:
    import ray

    k = rnd * len(args.replay_policies) + args.replay_policies.index(policy)  # a salt of its own
    for attempt in range(2):  # a loaded machine sometimes times the Ray start out
        try:
            return _replay_policy(args, k, policy, records, trace_path, out / f"{policy}-{rnd}")
        except Exception as exc:
            if attempt:
                raise
            print(f"    {policy}: cluster failed ({exc!r}); retrying once", file=sys.stderr, flush=True)
            ray.shutdown()
    raise AssertionError("unreachable")


def _replay_policy(args: argparse.Namespace, k: int, policy: str, records, trace_path: Path, out: Path) -> dict:
    """One policy's replay on a fresh local cluster (bench results under ``out``)."""
    from e2e_pareto import CONFIG, FIRST_TOKEN_ID, VOCAB_SIZE, engine_replicas, warm_up

    from disagg.config import load_config
    from disagg.launch.local import APP_NAME, free_port, local_app, wait_healthy
    from disagg.tools.bench.sweep import BenchParams, run_bench_sync

    cfg = load_config(CONFIG)
    cfg.http.port = free_port()
    cfg.router.policy = policy
    cfg.router.stats_period_s = 0.5
    cfg.deployment.decode.num_replicas = args.replay_decode_replicas
    cfg.deployment.decode.num_cpus = cfg.deployment.prefill.num_cpus = 0.5  # all replicas fit the 2-core machine
    t0 = time.monotonic()
    with local_app(cfg) as url:
        wait_healthy(url)
        warm_up(url, cfg.model.openai_name)
        before = _decode_counters(args.replay_decode_replicas, APP_NAME)
        print(f"=== {policy}: cluster up in {time.monotonic() - t0:.0f} s, load average "
              f"{os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
        params = BenchParams(
            url=url, trace=str(trace_path), out=str(out), concurrency=[args.replay_concurrency],
            max_requests=args.replay_requests, think_cap_ms=2000.0, think_scale=0.05, sample_start_turn=False,
            salt=1 + 100 * k, seed=args.seed, num_gpus=engine_replicas(cfg), vocab_size=VOCAB_SIZE,
            first_token_id=FIRST_TOKEN_ID, default_block_size=64, plots=False, progress=False, quiet=True)
        doc = run_bench_sync(params, records)
        after = _decode_counters(args.replay_decode_replicas, APP_NAME)
        overridden = _route_overridden(url) if policy == "state_aware" else None  # the others do not count
    s = doc["runs"][0]["summary"]
    served = [after[r]["requests"] - before[r]["requests"] for r in after]
    computed = [after[r]["prefill_tokens"] - before[r]["prefill_tokens"] for r in after]
    hit, theory = s["cache_hit_usage"], s["cache_hit_theoretical"]
    result = {
        "cache_hit": hit, "theoretical": theory, "hit_vs_theory": hit / theory if hit is not None and theory else None,
        "max_mean_requests": _max_mean(served), "max_mean_prefill_tokens": _max_mean(computed),
        "requests_per_replica": served, "prefill_tokens_per_replica": computed,
        "ttft_p90_ms": s["ttft_ms"]["p90"], "ttft_p50_ms": s["ttft_ms"]["p50"], "num_ok": s["num_ok"],
        "valid": s["valid"], "wall_s": time.monotonic() - t0, "load_average": os.getloadavg()[0],
        "overridden": overridden,
    }
    print(f"    {policy}: {s['num_ok']} ok in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return result


def ray_table(results: dict[str, dict], args: argparse.Namespace) -> str:
    head = (f"local Ray replay: {args.replay_sessions} sessions, {args.replay_requests} requests at concurrency "
            f"{args.replay_concurrency}, {args.replay_decode_replicas} decode replicas + 1 prefill\n")
    head += f"{'policy#round':<16}" + "".join(f"{label:>13}" for label, _, _ in RAY_COLUMNS)
    lines = [head, "-" * len(head.splitlines()[-1])]
    for p, r in results.items():
        lines.append(f"{p:<16}" + "".join(f"{'n/a':>13}" if r[k] is None else f"{r[k]:>13{fmt}}"
                                          for _, k, fmt in RAY_COLUMNS))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/router_bench", help="output directory (table, JSON, PNG)")
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--scale", type=float, default=1.0, help="sessions per worker multiplier")
    ap.add_argument("--sessions-per-worker", type=float, default=SESSIONS_PER_WORKER,
                    help="trace length at the same load (4 lanes per worker): 6 (default, earlier rounds' "
                         "figures) or 48, the length chosen for the balance metric (docs/router.md)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--latency-blocks", type=int, default=1_000_000)
    ap.add_argument("--latency-decisions", type=int, default=2000)
    ap.add_argument("--latency-reps", type=int, default=1, help="repetitions of the latency measurement")
    ap.add_argument("--latency-router-config", type=json.loads, default=None, metavar="JSON",
                    help="decision latency of a router with this config (JSON), e.g. '{\"harm_pool_view\": true}'; "
                         "with --compare-ref, this tree's router's")
    ap.add_argument("--latency-only", action="store_true", help="skip the simulations")
    ap.add_argument("--latency-pd", action="store_true",
                    help="decision latency with P/D pools (a quarter prefill, the rest decode)")
    ap.add_argument("--latency-engine", metavar="PROFILE",
                    help="decision latency of a router priced with this engine profile's figures (e.g. h200-small, "
                         "whose decode batch curve the decode scorer interpolates)")
    ap.add_argument("--compare-ref", default=None, metavar="GITREF",
                    help="decision latency only: same-process A/B of route() against the router at GITREF")
    ap.add_argument("--balance-seeds", type=int, nargs="*", default=[],
                    help="extra workload seeds for the 16-worker balance check")
    ap.add_argument("--ray-replay", action="store_true", help="replay on the local Ray cluster instead (see above)")
    ap.add_argument("--replay-policies", nargs="+", default=RAY_POLICIES, choices=RAY_POLICIES)
    ap.add_argument("--replay-sessions", type=int, default=12, help="top-level sessions in the replayed trace")
    ap.add_argument("--replay-requests", type=int, default=48, help="measured requests per policy")
    ap.add_argument("--replay-concurrency", type=int, default=4, help="closed-loop lanes")
    ap.add_argument("--replay-decode-replicas", type=int, default=2)
    ap.add_argument("--replay-rounds", type=int, default=1, help="rounds over the policies (odd ones reversed)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    def report(stem: str, text: str, doc) -> int:  # print, and write STEM.txt and STEM.json under --out
        print(text)
        with open(os.path.join(args.out, stem + ".txt"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, stem + ".json"), "w") as f:
            json.dump(doc, f, indent=1)
        return 0

    if args.ray_replay:
        res = ray_replay(args)
        return report("router_ray_replay", ray_table(res, args), res)
    if args.compare_ref:
        cmp = compare_latency(args.compare_ref, num_blocks=args.latency_blocks, n=args.latency_decisions,
                              seed=args.seed, reps=args.latency_reps, pd=args.latency_pd,
                              router_config=args.latency_router_config)
        return report("router_latency_ab", compare_text(cmp), cmp)
    results = {} if args.latency_only else {w: run_sim(w, args.seed, args.scale, args.sessions_per_worker)
                                            for w in args.workers}
    text = table(results) if results else ""
    if args.balance_seeds and not args.latency_only:
        text += "\n" + balance_by_seed(results.get(16) or run_sim(16, args.seed, args.scale,
                                                                   args.sessions_per_worker), args)
    if text:
        print(text)
    print("decision latency: building the index ...", file=sys.stderr, flush=True)
    lat = decision_latency(num_blocks=args.latency_blocks, n=args.latency_decisions, seed=args.seed,
                           reps=args.latency_reps, pd=args.latency_pd, engine=args.latency_engine,
                           router_config=args.latency_router_config)
    lat_line = latency_text(lat)
    print(lat_line)
    with open(os.path.join(args.out, "router_bench.txt"), "w") as f:
        f.write(text + "\n" + lat_line + "\n")
    with open(os.path.join(args.out, "router_bench.json"), "w") as f:
        json.dump({"sim": {str(k): v for k, v in results.items()}, "latency": lat}, f, indent=1)
    if results:
        plot(results, os.path.join(args.out, "router_bench.png"))
        print(f"wrote {args.out}/router_bench.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
