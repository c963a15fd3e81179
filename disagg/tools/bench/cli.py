"""Command-line front end: ``disagg trace ...`` and ``disagg bench ...``.

The main ``disagg`` parser calls :func:`add_bench_parsers`; each command's
handler is set with ``set_defaults(func=...)``, takes the parsed args and
returns an exit code. ``python -m disagg.tools.bench`` runs these commands alone.

    disagg trace synth --sessions 200 --scale 0.05 -o t.jsonl
    disagg trace stats t.jsonl
    disagg trace import-mooncake conversation_trace.jsonl -o t.jsonl
    disagg bench --url http://127.0.0.1:8000 --trace t.jsonl --concurrency 1,2,4 --out results/
    disagg bench plot results/
    disagg bench compare results-a/ results-b/ --labels A,B -o ab.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from disagg.tools.bench.pareto import DEFAULT_TARGETS
from disagg.tools.bench.preflight import FALLBACK_VOCAB_SIZE, FIRST_TOKEN_ID
from disagg.tools.bench.trace import DEFAULT_BLOCK_SIZE, TraceError


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("values must be >= 1")
    return values


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def add_bench_parsers(subparsers: Any) -> None:
    """Register ``trace`` and ``bench`` on the main parser's subparsers."""
    trace = subparsers.add_parser("trace", help="create, inspect and import agentic traces")
    trace.set_defaults(func=lambda args: (trace.print_help(), 2)[1])
    tsub = trace.add_subparsers(dest="trace_command", metavar="{synth,stats,import-mooncake}")

    synth = tsub.add_parser("synth", help="synthesize agentic coding sessions")
    synth.add_argument("--sessions", type=int, default=100, help="top-level sessions")
    synth.add_argument("--seed", type=int, default=0, help="random seed of the synthesis")
    synth.add_argument("--scale", type=float, default=1.0, help="multiplies token lengths")
    synth.add_argument("--turn-scale", type=float, default=1.0, help="multiplies turns per session")
    synth.add_argument("--block-size", type=int, default=256, help="tokens per hash block")
    synth.add_argument("--max-input", type=int, default=None, help="prompt cap (tokens)")
    synth.add_argument(
        "--session-rate",
        type=float,
        default=None,
        help="session starts per second for open-loop timestamps",
    )
    synth.add_argument("--no-subagents", action="store_true", help="no subagent sessions")
    synth.add_argument("-o", "--out", required=True, help="output JSONL")
    synth.set_defaults(func=cmd_trace_synth)

    stats = tsub.add_parser("stats", help="print a trace's statistics")
    stats.add_argument("trace", help="trace JSONL")
    stats.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help="default for records without block_size",
    )
    stats.add_argument("--json", action="store_true", help="print JSON")
    stats.set_defaults(func=cmd_trace_stats)

    moon = tsub.add_parser("import-mooncake", help="convert a Mooncake-style trace")
    moon.add_argument("input", help="Mooncake-style JSONL")
    moon.add_argument("-o", "--out", required=True, help="output trace JSONL")
    moon.add_argument(
        "--sessions",
        choices=["prefix", "each"],
        default="prefix",
        help="infer sessions by hash prefix, or one session per request",
    )
    moon.add_argument(
        "--block-size", type=int, default=512, help="tokens per hash block of the input"
    )
    moon.add_argument(
        "--min-match-blocks",
        type=int,
        default=2,
        help="shared leading blocks that make one session",
    )
    moon.set_defaults(func=cmd_trace_import_mooncake)

    bench = subparsers.add_parser("bench", help="replay a trace against a server and report")
    _add_bench_run_args(bench)
    bench.set_defaults(func=cmd_bench)
    bsub = bench.add_subparsers(dest="bench_command", metavar="{plot,compare}")
    plot = bsub.add_parser("plot", help="(re)draw the plots of a results directory")
    plot.add_argument("results", help="results directory of a disagg bench run")
    plot.set_defaults(func=cmd_bench_plot)
    comp = bsub.add_parser("compare", help="A/B: two fronts and ratios at target interactivities")
    comp.add_argument("a", help="results directory A")
    comp.add_argument("b", help="results directory B")
    comp.add_argument("--labels", default=None, help="names of A and B, comma-separated")
    comp.add_argument("-o", "--out", default="compare.png", help="output PNG")
    comp.add_argument(
        "--targets",
        type=_floats,
        default=list(DEFAULT_TARGETS),
        help="interactivities (tok/s/user) to compare at",
    )
    comp.set_defaults(func=cmd_bench_compare)


