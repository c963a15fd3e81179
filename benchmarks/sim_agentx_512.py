"""A simulated 64-node (512-GPU) AgentX-style run: our router vs the baselines, and host-tier sizing.

    python benchmarks/sim_agentx_512.py --out docs/reports/sim-512gpu
    python benchmarks/sim_agentx_512.py --out results/512 --plot-only          (redraw from results.json)

Cluster: 64 nodes of 8 GPUs, one TP8 engine replica per node (the
``mi355x-k3`` profile: Kimi K3 shapes on MI355X figures, see its notes),
``--pd`` prefill : decode engines, each node's host tier shared by its GPUs.
Workload: the AgentX-style generator (``disagg.tools.bench.synth``), replayed
closed loop as ``disagg bench`` does (think time capped at 30 s and scaled
by 0.2, each lane starting mid-session, a warm-up period excluded, a fixed
measured window of simulated time, sessions recycled with new salts).

Figures (``--out``):

- ``pareto.png``: total tok/s/GPU against P90 interactivity, one curve per
  router policy, one point per concurrency (lanes); ``ttft.png``: P90 TTFT
  against tok/s/GPU for the same runs;
- ``host_tier.png``: our router's cache hit rate (and P90 TTFT) against the
  host tier's size per node, at one concurrency; the saturation point is the
  smallest size reaching 99% of the largest size's hit rate;
- ``results.json``, ``table.md``: every run's figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from disagg.costs.profile import load_profile
from disagg.tools.bench.pareto import front_at
from disagg.tools.bench.plots import plot_pareto
from disagg.tools.bench.synth import synthesize
from disagg.tools.sim.driver import ReplayConfig
from disagg.tools.sim.shard import simulate
from disagg.tools.sim.simulator import ClusterConfig
from disagg.tools.sim.sweep import parse_pd
from disagg.tools.sim.workload import from_trace_records, shared_ids

POLICIES = ["state_aware", "round_robin", "power_of_two", "prefix_affinity", "dynamo_cost"]


def _cluster(args, prof, host_blocks: int) -> ClusterConfig:
    engines = args.nodes * 8 // prof.gpus_per_worker
    p, d = parse_pd(args.pd)
    n_p = max(1, round(engines * p / (p + d)))
    scale = prof.block_size / args.block_size
    return ClusterConfig(num_workers=engines, num_prefill=n_p, num_decode=engines - n_p,
                         workers_per_node=max(1, 8 // prof.gpus_per_worker), gpus_per_worker=prof.gpus_per_worker,
                         device_blocks=max(1, int(prof.memory["device_blocks"] * scale)), host_blocks=host_blocks)


def _replay(args, lanes: int) -> ReplayConfig:
    """Lanes start mid-session (cold, as ``disagg bench --sample-start-turn``) spread over ``ramp``;
    the window opens once they have all started and the first turns' backlog is served."""
    ramp = args.ramp_per_lane_s * lanes
    return ReplayConfig(concurrency=lanes, think_cap_ms=args.think_cap_ms, think_scale=args.think_scale,
                        recycle=True, run_salt=1, sample_start_turn=True, ramp_s=ramp,
                        warmup_s=ramp + args.settle_s, duration_s=args.duration_s, seed=args.seed)


def run_point(reqs, shared, args, prof, policy: str, lanes: int, host_blocks: int) -> dict:
    t0 = time.perf_counter()
    res = simulate(reqs, policy, _cluster(args, prof, host_blocks), prof.cost_model(), _replay(args, lanes),
                   domains=args.domains, jobs=args.jobs, seed=args.seed, shared_ids=shared)
    s = res.bench_summary()
    row = {"policy": policy, "lanes": lanes, "host_blocks": host_blocks, "requests": s.num_ok,
           "p90_interactivity": s.p90_interactivity, "tps_per_gpu": s.total_tps_per_gpu,
           "ttft_p50_ms": s.ttft_ms.p50, "ttft_p90_ms": s.ttft_ms.p90, "itl_p90_ms": s.itl_ms.p90,
           "hit": s.cache_hit_usage, "hit_theoretical": s.cache_hit_theoretical,
           "decisions": res.router_metrics.get("decisions", {}), "wall_s": round(time.perf_counter() - t0, 1)}
    print(f"  {policy:<16} lanes {lanes:>6} host {host_blocks:>8}: P90 {row['p90_interactivity']:6.1f} tok/s/user "
          f"{row['tps_per_gpu']:8.1f} tok/s/GPU  TTFT P90 {row['ttft_p90_ms']:8.0f} ms  hit {row['hit']:.3f}  "
          f"({row['wall_s']} s)", file=sys.stderr, flush=True)
    return row


def saturation(rows: list[dict], frac: float = 0.99) -> dict | None:
    """The smallest host tier whose hit rate reaches ``frac`` of the largest tier's."""
    rows = sorted(rows, key=lambda r: r["host_blocks"])
    if not rows:
        return None
    top = rows[-1]["hit"]
    return next((r for r in rows if r["hit"] >= frac * top), rows[-1])


