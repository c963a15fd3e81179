"""`disagg sim run`: replay a trace (or a synthetic agentic workload) in the simulator.

    disagg sim run --policy state_aware --workers 16 --sessions 96 --turns 12
    disagg sim run --trace trace.jsonl --block-size 512 --policy all --mode open
    disagg sim run --prefill 4 --decode 12 --cost-profile my_h200.json

``--policy all`` runs our router and every baseline on the same workload and
prints one row each.
"""

from __future__ import annotations

import argparse
import json
import sys

from disagg.router.baselines import BASELINES
from disagg.sim.cost_model import cost_profile
from disagg.sim.simulator import ClusterConfig, Simulator
from disagg.sim.workload import SynthConfig, load_mooncake_jsonl, synth_sessions

POLICIES = ["state_aware", *BASELINES]
COLUMNS = [
    ("hit_vs_theory", "hit/theory", "{:.3f}"),
    ("hit_rate", "hit", "{:.3f}"),
    ("max_mean_queue", "max/mean q", "{:.2f}"),
    ("ttft_p50", "TTFT p50", "{:.3f}"),
    ("ttft_p90", "TTFT p90", "{:.3f}"),
    ("itl_p90", "ITL p90", "{:.4f}"),
    ("interactivity_p90", "tok/s/user p90", "{:.1f}"),
    ("tokens_per_s_per_gpu", "tok/s/GPU", "{:.0f}"),
]


def format_table(rows: dict[str, dict[str, float]]) -> str:
    head = f"{'policy':<16}" + "".join(f"{label:>15}" for _, label, _ in COLUMNS)
    lines = [head, "-" * len(head)]
    for name, s in rows.items():
        lines.append(f"{name:<16}" + "".join(f"{fmt.format(s[key]):>15}" for key, _, fmt in COLUMNS))
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    if args.trace:
        requests = load_mooncake_jsonl(args.trace, args.block_size)
    else:
        requests = synth_sessions(
            SynthConfig(num_sessions=args.sessions, turns=args.turns, block_size=args.block_size), seed=args.seed
        )
    cluster = ClusterConfig(
        num_workers=args.workers,
        num_prefill=args.prefill,
        num_decode=args.decode,
        workers_per_node=args.workers_per_node,
        device_blocks=args.device_blocks,
        host_blocks=args.host_blocks,
        disk_blocks=args.disk_blocks,
        stats_period_s=args.stats_period,
    )
    cost = cost_profile(args.cost_profile)
    policies = POLICIES if args.policy == "all" else [args.policy]
    rows = {}
    for i, policy in enumerate(policies):
        print(f"[{i + 1}/{len(policies)}] simulating {policy} ...", file=sys.stderr, flush=True)
        sim = Simulator(requests, policy, cluster, cost, mode=args.mode, lanes=args.lanes, seed=args.seed)
        result = sim.run()
        rows[policy] = result.summary
        if args.json:
            print(json.dumps({"policy": policy, **result.summary, "router": result.router_metrics}))
    if not args.json:
        print(format_table(rows))
    return 0


def add_sim_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register `sim run` under the main CLI's subparsers."""
    sim = subparsers.add_parser("sim", help="discrete-event cluster simulator")
    sim_sub = sim.add_subparsers(dest="sim_command", required=True)
    run = sim_sub.add_parser("run", help="replay a trace or synthetic sessions against a router")
    run.add_argument("--trace", help="mooncake_trace-style JSONL (default: synthetic sessions)")
    run.add_argument("--policy", default="state_aware", choices=[*POLICIES, "all"])
    run.add_argument("--workers", type=int, default=16, help="aggregated workers")
    run.add_argument("--prefill", type=int, default=0, help="P/D: prefill workers")
    run.add_argument("--decode", type=int, default=0, help="P/D: decode workers")
    run.add_argument("--workers-per-node", type=int, default=8)
    run.add_argument("--device-blocks", type=int, default=2048)
    run.add_argument("--host-blocks", type=int, default=32768)
    run.add_argument("--disk-blocks", type=int, default=0)
    run.add_argument("--stats-period", type=float, default=0.0, help="seconds between worker stats (0 = live)")
    run.add_argument("--cost-profile", default="small", help="small | large | path to a JSON profile")
    run.add_argument("--mode", default="closed", choices=["closed", "open"])
    run.add_argument("--lanes", type=int, default=64, help="closed-loop concurrency")
    run.add_argument("--sessions", type=int, default=96)
    run.add_argument("--turns", type=int, default=12)
    run.add_argument("--block-size", type=int, default=256)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--json", action="store_true", help="one JSON line per policy")
    run.set_defaults(func=_run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg")
    add_sim_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