def _add_bench_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--trace", help="trace JSONL")
    p.add_argument("--out", default="results", help="results directory")
    p.add_argument("--concurrency", type=_ints, default=[1], help="closed-loop lanes, e.g. 1,2,4,8")
    p.add_argument(
        "--mode",
        choices=["closed", "open"],
        default="closed",
        help="closed-loop lanes or open-loop timestamps",
    )
    p.add_argument("--duration", type=float, default=None, help="measured seconds per run")
    p.add_argument("--requests", type=int, default=None, help="measured requests per run")
    p.add_argument("--warmup", type=float, default=0.0, help="warm-up seconds")
    p.add_argument("--warmup-requests", type=int, default=0, help="first N requests are warm-up")
    p.add_argument(
        "--think-cap-ms", type=float, default=30_000.0, help="closed loop: cap on think time"
    )
    p.add_argument(
        "--think-scale",
        type=float,
        default=1.0,
        help="closed loop: multiplies think time (0: none)",
    )
    p.add_argument("--speedup", type=float, default=1.0, help="open loop: timestamp speedup")
    p.add_argument(
        "--sample-start-turn",
        action="store_true",
        help="start each lane's first session at a random turn (warm-up)",
    )
    p.add_argument(
        "--session-end",
        action="store_true",
        help="each session's last turn sends session_end (disagg's extension: its state goes first)",
    )
    p.add_argument(
        "--delete-sessions",
        action="store_true",
        help="once each session's last turn is answered, DELETE /v1/sessions/{id} (disagg's extension: "
        "the same, for a client that learns of the end only then)",
    )
    p.add_argument("--ramp", type=float, default=0.0, help="seconds over which lanes start")
    p.add_argument("--salt", type=int, default=1, help="cache-busting salt of the first run")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and sampled start turns")
    p.add_argument("--num-gpus", type=int, default=1, help="GPUs serving (prefill + decode)")
    p.add_argument(
        "--gpu-cost",
        default=None,
        help="$/GPU-hour: a number or a preset such as mi355x, b300-neocloud, h200:3yr",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT bound (ms)")
    p.add_argument("--slo-itl-ms", type=float, default=None, help="goodput: ITL bound (ms)")
    p.add_argument(
        "--targets",
        type=_floats,
        default=list(DEFAULT_TARGETS),
        help="interactivities (tok/s/user) to read fronts at",
    )
    p.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY)",
    )
    p.add_argument(
        "--endpoint", choices=["completions", "chat"], default="completions", help="OpenAI endpoint"
    )
    p.add_argument(
        "--prompt-mode",
        choices=["tokens", "text"],
        default="tokens",
        help="token-ID prompts, or text (chat endpoint, servers without token-ID prompts)",
    )
    p.add_argument(
        "--transport",
        choices=["auto", "raw", "aiohttp"],
        default="auto",
        help="streaming client: raw (kernel receive stamps; plain http) or aiohttp; "
        "auto: raw for http://, aiohttp for https://",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="prompt token ids are below this; default: the server's (its /v1/models card), "
        f"else {FALLBACK_VOCAB_SIZE}",
    )
    p.add_argument(
        "--first-token-id",
        type=int,
        default=None,
        help=f"prompt token ids start here; default: {FIRST_TOKEN_ID} (0 for a smaller vocabulary)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per hash block of records without block_size; default: the server's cache "
        f"block size, else {DEFAULT_BLOCK_SIZE}",
    )
    p.add_argument(
        "--no-preflight",
        action="store_true",
        help="skip the GET /v1/models check (for servers without it; then give --model)",
    )
    p.add_argument(
        "--metrics-path", default="/metrics", help="Prometheus endpoint scraped around runs"
    )
    p.add_argument(
        "--metrics-counter",
        default="disagg_prompt_tokens_total",
        help="prompt-token counter by source (server-side hit rate)",
    )
    p.add_argument("--parquet", action="store_true", help="also write requests.parquet")
    p.add_argument("--record-chunks", action="store_true", help="keep per-chunk times in JSONL")
    p.add_argument("--no-plots", action="store_true", help="write no PNGs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--quiet", action="store_true", help="no per-run summaries")


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def cmd_trace_synth(args: argparse.Namespace) -> int:
    from disagg.tools.bench.stats import compute_stats, format_stats
    from disagg.tools.bench.synth import SynthConfig, synthesize
    from disagg.tools.bench.trace import save_trace

    cfg = SynthConfig()
    if args.session_rate is not None:
        cfg.session_rate = args.session_rate
    try:
        records = synthesize(
            args.sessions,
            args.seed,
            block_size=args.block_size,
            scale=args.scale,
            turn_scale=args.turn_scale,
            max_input=args.max_input,
            subagents=not args.no_subagents,
            config=cfg,
        )
    except ValueError as exc:
        return _fail(str(exc))
    n = save_trace(records, args.out)
    print(f"wrote {n} requests to {args.out}")
    print(format_stats(compute_stats(records)))
    return 0


