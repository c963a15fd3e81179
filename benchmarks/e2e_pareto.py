"""End-to-end agentic benchmark: disaggregated (host tier) vs aggregated, one Ray cluster.

    python benchmarks/e2e_pareto.py --out results/e2e [--concurrency 1,2,4,8] [--requests 40]
    python benchmarks/e2e_pareto.py --out results/e2e --plot-only --targets 15,20   (redraw)

Starts the embedded default (``deployments/configs/local-cpu.yaml``: the tiny
reference model on CPU, one prefill + one decode replica sharing the node's
host tier) at ``/`` and the same config in aggregated mode (one decode replica
that prefills everything itself) at ``/agg`` on the same local Ray cluster,
then replays one CPU-sized synthetic agentic trace against both with the
``disagg.tools.bench`` harness: a closed-loop sweep over the concurrencies, each
sweep point bounded by a request count. The two stacks are measured one after
the other in the same process, so their ratios share the machine's state.

Output (``--out``)::

    trace.jsonl                      the replayed trace
    disaggregated/, aggregated/      one ``disagg bench`` results directory each
                                     (summary.json, runs/c*/, pareto.png, latency_cdf.png)
    pareto.png                       both Pareto fronts on one plot
    latency_cdf.png                  TTFT / ITL CDFs of every run of both stacks
    compare.png                      A/B: aggregated (A) vs disaggregated (B), B/A at targets
    table.md, results.json           the figures table printed at the end

tok/s/GPU counts one "GPU" per engine replica: 2 for the disaggregated stack
(prefill + decode), 1 for the aggregated one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import httpx

from disagg.config import AppConfig, load_config
from disagg.launch.local import free_port, local_app, wait_healthy
from disagg.tools.bench.plots import plot_compare, plot_latency_cdfs, plot_pareto
from disagg.tools.bench.report import latency_lists, load_sweep, sweep_points
from disagg.tools.bench.sweep import BenchParams, run_bench_sync, write_plots
from disagg.tools.bench.synth import SynthConfig, synthesize
from disagg.tools.bench.trace import TraceRecord, save_trace

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "deployments" / "configs" / "local-cpu.yaml"
# the tiny model's byte-level vocabulary: ids [3, 259) are plain bytes
FIRST_TOKEN_ID, VOCAB_SIZE = 3, 259
STACKS = ("disaggregated", "aggregated")


def cpu_trace(
    sessions: int,
    seed: int = 0,
    *,
    max_input: int = 1500,
    out_min: int = 8,
    out_max: int = 24,
    turn_scale: float = 0.25,
) -> list[TraceRecord]:
    """The synthetic agentic trace at CPU scale: prompts ~700-1500 tokens, outputs 8-24.

    Scale 0.04 of the full-scale shape (576-token shared prefix, first turn
    ~950 tokens growing each turn, compaction at ``max_input``), 64-token
    blocks (the engine's block size), a quarter of the turns per session and
    outputs re-centred on ~15 tokens (clamped to [out_min, out_max]).
    """
    shape = SynthConfig(output_median=350.0, output_p90=550.0)  # x 0.04 = 14 / 22 tokens
    records = synthesize(
        sessions,
        seed,
        block_size=64,
        scale=0.04,
        turn_scale=turn_scale,
        max_input=max_input,
        subagents=False,
        config=shape,
    )
    return [
        dataclasses.replace(r, output_length=min(out_max, max(out_min, r.output_length)))
        for r in records
    ]


def stack_configs(port: int) -> tuple[AppConfig, AppConfig]:
    """(disaggregated, aggregated) configs of the embedded default."""
    cfg = load_config(CONFIG)
    cfg.http.port = port
    agg = cfg.model_copy(deep=True)
    agg.deployment.mode = "aggregated"
    return cfg, agg


def engine_replicas(cfg: AppConfig) -> int:
    """Engine replicas of a stack: the "GPUs" of the per-GPU figures."""
    d = cfg.deployment
    n = d.decode.max_replicas if d.decode.min_replicas is not None else d.decode.num_replicas
    if d.mode == "disaggregated":
        p = d.prefill
        n += p.max_replicas if p.min_replicas is not None else p.num_replicas
    return n



def warm_up(url: str, model: str) -> None:
    """One short request so the first measured request does not pay lazy start-up."""
    body = {"model": model, "prompt": list(range(10, 74)), "max_tokens": 2, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()


def bench_params(url: str, trace: Path, out: Path, num_gpus: int, args) -> BenchParams:
    return BenchParams(
        url=url,
        trace=str(trace),
        out=str(out),
        concurrency=list(args.concurrency),
        max_requests=args.requests,
        warmup_requests=args.warmup_requests,
        think_cap_ms=args.think_cap_ms,
        think_scale=args.think_scale,
        sample_start_turn=not args.no_sample_start,
        salt=args.salt,
        seed=args.seed,
        num_gpus=num_gpus,
        targets=list(args.targets),
        vocab_size=VOCAB_SIZE,
        first_token_id=FIRST_TOKEN_ID,
        default_block_size=64,
        progress=not args.no_progress,
        quiet=args.quiet,
    )


def run_ab(args) -> dict:
    """Deploy both stacks, sweep both, write every figure; returns {stack: sweep document}."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = cpu_trace(args.sessions, args.seed)
    trace_path = out / "trace.jsonl"
    save_trace(records, trace_path)
    disagg_cfg, agg_cfg = stack_configs(args.port or free_port())
    gpus = {"disaggregated": engine_replicas(disagg_cfg), "aggregated": engine_replicas(agg_cfg)}
    docs: dict[str, dict] = {}
    from ray import serve

    from deployments.app import build_app

    t0 = time.monotonic()
    with local_app(disagg_cfg) as base:
        serve.run(build_app(agg_cfg), name="agg", route_prefix="/agg", blocking=False)
        urls = {"disaggregated": base, "aggregated": base + "/agg"}
        for url in urls.values():
            wait_healthy(url)
            warm_up(url, disagg_cfg.model.openai_name)
        print(f"stacks up in {time.monotonic() - t0:.0f} s", flush=True)
        # each stack gets salts of its own, so neither profits from the other's
        # session state (the aggregated app has its own engine anyway)
        for k, stack in enumerate(STACKS):
            print(f"=== {stack} ({gpus[stack]} engine replicas) at {urls[stack]}", flush=True)
            params = bench_params(urls[stack], trace_path, out / stack, gpus[stack], args)
            params.salt = args.salt + 100 * k
            docs[stack] = run_bench_sync(params, records)
    print(f"sweeps done in {time.monotonic() - t0:.0f} s", flush=True)
    write_figures(out, docs, args.targets)
    return docs


def write_figures(out: Path, docs: dict[str, dict], targets: list[float]) -> dict[str, Path]:
    series = {s: (s, *sweep_points(docs[s])) for s in STACKS}
    paths = {
        "pareto": plot_pareto(
            [series["aggregated"], series["disaggregated"]],
            out / "pareto.png",
            targets,
            title="disaggregated (host tier) vs aggregated: tok/s/GPU vs P90 interactivity",
        )
    }
    lat = {}
    for s in STACKS:
        for label, v in latency_lists(docs[s]).items():
            lat[f"{s[:3]} {label}"] = v
    paths["latency_cdf"] = plot_latency_cdfs(lat, out / "latency_cdf.png")
    paths["compare"], rows = plot_compare(
        series["aggregated"], series["disaggregated"], out / "compare.png", targets
    )
    (out / "compare.json").write_text(json.dumps(rows, indent=2))
    return paths


def _f(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def figures_rows(docs: dict[str, dict]) -> list[dict]:
    rows = []
    for stack in STACKS:
        for e in docs[stack]["runs"]:
            s = e["summary"]
            rows.append(
                {
                    "stack": stack,
                    "run": e["label"],
                    "gpus": s["num_gpus"],
                    "requests": s["num_requests"],
                    "failed": s["num_failed"],
                    "ttft_p50_ms": s["ttft_ms"]["p50"],
                    "ttft_p90_ms": s["ttft_ms"]["p90"],
                    "itl_p90_ms": s["itl_ms"]["p90"],
                    "p90_interactivity": s["p90_interactivity"],
                    "total_tps_per_gpu": s["total_tps_per_gpu"],
                    "hit_usage": s["cache_hit_usage"],
                    "hit_server": s["cache_hit_server"],
                    "hit_theoretical": s["cache_hit_theoretical"],
                }
            )
    return rows


def format_table(rows: list[dict]) -> str:
    head = (
        "| stack | run | GPUs | req (failed) | TTFT P50 ms | TTFT P90 ms | ITL P90 ms "
        "| P90 interactivity tok/s/user | total tok/s/GPU "
        "| cache hit usage | cache hit server | cache hit theoretical |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['stack']} | {r['run']} | {r['gpus']} | {r['requests']} ({r['failed']}) "
            f"| {_f(r['ttft_p50_ms'], '.0f')} | {_f(r['ttft_p90_ms'], '.0f')} "
            f"| {_f(r['itl_p90_ms'], '.1f')} | {_f(r['p90_interactivity'], '.1f')} "
            f"| {_f(r['total_tps_per_gpu'], ',.0f')} | {_f(r['hit_usage'], '.1%')} "
            f"| {_f(r['hit_server'], '.1%')} | {_f(r['hit_theoretical'], '.1%')} |"
        )
    return "\n".join(lines)


def ratio_lines(docs: dict[str, dict]) -> str:
    """disaggregated / aggregated at each concurrency (same run, same machine)."""
    by = {s: {e["label"]: e["summary"] for e in docs[s]["runs"]} for s in STACKS}
    lines = [
        "| run | TTFT P50 D/A | TTFT P90 D/A | P90 interactivity D/A | tok/s/GPU D/A |",
        "|---|---|---|---|---|",
    ]
    for label, d in by["disaggregated"].items():
        a = by["aggregated"].get(label)
        if a is None:
            continue

        def r(x, y):
            return "n/a" if not x or not y else f"{x / y:.2f}"

        lines.append(
            f"| {label} | {r(d['ttft_ms']['p50'], a['ttft_ms']['p50'])} "
            f"| {r(d['ttft_ms']['p90'], a['ttft_ms']['p90'])} "
            f"| {r(d['p90_interactivity'], a['p90_interactivity'])} "
            f"| {r(d['total_tps_per_gpu'], a['total_tps_per_gpu'])} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/e2e")
    p.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8]
    )
    p.add_argument("--requests", type=int, default=40, help="measured requests per sweep point")
    p.add_argument("--warmup-requests", type=int, default=0, help="per sweep point, not measured")
    p.add_argument(
        "--no-sample-start",
        action="store_true",
        help="lanes start at turn 0 (default: each lane's first session starts at a random "
        "turn and that first request is warm-up)",
    )
    p.add_argument("--sessions", type=int, default=24, help="top-level sessions in the trace")
    p.add_argument("--think-cap-ms", type=float, default=2000.0)
    p.add_argument("--think-scale", type=float, default=0.05, help="closed-loop think time factor")
    p.add_argument(
        "--targets",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[10.0, 15.0, 20.0, 30.0],
        help="interactivities (tok/s/user) to read the fronts at",
    )
    p.add_argument(
        "--plot-only",
        action="store_true",
        help="no serving: redraw the figures and the table from an existing --out",
    )
    p.add_argument("--salt", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0, help="HTTP port (default: a free one)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no per-run summaries")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    if args.plot_only:
        docs = {s: load_sweep(Path(args.out) / s) for s in STACKS}
        for doc in docs.values():
            write_plots(doc, args.targets)
        write_figures(Path(args.out), docs, args.targets)
    else:
        docs = run_ab(args)
    rows = figures_rows(docs)
    table = format_table(rows)
    ratios = ratio_lines(docs)
    compare = json.loads((Path(args.out) / "compare.json").read_text())
    at = "\n".join(
        f"  {c['target']:g} tok/s/user: aggregated {_f(c['a'], ',.0f')}  "
        f"disaggregated {_f(c['b'], ',.0f')}  D/A {_f(c['ratio'], '.2f')}"
        for c in compare
    )
    elapsed = time.monotonic() - t0
    if args.plot_only and (Path(args.out) / "results.json").exists():
        elapsed = json.loads((Path(args.out) / "results.json").read_text())["elapsed_s"]
    text = (
        f"{table}\n\nratios, disaggregated / aggregated:\n\n{ratios}\n\n"
        f"Pareto fronts at target interactivities (tok/s/GPU):\n{at}\n\n"
        f"total {elapsed:.0f} s\n"
    )
    print(text)
    out = Path(args.out)
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(
        json.dumps({"rows": rows, "compare": compare, "elapsed_s": round(elapsed, 1)}, indent=2)
    )
    invalid = [f"{r['stack']}/{r['run']}" for r in rows if r["requests"] == 0 or r["failed"] > 0]
    if invalid:
        print(f"runs with failures: {invalid}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
