"""Simulator scale: a 1,000-GPU cluster replaying 100,000 agentic sessions, timed.

    python benchmarks/sim_scale.py                                   # the default scale run
    python benchmarks/sim_scale.py --sessions 20000 --gpus 256 --domains 2 --jobs 2 --out results/scale.json

Cluster: ``--gpus / --gpus-per-worker`` engine replicas (default 125 TP8
replicas of the ``mi355x-k3`` profile, one per node), split into
``--domains`` router slices simulated in ``--jobs`` processes (see
``disagg.tools.sim.shard``). Workload: ``--sessions`` sessions of the AgentX-style
generator (``disagg.tools.bench.synth``) with ``--turn-scale`` of its turns per
session, 1,024-token blocks, replayed closed loop by ``--concurrency`` lanes.

Printed: wall time of each phase (synthesis, simulation), requests and
events per second, the run's benchmark metrics, and the same machine's speed
on a fixed pure-Python loop measured in this run (``python_loop_s``: 10M
integer additions), so figures from a loaded or a faster machine can be
compared as ratios, and the CPU seconds of each phase (this process and its
worker processes): on a shared machine wall time includes waiting for a
core, CPU time does not.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

from disagg.costs.profile import load_profile
from disagg.tools.bench.synth import synthesize
from disagg.tools.sim.driver import ReplayConfig
from disagg.tools.sim.shard import simulate
from disagg.tools.sim.simulator import ClusterConfig
from disagg.tools.sim.workload import from_trace_records


def python_loop_s(n: int = 10_000_000) -> float:
    t0 = time.perf_counter()
    s = 0
    for i in range(n):
        s += i
    return time.perf_counter() - t0


def cpu_s() -> float:
    """CPU seconds of this process and its finished children (the simulation's worker processes)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=1000)
    ap.add_argument("--gpus-per-worker", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=100_000)
    ap.add_argument("--turn-scale", type=float, default=0.05)
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--profile", default="mi355x-k3")
    ap.add_argument("--policy", default="state_aware")
    ap.add_argument("--concurrency", type=int, default=0, help="lanes (default: sessions / 4)")
    ap.add_argument("--domains", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)

    loop_before = python_loop_s()
    load_before = os.getloadavg()[0]
    workers = args.gpus // args.gpus_per_worker
    prof = load_profile(args.profile)
    scale_blocks = prof.block_size / args.block_size  # the profile's memory is in its own block size
    cluster = ClusterConfig(num_workers=workers, workers_per_node=1, gpus_per_worker=args.gpus_per_worker,
                            device_blocks=max(1, int(prof.memory.get("device_blocks", 8192) * scale_blocks)),
                            host_blocks=int(prof.memory.get("host_blocks_per_node", 65536) * scale_blocks))
    lanes = args.concurrency or max(1, args.sessions // 4)
    replay = ReplayConfig(concurrency=lanes, ramp_s=60.0, seed=args.seed)

    t0, c0 = time.perf_counter(), cpu_s()
    records = synthesize(args.sessions, args.seed, block_size=args.block_size, turn_scale=args.turn_scale)
    requests = from_trace_records(records, args.block_size)
    del records
    t_synth = time.perf_counter() - t0
    print(f"{args.sessions:,} sessions -> {len(requests):,} requests in {t_synth:.1f} s", file=sys.stderr, flush=True)

    t1, c1 = time.perf_counter(), cpu_s()
    res = simulate(requests, args.policy, cluster, prof.cost_model(), replay, domains=args.domains, jobs=args.jobs,
                   seed=args.seed)
    t_sim = time.perf_counter() - t1
    total = time.perf_counter() - t0
    c2 = cpu_s()
    s = res.bench_summary()
    loop_after = python_loop_s()
    done = s.num_ok
    figures = {
        "gpus": res.num_gpus, "engines": workers, "gpus_per_engine": args.gpus_per_worker,
        "domains": args.domains, "jobs": args.jobs, "sessions": args.sessions, "requests": len(requests),
        "requests_finished": done, "lanes": lanes, "profile": prof.name, "policy": args.policy,
        "synth_s": round(t_synth, 1), "simulate_s": round(t_sim, 1), "total_s": round(total, 1),
        "synth_cpu_s": round(c1 - c0, 1), "simulate_cpu_s": round(c2 - c1, 1),
        "requests_per_s": round(done / t_sim, 1), "events": res.sim_events, "index_updates": res.num_events,
        "python_loop_s": [round(loop_before, 2), round(loop_after, 2)],
        "load_avg_1m": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "simulated_s": round(res.summary["makespan_s"], 1),
        "ttft_p90_ms": round(s.ttft_ms.p90, 1), "p90_interactivity": round(s.p90_interactivity, 1),
        "total_tps_per_gpu": round(s.total_tps_per_gpu, 1), "hit_rate": round(res.summary["hit_rate"], 4),
        "hit_vs_theory": round(res.summary["hit_vs_theory"], 4),
        "domain_requests_max_mean": round(res.summary.get("domain_requests_max_mean", 1.0), 3),
    }
    for k, v in figures.items():
        print(f"{k:>26}: {v}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