def _finish(doc: dict) -> None:
    """Host-tier rows sorted, with the Pareto run at the same lanes and the default tier; saturation."""
    host = {r["host_blocks"]: r for r in doc["host_tier"]}
    lanes = doc["host_tier"][0]["lanes"] if doc["host_tier"] else None
    for r in doc["pareto"]:
        if r["policy"] == "state_aware" and r["lanes"] == lanes:
            host.setdefault(r["host_blocks"], r)
    doc["host_tier"] = sorted(host.values(), key=lambda r: r["host_blocks"])
    sat = saturation(doc["host_tier"])
    bb = doc["setup"]["block_bytes"]
    doc["saturation"] = None if sat is None else {"host_blocks": sat["host_blocks"], "host_gb": sat["host_blocks"] * bb / 1e9}


def plot(out: Path, doc: dict, targets: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = []
    for policy in POLICIES:
        rows = [r for r in doc["pareto"] if r["policy"] == policy]
        pts = [(r["p90_interactivity"], r["tps_per_gpu"]) for r in rows]
        series.append((policy, pts, [f"c{r['lanes']}" for r in rows]))
    plot_pareto(series, out / "pareto.png", targets,
                title=f"{doc['setup']['gpus']} GPUs ({doc['setup']['pd']} P:D, TP8 engines), simulated: "
                      "tok/s/GPU vs P90 interactivity")
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for k, policy in enumerate(POLICIES):
        rows = sorted((r for r in doc["pareto"] if r["policy"] == policy), key=lambda r: r["lanes"])
        if rows:
            ax.plot([r["tps_per_gpu"] for r in rows], [r["ttft_p90_ms"] / 1000 for r in rows], "o-",
                    color=f"C{k}", label=policy)
    ax.set_yscale("log")
    ax.set_xlabel("total tokens/s/GPU")
    ax.set_ylabel("TTFT P90 (s)")
    ax.set_title("TTFT P90 vs throughput, one point per concurrency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "ttft.png", dpi=120)
    plt.close(fig)
    host = sorted(doc["host_tier"], key=lambda r: r["host_blocks"])
    gb = [r["host_blocks"] * doc["setup"]["block_bytes"] / 1e9 for r in host]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    ax.plot(gb, [r["hit"] for r in host], "o-", label="cache hit (usage)")
    ax.plot(gb, [r["hit_theoretical"] for r in host], "--", color="grey", label="theoretical (infinite cache)")
    sat = doc.get("saturation")
    if sat:
        ax.axvline(sat["host_gb"], color="C3", ls=":", label=f"saturation ~{sat['host_gb']:.0f} GB/node")
    ax.set_xscale("symlog", linthresh=max(min(g for g in gb if g > 0) if any(gb) else 1, 1e-3))
    ax.set_xlabel("host tier per node (GB)")
    ax.set_ylabel("hit rate")
    ax2 = ax.twinx()
    ax2.plot(gb, [r["ttft_p90_ms"] / 1000 for r in host], "s-", color="C1", alpha=0.6, label="TTFT P90 (s)")
    ax2.set_ylabel("TTFT P90 (s)")
    ax.legend(loc="lower right", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    ax.set_title(f"host tier vs hit rate, state_aware, {host[0]['lanes'] if host else 0} lanes")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "host_tier.png", dpi=120)
    plt.close(fig)


def _at(pts: list[tuple[float, float]], target: float) -> str:
    """The front read at ``target`` or, when every run is faster than it, the best of those runs (*)."""
    if not pts:
        return "-"
    y = front_at(pts, [target]).get(target)
    if y is not None:
        return f"{y:,.0f}"
    ok = [b for a, b in pts if a >= target]
    return f"{max(ok):,.0f}*" if ok and min(a for a, _ in pts) >= target else "-"


def table(doc: dict, targets: list[float]) -> str:
    lines = ["| policy | lanes | requests | P90 tok/s/user | tok/s/GPU | TTFT P50 ms | TTFT P90 ms | hit | hit theor. |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["pareto"]:
        lines.append(f"| {r['policy']} | {r['lanes']} | {r['requests']} | {r['p90_interactivity']:.1f} | "
                     f"{r['tps_per_gpu']:,.0f} | {r['ttft_p50_ms']:,.0f} | {r['ttft_p90_ms']:,.0f} | "
                     f"{r['hit']:.3f} | {r['hit_theoretical']:.3f} |")
    lines += ["", "tok/s/GPU on each policy's front at the target interactivities:", "",
              "| policy | " + " | ".join(f"@{t:g}" for t in targets) + " |", "|---|" + "---|" * len(targets)]
    for policy in POLICIES:
        pts = [(r["p90_interactivity"], r["tps_per_gpu"]) for r in doc["pareto"] if r["policy"] == policy]
        lines.append(f"| {policy} | " + " | ".join(_at(pts, t) for t in targets) + " |")
    lines.append("\n(* no run of the policy is as slow as the target: its best run faster than the target)")
    lines += ["", "| host blocks / node | host GB / node | hit | TTFT P90 ms | P90 tok/s/user |", "|---|---|---|---|---|"]
    for r in sorted(doc["host_tier"], key=lambda r: r["host_blocks"]):
        lines.append(f"| {r['host_blocks']:,} | {r['host_blocks'] * doc['setup']['block_bytes'] / 1e9:,.0f} | "
                     f"{r['hit']:.3f} | {r['ttft_p90_ms']:,.0f} | {r['p90_interactivity']:.1f} |")
    sat = doc.get("saturation")
    if sat:
        lines.append(f"\nhit rate saturates (>= 99% of the largest tier's) at {sat['host_blocks']:,} blocks "
                     f"= {sat['host_gb']:,.0f} GB per node")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/sim-512gpu")
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--pd", default="1:3", help="prefill : decode engines")
    ap.add_argument("--profile", default="mi355x-k3")
    ap.add_argument("--sessions", type=int, default=3000)
    ap.add_argument("--turn-scale", type=float, default=1.0)
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--lanes", type=lambda s: [int(x) for x in s.split(",")], default=[256, 512, 1024, 2048])
    ap.add_argument("--policies", type=lambda s: s.split(","), default=POLICIES)
    ap.add_argument("--think-cap-ms", type=float, default=30_000.0)
    ap.add_argument("--think-scale", type=float, default=0.2, help="multiplies think time (as disagg bench)")
    ap.add_argument("--ramp-per-lane-s", type=float, default=0.05, help="lane i starts at i x this")
    ap.add_argument("--settle-s", type=float, default=60.0, help="warm-up after the last lane started")
    ap.add_argument("--duration-s", type=float, default=120.0, help="measured window (simulated seconds)")
    ap.add_argument("--host-lanes", type=int, default=2048, help="concurrency of the host-tier sweep")
    ap.add_argument("--host-gb", type=lambda s: [float(x) for x in s.split(",")],
                    default=[0, 32, 64, 128, 512])
    ap.add_argument("--targets", type=lambda s: [float(x) for x in s.split(",")], default=[20.0, 35.0, 50.0])
    ap.add_argument("--domains", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument("--extend-host", type=lambda s: [float(x) for x in s.split(",")],
                    help="run more host-tier sizes (GB per node) for an existing --out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        doc = json.loads((out / "results.json").read_text())
        _finish(doc)
    elif args.extend_host:  # more host-tier points for an existing run
        doc = json.loads((out / "results.json").read_text())
        prof = load_profile(doc["setup"]["profile"])
        recs = synthesize(doc["setup"]["sessions"], args.seed, block_size=args.block_size, turn_scale=args.turn_scale)
        reqs = from_trace_records(recs, args.block_size)
        shared = shared_ids(reqs)
        bb = doc["setup"]["block_bytes"]
        doc["host_tier"] += [run_point(reqs, shared, args, prof, "state_aware", args.host_lanes, int(gb * 1e9 // bb))
                             for gb in args.extend_host]
        _finish(doc)
        (out / "results.json").write_text(json.dumps(doc, indent=2, default=lambda x: None))
    else:
        t0 = time.monotonic()
        prof = load_profile(args.profile)
        recs = synthesize(args.sessions, args.seed, block_size=args.block_size, turn_scale=args.turn_scale)
        reqs = from_trace_records(recs, args.block_size)
        shared = shared_ids(reqs)
        block_bytes = args.block_size * prof.state["bytes_per_token"]
        full_host = int(prof.memory["host_blocks_per_node"] * prof.block_size / args.block_size)
        setup = {"gpus": args.nodes * 8, "nodes": args.nodes, "pd": args.pd, "profile": prof.name,
                 "profile_notes": prof.source.get("notes", []), "sessions": args.sessions,
                 "requests_in_trace": len(reqs), "turn_scale": args.turn_scale, "block_size": args.block_size,
                 "block_bytes": block_bytes, "host_blocks_default": full_host, "think_cap_ms": args.think_cap_ms,
                 "think_scale": args.think_scale, "ramp_per_lane_s": args.ramp_per_lane_s,
                 "settle_s": args.settle_s, "duration_s": args.duration_s, "domains": args.domains}
        print(f"{len(reqs):,} requests in the trace; {args.nodes * 8} GPUs", file=sys.stderr, flush=True)
        pareto = [run_point(reqs, shared, args, prof, pol, lanes, full_host)
                  for pol in args.policies for lanes in args.lanes]
        host = [run_point(reqs, shared, args, prof, "state_aware", args.host_lanes, int(gb * 1e9 // block_bytes))
                for gb in args.host_gb]
        doc = {"setup": setup, "pareto": pareto, "host_tier": host, "elapsed_s": round(time.monotonic() - t0, 1)}
        _finish(doc)
        (out / "results.json").write_text(json.dumps(doc, indent=2, default=lambda x: None))
    plot(out, doc, args.targets)
    text = table(doc, args.targets)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