def cmd_trace_stats(args: argparse.Namespace) -> int:
    from disagg.tools.bench.stats import compute_stats, format_stats
    from disagg.tools.bench.trace import load_trace

    try:
        records = load_trace(args.trace, default_block_size=args.block_size)
    except (TraceError, OSError) as exc:
        return _fail(str(exc))
    stats = compute_stats(records, args.block_size)
    print(json.dumps(stats.to_dict(), indent=2) if args.json else format_stats(stats))
    return 0


def cmd_trace_import_mooncake(args: argparse.Namespace) -> int:
    from disagg.tools.bench.mooncake import import_mooncake
    from disagg.tools.bench.trace import save_trace

    try:
        records = import_mooncake(
            args.input,
            sessions=args.sessions,
            block_size=args.block_size,
            min_match_blocks=args.min_match_blocks,
        )
    except (TraceError, OSError) as exc:
        return _fail(str(exc))
    n = save_trace(records, args.out)
    print(f"wrote {n} requests in {len({r.session_id for r in records})} sessions to {args.out}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from disagg.tools.bench.preflight import PreflightError, probe, token_params
    from disagg.tools.bench.sweep import BenchParams, run_bench_sync
    from disagg.tools.bench.trace import load_trace

    if not args.url or not args.trace:
        return _fail("disagg bench needs --url and --trace (or a subcommand: plot, compare)")
    try:
        info = None if args.no_preflight else probe(args.url, args.model, args.api_key)
        tp = token_params(info, args.vocab_size, args.first_token_id, args.block_size)
    except PreflightError as exc:
        return _fail(str(exc))
    try:
        records = load_trace(args.trace, default_block_size=tp.block_size)
    except (TraceError, OSError) as exc:
        return _fail(str(exc))
    _print_server(args.url, info, tp, records, args.quiet)
    params = BenchParams(
        url=args.url,
        trace=args.trace,
        out=args.out,
        concurrency=args.concurrency,
        mode=args.mode,
        duration_s=args.duration,
        max_requests=args.requests,
        warmup_s=args.warmup,
        warmup_requests=args.warmup_requests,
        think_cap_ms=args.think_cap_ms,
        think_scale=args.think_scale,
        speedup=args.speedup,
        sample_start_turn=args.sample_start_turn,
        session_end=args.session_end,
        delete_sessions=args.delete_sessions,
        ramp_s=args.ramp,
        salt=args.salt,
        seed=args.seed,
        num_gpus=args.num_gpus,
        gpu_cost=args.gpu_cost,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_itl_ms=args.slo_itl_ms,
        targets=args.targets,
        model=info.model if info else args.model,
        api_key=args.api_key,
        endpoint=args.endpoint,
        prompt_mode=args.prompt_mode,
        transport=args.transport,
        vocab_size=tp.vocab_size,
        first_token_id=tp.first_token_id,
        default_block_size=tp.block_size,
        metrics_path=args.metrics_path,
        metrics_counter=args.metrics_counter,
        parquet=args.parquet,
        record_chunks=args.record_chunks,
        plots=not args.no_plots,
        progress=not args.no_progress,
        quiet=args.quiet,
    )
    try:
        doc = run_bench_sync(params, records)
    except ValueError as exc:
        return _fail(str(exc))
    at = ", ".join(
        f"{t['interactivity']:g}: "
        + ("n/a" if t["total_tps_per_gpu"] is None else f"{t['total_tps_per_gpu']:,.1f}")
        for t in doc["pareto"]["at_targets"]
    )
    print(f"Pareto front {doc['pareto']['front']}; tok/s/GPU at tok/s/user {{{at}}}")
    print(f"results in {doc['_dir']}")
    invalid = [e["label"] for e in doc["runs"] if not e["summary"]["valid"]]
    if invalid:
        print(f"INVALID runs (>10% failed): {invalid}", file=sys.stderr)
        return 1
    return 0


def _print_server(url: str, info, tp, records: list, quiet: bool) -> None:
    """Where the prompt parameters came from; a warning for requests longer than the server takes."""
    if not quiet:
        where = ", ".join(
            f"{k} {getattr(tp, k)} ({tp.sources[k]})" for k in ("vocab_size", "block_size")
        )
        model = f"{info.model} at {url}" if info else f"{url} (no preflight)"
        print(f"server: {model}; {where}", flush=True)
    limit = info.max_model_len if info else None
    too_long = [r for r in records if limit and r.input_length + r.output_length > limit]
    if too_long:
        print(
            f"warning: {len(too_long)} of {len(records)} trace requests exceed the server's max_model_len "
            f"{limit} (prompt + output); they will fail",
            file=sys.stderr,
        )


def cmd_bench_plot(args: argparse.Namespace) -> int:
    from disagg.tools.bench.report import load_sweep
    from disagg.tools.bench.sweep import write_plots

    try:
        doc = load_sweep(args.results)
    except (OSError, ValueError) as exc:
        return _fail(str(exc))
    for path in write_plots(doc):
        print(f"wrote {path}")
    return 0


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from disagg.tools.bench.plots import plot_compare
    from disagg.tools.bench.report import load_sweep, sweep_points

    try:
        docs = [load_sweep(args.a), load_sweep(args.b)]
    except (OSError, ValueError) as exc:
        return _fail(str(exc))
    names = args.labels.split(",") if args.labels else ["A", "B"]
    if len(names) != 2:
        return _fail("--labels takes two names")
    series = [(name, *sweep_points(doc)) for name, doc in zip(names, docs, strict=False)]
    path, rows = plot_compare(series[0], series[1], args.out, args.targets)
    print(f"{'tok/s/user':>10} {names[0]:>14} {names[1]:>14} {'B/A':>8}")
    for r in rows:
        cells = ["n/a" if r[k] is None else f"{r[k]:,.1f}" for k in ("a", "b")]
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        print(f"{r['target']:>10g} {cells[0]:>14} {cells[1]:>14} {ratio:>8}")
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone parser with only these commands (``python -m disagg.tools.bench``)."""
    parser = argparse.ArgumentParser(prog="disagg", description="agentic trace benchmark")
    add_bench_parsers(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
