"""The ``disagg`` command line.

    disagg serve     start a local Ray cluster and serve the app (OpenAI API over HTTP)
    disagg demo      serve, run a few multi-turn sessions, print where state came from, stop
    disagg generate  run the reference engine in this process
    disagg trace     synthesize / inspect / import agentic traces
    disagg bench     replay a trace against an OpenAI-compatible endpoint
    disagg sim       replay a trace in the cluster simulator (run, sweep, calibrate)
    disagg plan      memory / capacity arithmetic for a model on a GPU type
    disagg deploy    send the app's Serve config to a running Ray cluster (ray up / KubeRay)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from disagg.bench.cli import add_bench_parsers
from disagg.plan.cli import add_plan_parser
from disagg.sim.cli import add_sim_parsers


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config (an AppConfig, or a Serve config with args)")
    p.add_argument("--host", help="HTTP host (default from config: 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default from config: 8000)")
    p.add_argument("--mode", choices=["disaggregated", "aggregated"], help="override deployment.mode")
    p.add_argument("--model", help="preset name or model directory (default: tiny)")


def _load(args):
    from disagg.config import load_config

    cfg = load_config(args.config)
    if args.host:
        cfg.http.host = args.host
    if args.port is not None:
        cfg.http.port = args.port
    if args.mode:
        cfg.deployment.mode = args.mode
    if args.model:
        cfg.model.name = args.model
    return cfg


def cmd_serve(args) -> int:
    from disagg.local import serve_forever

    serve_forever(_load(args))
    return 0


def cmd_demo(args) -> int:
    from disagg.demo import run_demo

    return run_demo(_load(args), num_sessions=args.sessions, num_turns=args.turns, context_tokens=args.context)


def cmd_generate(args) -> int:
    from disagg.config import load_config
    from disagg.engine.factory import build_reference_engine, build_tokenizer
    from disagg.engine.protocol import EngineRequest, SamplingParams

    cfg = load_config(args.config)
    if args.model:
        cfg.model.name = args.model
    if args.device:
        cfg.model.device = args.device
    engine = build_reference_engine(cfg)
    tok = build_tokenizer(cfg)
    if args.token_ids:
        ids = [int(t) for t in args.token_ids.split(",") if t.strip()]
    elif args.prompt is not None:
        ids = tok.encode(args.prompt)
    else:
        print("give --prompt TEXT or --token-ids 1,2,3", file=sys.stderr)
        return 2
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                        seed=args.seed, ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    engine.add_request(EngineRequest("cli", ids, sp))
    out_ids: list[int] = []
    ttft = None
    done = False
    while not done:
        for o in engine.step():
            if o.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t0
            out_ids.extend(o.new_token_ids)
            done = o.finished
    total = time.perf_counter() - t0
    decode_s = total - (ttft or 0)
    result = {"model_id": engine.model_id, "prompt_tokens": len(ids), "output_token_ids": out_ids,
              "text": tok.decode(out_ids), "ttft_s": round(ttft or 0, 4), "total_s": round(total, 4),
              "decode_tokens_per_s": round((len(out_ids) - 1) / decode_s, 1) if len(out_ids) > 1 and decode_s else None}
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def cmd_deploy(args) -> int:
    from disagg.deploy import run_deploy

    return run_deploy(args.config, args.set, args.address, output=args.output, dry_run=args.dry_run)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="disagg", description="Disaggregated prefill/decode serving for "
                                 "Kimi-K3-class hybrid models (MLA + KDA + MoE) on Ray Serve.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="start a local Ray cluster and serve the OpenAI API")
    _add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="serve, run multi-turn sessions, report TTFT and state sources, stop")
    _add_serve_args(p)
    p.add_argument("--sessions", type=int, default=3, help="concurrent sessions (default 3)")
    p.add_argument("--turns", type=int, default=3, help="turns per session (default 3)")
    p.add_argument("--context", type=int, default=1024, help="first-turn prompt tokens (default 1024)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="run the reference engine in this process")
    p.add_argument("--config", help="YAML config")
    p.add_argument("--model", help="preset name or model directory")
    p.add_argument("--device", help="cpu, cuda, ...")
    p.add_argument("--prompt", help="prompt text")
    p.add_argument("--token-ids", help="comma-separated prompt token ids")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one-line JSON output")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("deploy", help="send the app's Serve config to a running Ray cluster (serve deploy)")
    p.add_argument("--config", required=True, help="YAML: a Serve config with args, or a bare AppConfig")
    p.add_argument("--address", default=os.environ.get("RAY_DASHBOARD_ADDRESS", "http://127.0.0.1:8265"),
                   help="Ray dashboard URL (default: $RAY_DASHBOARD_ADDRESS or http://127.0.0.1:8265)")
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override an AppConfig field, e.g. deployment.decode.max_replicas=12 (repeatable)")
    p.add_argument("--output", help="also write the Serve config to this file")
    p.add_argument("--dry-run", action="store_true", help="validate and print the config; send nothing")
    p.set_defaults(func=cmd_deploy)

    add_bench_parsers(sub)
    add_sim_parsers(sub)
    add_plan_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
