"""`disagg sim`: replay traces in the simulator, sweep configurations, calibrate profiles.

    disagg sim run --policy all --workers 16 --sessions 96 --turns 12
    disagg sim run --agentic 2000 --turn-scale 0.1 --block-size 1024 --profile mi355x-kimi-k3-tp8 \\
        --workers 64 --workers-per-node 1 --concurrency 2048 --bench
    disagg sim run --trace t.jsonl --prefill 4 --decode 12 --profile my.json --domains 4 --jobs 2
    disagg sim sweep --agentic 400 --profile mi355x-kimi-k3-tp8 --engines 8,16 --pd agg,1:3,1:1 \\
        --host-blocks 0,200000 --policies state_aware,round_robin --concurrency 64,128,256 --target 50
    disagg sim calibrate --engine tiny --threads 1 -o cpu-tiny.json
    disagg sim calibrate --from-bench results/c1 --base cpu-tiny --local-prefill-max-tokens 256 -o fitted.json
    disagg sim calibrate --from-engine-bench engine_fla.json --transfer transfer.json -o h200.json

Workloads: ``--trace`` (a ``disagg trace`` JSONL or a Mooncake-style one,
told apart by its first line or named by ``--format``), ``--agentic N`` (the
benchmark's AgentX-style generator, ``disagg.tools.bench.synth``) or the
simulator's own short sessions (``--sessions``/``--turns``). ``--policy all``
runs our router and every baseline on the same workload, one row each.

Hit is reported three ways: ``hit`` (resumed / prompt tokens), ``hit/theory``
(against an infinite cache) and ``hit/bound`` (against Belady's optimum with
the cluster's own capacities, on the run's arrival order:
``disagg.tools.sim.bound``; ``--no-bound`` skips it). ``--explain-misses`` adds
where the rest went: a placement another worker could have resumed further,
blocks held with no resume point, blocks evicted, or blocks not computed yet;
and which checkpoints paid: per rule that kept them (the engine's own, the
learned placement's branch, back and start points, a prefill chunk's), how
many prefills kept, how many resumes started from one, and their share of
every resumed token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from disagg.config import KEEP_TURNS, check_keep_turns
from disagg.costs.model import PROFILES
from disagg.costs.profile import cost_profile, profile_names
from disagg.router.baselines import BASELINES
from disagg.tools.sim.bound import capacity_bound
from disagg.tools.sim.driver import ReplayConfig
from disagg.tools.sim.metrics import CHECKPOINT_KINDS, LOST
from disagg.tools.sim.retention import RETENTION_POLICIES
from disagg.tools.sim.simulator import (
    HOST_POLICIES,
    HOST_WRITES,
    OUTPUT_HINTS,
    ROUTER_COSTS,
    ClusterConfig,
)
from disagg.tools.sim.workload import (
    SimRequest,
    SynthConfig,
    from_trace_records,
    shared_ids,
    synth_sessions,
)

POLICIES = ["state_aware", *BASELINES]
DEFAULT_BLOCK_SIZE = 256
COLUMNS = [
    ("hit_vs_theory", "hit/theory", "{:.3f}"),
    ("hit_rate", "hit", "{:.3f}"),
    ("hit_vs_bound", "hit/bound", "{:.3f}"),
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
        lines.append(f"{name:<16}" + "".join(f"{fmt.format(s[key]) if key in s else '-':>15}"
                                             for key, _, fmt in COLUMNS))
    return "\n".join(lines)


def format_lost(rows: dict[str, dict[str, float]]) -> str:
    """``--explain-misses``: the reuse each policy lost, by where (``disagg.tools.sim.metrics.reuse_lost``)."""
    labels = [(k, k.removeprefix("lost_").replace("_", " ")) for k in LOST]
    head = f"{'reuse lost':<16}" + "".join(f"{label:>15}" for _, label in labels) + f"{'total':>15}"
    lines = ["", "share of the tokens an infinite cache would have resumed, lost to:", head, "-" * len(head)]
    for name, s in rows.items():
        if all(k in s for k in LOST):
            lines.append(f"{name:<16}" + "".join(f"{s[k]:>15.3f}" for k in LOST) + f"{sum(s[k] for k in LOST):>15.3f}")
    return "\n".join(lines)


def format_checkpoints(rows: dict[str, dict[str, float]]) -> str:
    """``--explain-misses``: per policy and kind of checkpoint (``metrics.checkpoint_use``), kept /
    resumes from one / share of the resumed tokens."""
    head = f"{'checkpoints':<16}" + "".join(f"{kind:>22}" for kind in CHECKPOINT_KINDS)
    lines = ["", "checkpoints by the rule that kept them: kept / resumes from one / share of resumed tokens:",
             head, "-" * len(head)]
    for name, s in rows.items():
        if all(f"ckpt_kept_{k}" in s for k in CHECKPOINT_KINDS):
            cells = (f"{s[f'ckpt_kept_{k}']:.0f} / {s[f'ckpt_resumes_{k}']:.0f} / {s[f'ckpt_tokens_{k}']:.3f}"
                     for k in CHECKPOINT_KINDS)
            lines.append(f"{name:<16}" + "".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def keep_turns_arg(text: str) -> int | str:
    """``--keep-turns``: 'auto' or an integer >= 0 (``disagg.config.check_keep_turns``)."""
    value: int | str = text if text == "auto" else int(text) if text.lstrip("-").isdigit() else text
    try:
        check_keep_turns(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _strs(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# ---- shared options ----------------------------------------------------------------------
def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", help="trace JSONL: the disagg trace format or a Mooncake-style trace (see --format)")
    g.add_argument("--format", dest="trace_format", default="auto", choices=["auto", "disagg", "mooncake"],
                   help="--trace: its format (auto: from the first line); Mooncake lines get sessions by "
                        "hash prefix, as `disagg trace import-mooncake` does")
    g.add_argument("--agentic", type=int, metavar="N", help="N sessions of the AgentX-style synthetic generator")
    g.add_argument("--scale", type=float, default=1.0, help="--agentic: multiplies token lengths")
    g.add_argument("--turn-scale", type=float, default=1.0, help="--agentic: multiplies turns per session")
    g.add_argument("--max-input", type=int, help="--agentic: prompt cap (tokens)")
    g.add_argument("--sessions", type=int, default=96, help="simulator sessions (no --trace / --agentic)")
    g.add_argument("--turns", type=int, default=12, help="simulator sessions: turns each")
    g.add_argument("--block-size", type=int,
                   help="tokens per hash block (default 256; a Mooncake trace's default is 512)")
    g.add_argument("--seed", type=int, default=0, help="workload seed")


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--workers-per-node", type=int, default=8, help="engines sharing a node's host tier")
    g.add_argument("--gpus-per-worker", type=int, help="GPUs per engine (default: the profile's, else 1)")
    g.add_argument("--device-blocks", type=int,
                   help="device cache per worker, in --block-size blocks (default: the profile's memory, else 2048)")
    g.add_argument("--disk-blocks", type=int, default=0, help="disk tier per node, in blocks (0 = none)")
    g.add_argument("--checkpoint-every", type=int, default=0,
                   help="periodic checkpoints every N blocks (0 = off, as serving's engine.checkpoint_interval)")
    g.add_argument("--checkpoint-prompt-end", action=argparse.BooleanOptionalAction, default=True,
                   help="a checkpoint at each prompt end (the engine keeps one: a hand-off and an exact "
                        "follow-up resume there)")
    g.add_argument("--no-last-full-block", action="store_true", help="no checkpoint at the last full block")
    g.add_argument("--learned-checkpoints", action=argparse.BooleanOptionalAction, default=True,
                   help="extra checkpoints where follow-ups diverge, as serving places them "
                        "(engine.learned_checkpoints, disagg.reuse.placement)")
    g.add_argument("--retention", default="checkpoints", choices=list(RETENTION_POLICIES),
                   help="tier eviction order (disagg.tools.sim.retention): lru; checkpoints, what serving "
                        "does (a session's superseded checkpoints go first); session, also what only the "
                        "trace knows (ended sessions' objects, the devices a session left)")
    g.add_argument("--speculative-first", action="store_true",
                   help="a prefill's speculative checkpoints (the start prior's) go first in its node's "
                        "tiers as they land, as serving's transfer.host.speculative_first (no effect under "
                        "--retention lru, which tracks nothing)")
    g.add_argument("--keep-turns", type=keep_turns_arg, default=KEEP_TURNS, metavar="auto|N",
                   help="a session's private checkpoints of turns older than its newest N go first, as "
                        "serving's transfer.host.keep_turns: 0 no limit, or 'auto', N learned from how many "
                        "turns back the sessions' prompts resume (no effect under --retention lru)")
    g.add_argument("--session-ends", nargs="?", const="turn", choices=("turn", "after"), default=None,
                   help="clients say when a session ends: 'turn' (the flag alone) marks its last turn (the "
                        "API's session_end), which writes no host tier; 'after' ends it once that turn is "
                        "answered (DELETE /v1/sessions/{id}). Either way the session's private state is "
                        "then evicted first (needs --retention checkpoints or session)")
    g.add_argument("--output-hint", default="none", choices=list(OUTPUT_HINTS),
                   help="what the router is told of each request's output: none (serving's clients send a "
                        "max_tokens cap at most; the state-aware router learns what sessions generate), or "
                        "exact (the trace's output lengths: an oracle, what rounds 1-23 of docs/router.md ran)")
    g.add_argument("--host-policy", default="lru", choices=list(HOST_POLICIES),
                   help="host tiers' eviction order: lru (serving's default, transfer.host.policy; here "
                        "refreshed by each turn's store too), or serving's s3fifo or arc (its own classes, "
                        "refreshed by reads)")
    g.add_argument("--host-write", default="victim", choices=list(HOST_WRITES),
                   help="victim (default): stores write the node's host tier too, but a full host tier lets "
                        "go first of what a device of its node holds, a device's evictions go back to it, and "
                        "workers read their node's other decoding devices (Simulator NOTE 12; serving's "
                        "transfer.host.victim, whose replicas recall what a node mate's device holds; without "
                        "a host tier, through); through: every store writes the node's host tier too, and "
                        "nothing more (serving with transfer.host.victim false; rounds 1-42 of "
                        "docs/router.md); back: stores go to the device, and what a device evicts to the host "
                        "tier (Simulator NOTE 6); victim-own: victim without reads of the node's other devices "
                        "(serving's transfer.host.victim with recall_ms 0)")
    g.add_argument("--no-peer-reads", action="store_true",
                   help="P/D: a prefill reads only its own node's tiers, not its decode worker's node's")
    g.add_argument("--spill-to-pool", action=argparse.BooleanOptionalAction, default=True,
                   help="P/D: what a node without prefill workers evicts (demoted objects aside) goes to a "
                        "prefill node's host tier (serving: transfer.spill)")
    g.add_argument("--stats-period", type=float, default=0.0, help="seconds between worker stats (0 = live)")
    g.add_argument("--explain-misses", action="store_true",
                   help="also say where the reuse an infinite cache would have had was lost: placement, "
                        "checkpoint, evicted, in flight (shares of its tokens; reads every tier per request)")
    g.add_argument("--chunk-cache", action="store_true",
                   help="engines cache each prefill chunk as it completes, as vLLM's prefix caching does "
                        "(requests admitted later resume a prefill still running; Simulator NOTE 11); "
                        "default: a prefill is cached when it ends, as the reference engine does")
    g.add_argument("--node-compute-slots", type=float,
                   help="engines a node runs at full speed at once (default: the profile's; 0 = no sharing)")
    g.add_argument("--profile", "--cost-profile", dest="profile", default="small",
                   help=f"cost model ({', '.join(PROFILES)}), engine profile ({', '.join(profile_names())}) or file")
    g.add_argument("--request-overhead-ms", type=float, help="override the profile's serving-path TTFT overhead")


def _add_replay_args(p: argparse.ArgumentParser, conc_default: str) -> None:
    g = p.add_argument_group("replay (the benchmark's closed loop)")
    g.add_argument("--mode", default="closed", choices=["closed", "open"],
                   help="closed-loop lanes or open-loop timestamps")
    g.add_argument("--concurrency", "--lanes", dest="concurrency", default=conc_default,
                   help="closed-loop lanes" + (" (comma list)" if "," in conc_default else ""))
    g.add_argument("--think-cap-ms", type=float, default=float("inf"), help="closed loop: cap on think time")
    g.add_argument("--think-scale", type=float, default=1.0, help="closed loop: multiplies think time")
    g.add_argument("--ramp-s", type=float, default=0.0, help="lane i starts at i * ramp / lanes")
    g.add_argument("--max-requests", type=int, help="measured requests (then lanes stop)")
    g.add_argument("--duration", type=float, help="measured seconds of simulated time")
    g.add_argument("--warmup-requests", type=int, default=0, help="first N requests are warm-up")
    g.add_argument("--warmup", type=float, default=0.0, help="simulated seconds of warm-up")
    g.add_argument("--sample-start-turn", action="store_true", help="each lane starts mid-session (warm-up)")
    g.add_argument("--recycle", action="store_true", help="replay sessions again with a new salt when they run out")
    g.add_argument("--speedup", type=float, default=1.0, help="open loop: timestamps / speedup")
    g.add_argument("--domains", type=int, default=1, help="router domains (independent slices of the cluster)")
    g.add_argument("--jobs", type=int, default=1, help="processes for domains / sweep points")
    g.add_argument("--gpu-cost", help="$/GPU-hour or a preset (mi355x, h200, ...) for tokens per dollar")


def load_workload(args: argparse.Namespace) -> list[SimRequest]:
    """The requests the flags name; sets ``args.block_size`` when it was left to its default.

    Raises:
        TraceError: a bad trace (the message names the file, line and field).
        OSError: an unreadable trace.
    """
    if args.trace:
        from disagg.tools.bench.mooncake import MOONCAKE_BLOCK_SIZE, import_mooncake, trace_format
        from disagg.tools.bench.trace import load_trace

        fmt = trace_format(args.trace) if args.trace_format == "auto" else args.trace_format
        if fmt == "mooncake":
            args.block_size = args.block_size or MOONCAKE_BLOCK_SIZE
            recs = import_mooncake(args.trace, block_size=args.block_size)
        else:
            args.block_size = args.block_size or DEFAULT_BLOCK_SIZE
            recs = load_trace(args.trace, default_block_size=args.block_size)
        return from_trace_records(recs, args.block_size)
    args.block_size = args.block_size or DEFAULT_BLOCK_SIZE
    if args.agentic:
        from disagg.tools.bench.synth import synthesize

        recs = synthesize(args.agentic, args.seed, block_size=args.block_size, scale=args.scale,
                          turn_scale=args.turn_scale, max_input=args.max_input)
        return from_trace_records(recs, args.block_size)
    return synth_sessions(SynthConfig(num_sessions=args.sessions, turns=args.turns, block_size=args.block_size),
                          seed=args.seed)


def build_cluster(args: argparse.Namespace, workers: int, prefill: int = 0, decode: int = 0,
                  host_blocks: int | None = None):
    """(ClusterConfig, CostModel) from the flags and the profile's defaults."""
    from disagg.costs.profile import load_profile

    if args.session_ends and args.retention == "lru":
        raise SystemExit("disagg sim: --session-ends needs --retention checkpoints or session "
                         "(lru tracks no sessions)")
    cost = cost_profile(args.profile)
    prof = None if args.profile in PROFILES else load_profile(args.profile)
    if args.request_overhead_ms is not None:
        cost.request_overhead_s = args.request_overhead_ms / 1000.0
    gpw = args.gpus_per_worker or (prof.gpus_per_worker if prof else 1)
    scale = prof.block_size / args.block_size if prof else 1.0  # profile memory is in its own block size
    mem = prof.memory if prof else {}
    if args.device_blocks:
        dev = args.device_blocks
    else:
        dev = max(1, int(mem["device_blocks"] * scale)) if "device_blocks" in mem else 2048
    if host_blocks is None:
        host_blocks = args.host_blocks if args.host_blocks is not None else (
            int(mem["host_blocks_per_node"] * scale) if "host_blocks_per_node" in mem else 32768)
    cluster = ClusterConfig(num_workers=workers, num_prefill=prefill, num_decode=decode,
                            workers_per_node=args.workers_per_node, gpus_per_worker=gpw, device_blocks=dev,
                            host_blocks=host_blocks, disk_blocks=args.disk_blocks,
                            checkpoint_every_blocks=args.checkpoint_every,
                            checkpoint_last_full_block=not args.no_last_full_block,
                            checkpoint_prompt_end=args.checkpoint_prompt_end, stats_period_s=args.stats_period,
                            learned_checkpoints=args.learned_checkpoints, speculative_first=args.speculative_first,
                            keep_turns=args.keep_turns,
                            host_policy=args.host_policy, host_write=args.host_write,
                            retention=args.retention, session_ends=bool(args.session_ends),
                            session_end_after=args.session_ends == "after", output_hint=args.output_hint,
                            peer_reads=not args.no_peer_reads,
                            spill_to_pool=args.spill_to_pool, explain_misses=args.explain_misses,
                            chunk_cache=args.chunk_cache,
                            node_compute_slots=args.node_compute_slots if args.node_compute_slots is not None
                            else float((prof.limits if prof else {}).get("node_compute_slots", 0.0)))
    return cluster, cost


