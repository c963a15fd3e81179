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
import logging
import os
import sys
import time
import traceback

from disagg.tools.bench.cli import add_bench_parsers
from disagg.tools.plan.cli import add_plan_parser
from disagg.tools.sim.cli import add_sim_parsers


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; every option's default after its help (unless None, False or named)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default is None
                or action.default is False or action.default is argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose subcommands show defaults (they inherit the class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["formatter_class"] = HelpFormatter  # a superset of RawDescriptionHelpFormatter
        super().__init__(*args, **kwargs)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("disagg")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _add_debug_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show a traceback with errors (also: disagg --debug COMMAND)")


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_arg", nargs="?", metavar="MODEL",
                   help="preset name (tiny, small, kimi-linear-48b) or a checkpoint directory (config.json + "
                        "*.safetensors); default: the config's model.name, else tiny (random weights)")
    p.add_argument("--config", help="YAML config (an AppConfig, or a Serve config with args); default: built-in")
    p.add_argument("--host", help="HTTP host; default: the config's http.host (127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port; default: the config's http.port (8000)")
    p.add_argument("--mode", choices=["disaggregated", "aggregated"],
                   help="override deployment.mode; default: the config's (disaggregated)")
    p.add_argument("--model", help="same as MODEL")
    p.add_argument("--device", help="override model.device (cpu, cuda, cuda:0); default: the config's (cpu)")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"],
                   help="override model.dtype; default: the config's (float32)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="level of disagg's console messages (serve at info: a line per request, "
                        "a stats line every 10 s)")
    _add_debug_arg(p)


def _load(args):
    from disagg.launch.preflight import load_config_for_cli

    cfg = load_config_for_cli(args.config)
    if args.host:
        cfg.http.host = args.host
    if args.port is not None:
        cfg.http.port = args.port
    if args.mode:
        cfg.deployment.mode = args.mode
    if args.model_arg and args.model and args.model_arg != args.model:
        from disagg.launch.preflight import UsageError

        raise UsageError(f"two models given: {args.model_arg!r} and --model {args.model!r}; give one")
    _override_model(cfg, args.model_arg or args.model, args.device, args.dtype)
    return cfg


def _override_model(cfg, name: str | None, device: str | None, dtype: str | None) -> None:
    """Apply the command line's model, device and dtype to ``cfg``, then check they can run here."""
    from disagg.launch.preflight import check_device, check_model

    if name:
        cfg.model.name = name
    if device:
        cfg.model.device = device
    if dtype:
        cfg.model.dtype = dtype
    check_model(cfg)
    check_device(cfg)


def _check_local(cfg) -> None:
    """What the local cluster needs, checked before Ray starts."""
    from disagg.launch.haproxy_dirs import reap_orphans
    from disagg.launch.local import local_num_cpus
    from disagg.launch.preflight import check_cpus, check_port

    check_cpus(cfg, local_num_cpus())
    reaped = reap_orphans()  # HAProxy left by a run that died: it may hold this very port
    if reaped:
        print(f"stopped HAProxy left running by an earlier run that died (pids {reaped})", file=sys.stderr)
    check_port(cfg.http.host, cfg.http.port)


def cmd_serve(args) -> int:
    from disagg.launch.local import serve_forever

    cfg = _load(args)
    _check_local(cfg)
    rc = serve_forever(cfg, log_level=args.log_level)
    # Everything outside this process is stopped by now (app, Ray, HAProxy, temp files). The
    # interpreter's own finalization after a Ray driver took another ~10 s on a busy 2-core
    # machine (after the atexit hooks, with no Python thread left): leave without it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def cmd_demo(args) -> int:
    from disagg.launch.demo import run_demo

    cfg = _load(args)
    _check_local(cfg)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("disagg").setLevel(args.log_level.upper())
    return run_demo(cfg, num_sessions=args.sessions, num_turns=args.turns, context_tokens=args.context)