def build_replay(args: argparse.Namespace, concurrency: int) -> ReplayConfig:
    return ReplayConfig(mode=args.mode, concurrency=concurrency, think_cap_ms=args.think_cap_ms,
                        think_scale=args.think_scale, ramp_s=args.ramp_s, sample_start_turn=args.sample_start_turn,
                        recycle=args.recycle, max_requests=args.max_requests, duration_s=args.duration,
                        warmup_requests=args.warmup_requests, warmup_s=args.warmup, seed=args.seed,
                        run_salt=1 if args.recycle else 0, speedup=args.speedup)


def _price(args: argparse.Namespace) -> float | None:
    if not args.gpu_cost:
        return None
    from disagg.tools.bench.cost import gpu_hour_price

    return gpu_hour_price(args.gpu_cost)


def _load_or_fail(args: argparse.Namespace) -> list[SimRequest] | None:
    """``load_workload``, or None after a one-line error on stderr."""
    from disagg.tools.bench.trace import TraceError

    try:
        return load_workload(args)
    except (TraceError, OSError) as exc:
        print(f"disagg sim: {exc}", file=sys.stderr)
        return None


def router_config(text: str) -> dict | None:
    """``--router-config``: JSON text, or the path of a JSON or YAML file, checked against
    ``RouterConfig`` (an unknown key or a bad value raises ValueError); None when empty."""
    if not text:
        return None
    from disagg.router.router import RouterConfig

    if text.lstrip().startswith("{"):
        cfg = json.loads(text)
    else:
        import yaml

        with open(text) as f:
            cfg = yaml.safe_load(f) or {}
    if not isinstance(cfg, dict):
        raise ValueError("--router-config: a mapping of RouterConfig keys")
    RouterConfig.from_dict(cfg)  # raises on unknown keys and bad values
    return cfg


# ---- commands ------------------------------------------------------------------------------
def _run(args: argparse.Namespace) -> int:
    from disagg.tools.bench.metrics import format_summary
    from disagg.tools.sim.shard import simulate

    t0 = time.perf_counter()
    try:
        rc = router_config(args.router_config)
    except (ValueError, TypeError, OSError) as exc:  # bad JSON or YAML, unknown keys, bad values, no file
        print(f"disagg sim: --router-config: {exc}", file=sys.stderr)
        return 2
    requests = _load_or_fail(args)
    if requests is None:
        return 2
    shared = shared_ids(requests) if args.recycle else frozenset()
    cluster, cost = build_cluster(args, args.workers, args.prefill, args.decode)
    replay = build_replay(args, int(args.concurrency))
    price = _price(args)
    print(f"{len(requests)} requests, {cluster.num_engines} engines ({cluster.num_gpus} GPUs), "
          f"{args.domains} domain(s); workload ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    policies = POLICIES if args.policy == "all" else [args.policy]
    rows = {}
    for i, policy in enumerate(policies):
        t1 = time.perf_counter()
        res = simulate(requests, policy, cluster, cost, replay, domains=args.domains, jobs=args.jobs, seed=args.seed,
                       router_config=rc if policy == "state_aware" else None, shared_ids=shared,
                       router_costs=args.router_costs)
        wall = time.perf_counter() - t1
        print(f"[{i + 1}/{len(policies)}] {policy}: {sum(r.finish >= 0 for r in res.records)} requests in "
              f"{wall:.1f} s wall ({res.sim_events} events)", file=sys.stderr, flush=True)
        if not args.no_bound:  # hit against what the capacities allow (disagg.tools.sim.bound)
            lanes = int(args.concurrency) if args.mode == "closed" else 0
            bound = capacity_bound(requests, res.records, cluster, cost, lanes)
            cached = sum(r.cached_tokens for r in res.records if r.finish >= 0)
            res.summary["hit_vs_bound"] = cached / bound if bound else 1.0
        rows[policy] = res.summary
        if args.bench:
            print(format_summary(res.bench_summary(price), f"{policy} (simulated)"))
        if args.json:
            print(json.dumps({"policy": policy, "wall_s": round(wall, 2), **res.summary, "router": res.router_metrics}))
    if not args.json:
        print(format_table(rows))
        if args.explain_misses:
            print(format_lost(rows))
            print(format_checkpoints(rows))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from disagg.tools.sim.sweep import format_rows, grid, run_sweep

    requests = _load_or_fail(args)
    if requests is None:
        return 2
    shared = shared_ids(requests) if args.recycle else frozenset()
    hosts = _ints(args.host_blocks) if args.host_blocks else None
    base, cost = build_cluster(args, 1, host_blocks=hosts[0] if hosts else None)
    points = grid(_ints(args.engines), _strs(args.pd), hosts or [base.host_blocks], _strs(args.policies))
    replay = build_replay(args, 1)
    rows = run_sweep(requests, points, _ints(args.concurrency), base, cost, replay, args.target, _price(args),
                     jobs=args.jobs, seed=args.seed, shared_ids=shared)
    print(format_rows(rows, args.target))
    if args.json_out:
        doc = [{"point": r.point.label, "engines": r.point.engines, "pd": r.point.pd,
                "host_blocks": r.point.host_blocks, "policy": r.point.policy, "runs": r.runs,
                "at_target": r.at_target, "tokens_per_dollar": r.tokens_per_dollar} for r in rows]
        with open(args.json_out, "w") as f:
            json.dump({"target": args.target, "rows": doc}, f, indent=2)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from disagg.costs.profile import load_profile
    from disagg.tools.sim import calibrate

    try:
        if args.engine:
            prof = calibrate.time_engine(args.engine, threads=args.threads, block_size=args.engine_block_size,
                                         max_num_batched_tokens=args.chunk, max_num_seqs=args.max_num_seqs,
                                         reps=args.reps)
        elif args.from_bench:
            base = load_profile(args.base) if args.base else None
            prof = calibrate.from_bench_runs(args.from_bench, base, args.local_prefill_max_tokens)
        elif args.from_engine_bench:
            prof = calibrate.from_engine_bench(args.from_engine_bench, args.transfer)
        else:
            print("disagg sim calibrate: give --engine, --from-bench or --from-engine-bench", file=sys.stderr)
            return 2
    except ValueError as exc:
        print(f"disagg sim calibrate: {exc}", file=sys.stderr)
        return 2
    if args.name:
        prof.name = args.name
    print(prof.fit_report().format())
    print("cost model:", json.dumps(prof.cost_model().to_dict()))
    if args.out:
        prof.save(args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def add_sim_parsers(subparsers: argparse._SubParsersAction) -> None:
    """Register `sim run | sweep | calibrate` under the main CLI's subparsers."""
    sim = subparsers.add_parser("sim", help="discrete-event cluster simulator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sim_sub = sim.add_subparsers(dest="sim_command", required=True)

    run = sim_sub.add_parser("run", help="replay a trace or synthetic sessions against a router")
    _add_workload_args(run)
    _add_cluster_args(run)
    _add_replay_args(run, "64")
    run.add_argument("--policy", default="state_aware", choices=[*POLICIES, "all"], help="router policy")
    run.add_argument("--workers", type=int, default=16, help="aggregated workers")
    run.add_argument("--prefill", type=int, default=0, help="P/D: prefill workers")
    run.add_argument("--decode", type=int, default=0, help="P/D: decode workers")
    run.add_argument("--host-blocks", type=int, help="host tier per node (default: the profile's, else 32768)")
    run.add_argument("--bench", action="store_true", help="also print the benchmark's summary of each run")
    run.add_argument("--json", action="store_true", help="one JSON line per policy")
    run.add_argument("--no-bound", action="store_true",
                     help="skip hit_vs_bound: hit against Belady's optimum with the cluster's capacities")
    run.add_argument("--router-config", default="", metavar="JSON|FILE",
                     help="state_aware's RouterConfig (docs/router.md, Configuration): JSON text or a JSON/YAML "
                          "file, e.g. '{\"pending_credit\": true}'")
    run.add_argument("--router-costs", choices=ROUTER_COSTS, default="engine",
                     help="what state_aware prices time with: engine, the cost model of --profile (its prefill "
                          "rate, decode steps, state sizes and links; --router-config's plugin parameters win), "
                          "or builtin, its scorers' constants (the small profile's; disagg.router.calibration)")
    run.set_defaults(func=_run)

    sw = sim_sub.add_parser("sweep", help="P:D ratios x replicas x host tiers x policies; best at a target")
    _add_workload_args(sw)
    _add_cluster_args(sw)
    _add_replay_args(sw, "32,64,128")
    sw.add_argument("--engines", default="8", help="engine replicas (comma list)")
    sw.add_argument("--pd", default="agg,1:3,1:1", help="'agg' and/or P:D ratios (comma list)")
    sw.add_argument("--host-blocks", help="host tier blocks per node (comma list; default: the profile's)")
    sw.add_argument("--policies", default="state_aware", help="routers (comma list)")
    sw.add_argument("--target", type=float, default=50.0, help="P90 interactivity target (tok/s/user)")
    sw.add_argument("--json-out", help="write every run to this JSON file")
    sw.set_defaults(func=_sweep)

    cal = sim_sub.add_parser("calibrate", help="an engine profile from timing, saved figures or a bench run")
    cal.add_argument("--engine", metavar="PRESET", help="time the reference engine here (tiny, small, ...)")
    cal.add_argument("--threads", type=int, default=1, help="--engine: torch threads (a replica's num_threads)")
    cal.add_argument("--engine-block-size", type=int, default=64, help="--engine: tokens per cache block")
    cal.add_argument("--chunk", type=int, default=1024, help="--engine: max_num_batched_tokens")
    cal.add_argument("--max-num-seqs", type=int, default=16, help="--engine: concurrent sequences")
    cal.add_argument("--reps", type=int, default=3, help="--engine: repetitions per timed point")
    cal.add_argument("--from-bench", nargs="+", metavar="DIR", help="disagg bench results / run dirs")
    cal.add_argument("--base", help="--from-bench: the engine profile to adjust (name or file)")
    cal.add_argument("--local-prefill-max-tokens", type=int,
                     help="--from-bench: suffixes above this went to a prefill replica (fits its extra overhead)")
    cal.add_argument("--from-engine-bench", metavar="JSON", help="benchmarks/engine_bench.py --json output")
    cal.add_argument("--transfer", metavar="JSON", help="benchmarks/gpu_transfer_bench.py --json output")
    cal.add_argument("--name", help="profile name")
    cal.add_argument("-o", "--out", help="write the profile here")
    cal.set_defaults(func=_calibrate)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg")
    add_sim_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