def cmd_generate(args) -> int:
    from disagg.engine.factory import build_reference_engine, build_tokenizer
    from disagg.engine.protocol import EngineRequest, SamplingParams
    from disagg.launch.preflight import load_config_for_cli

    cfg = load_config_for_cli(args.config)
    _override_model(cfg, args.model, args.device, args.dtype)
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
    result = {"model": cfg.model.openai_name, "weights_id": engine.model_id,
              "prompt_tokens": len(ids), "output_token_ids": out_ids,
              "text": tok.decode(out_ids), "ttft_s": round(ttft or 0, 4), "total_s": round(total, 4),
              "decode_tokens_per_s": round((len(out_ids) - 1) / decode_s, 1) if len(out_ids) > 1 and decode_s else None}
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def cmd_deploy(args) -> int:
    from disagg.launch.deploy import run_deploy

    return run_deploy(args.config, args.set, args.address, output=args.output, dry_run=args.dry_run)


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="disagg", description="Disaggregated prefill/decode serving for "
                "Kimi-K3-class hybrid models (MLA + KDA + MoE) on Ray Serve.")
    ap.add_argument("--version", action="version", version=f"disagg {_version()}")
    ap.add_argument("--debug", action="store_true", help="show a traceback with errors")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="start a local Ray cluster and serve the OpenAI API",
                       description="Serve MODEL over the OpenAI API on a local Ray cluster until SIGINT / SIGTERM.")
    _add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="serve, run multi-turn sessions, report TTFT and state sources, stop")
    _add_serve_args(p)
    p.add_argument("--sessions", type=int, default=3, help="concurrent sessions")
    p.add_argument("--turns", type=int, default=3, help="turns per session")
    p.add_argument("--context", type=int, default=1024, help="first-turn prompt tokens")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("generate", help="run the reference engine in this process")
    p.add_argument("--config", help="YAML config; default: built-in")
    p.add_argument("--model", help="preset name or checkpoint directory; default: the config's (tiny)")
    p.add_argument("--device", help="cpu, cuda, cuda:0 ...; default: the config's (cpu)")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"],
                   help="weights and compute dtype; default: the config's (float32)")
    p.add_argument("--prompt", help="prompt text")
    p.add_argument("--token-ids", help="comma-separated prompt token ids")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--json", action="store_true", help="one-line JSON output")
    _add_debug_arg(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("deploy", help="send the app's Serve config to a running Ray cluster (serve deploy)")
    p.add_argument("--config", required=True, help="YAML: a Serve config with args, or a bare AppConfig")
    p.add_argument("--address", default=os.environ.get("RAY_DASHBOARD_ADDRESS", "http://127.0.0.1:8265"),
                   help="Ray dashboard URL ($RAY_DASHBOARD_ADDRESS when set)")
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override an AppConfig field, e.g. deployment.decode.max_replicas=12 (repeatable)")
    p.add_argument("--output", help="also write the Serve config to this file")
    p.add_argument("--dry-run", action="store_true", help="validate and print the config; send nothing")
    p.set_defaults(func=cmd_deploy)

    add_bench_parsers(sub)
    add_sim_parsers(sub)
    add_plan_parser(sub)
    return ap


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command parser that ``args`` went through last: its usage fits a bad flag."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if not subs or chosen not in subs[0].choices:
            return parser
        parser = subs[0].choices[chosen]


def main(argv: list[str] | None = None) -> int:
    """Run one command; a user mistake is printed as ``error: ...`` lines with exit status 2."""
    from disagg.launch.preflight import UsageError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the command's own usage, not the top-level one
        _innermost(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    from disagg.launch.local import ClusterStartError, PlacementError

    try:
        return int(args.func(args) or 0)
    except (UsageError, ClusterStartError, PlacementError) as exc:
        if getattr(args, "debug", False):
            traceback.print_exc()
        for line in str(exc).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 1 if isinstance(exc, ClusterStartError) else 2


if __name__ == "__main__":
    sys.exit(main())
