"""`disagg plan`: memory and capacity arithmetic for a model on a GPU type.

    disagg plan --model kimi-k3 --tp 8 --context 142000 --kv-dtype fp8            # 1.96 GB MLA per GPU
    disagg plan --model kimi-k3 --tp 8 --dcp 8 --context 142000 --kv-dtype fp8    # 245 MB under DCP8
    disagg plan --model path/to/config.json --hardware h200 --tp 4 --weights-gb 96
    disagg plan --committed 3:3.00,4:3.36 --cycle-growth 0.10                     # draft depth
    disagg plan --model kimi-k3 --hardware mi355x --emit-profile mi355x-k3.json   # simulator profile

Everything printed is arithmetic on the model's shapes and the hardware's
published figures; values that rest on assumptions (unpublished parameter
counts, host DRAM per node) are marked as such.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict

from disagg.tools.plan.hardware import PRESETS as HW_PRESETS
from disagg.tools.plan.hardware import load_hardware
from disagg.tools.plan.memory import DTYPE_BYTES, PlanConfig, PlanResult, human_bytes, plan
from disagg.tools.plan.models import ModelSpec, load_model
from disagg.tools.plan.speculative import (
    committed_from_acceptance,
    cycle_costs,
    depth_table,
    format_depths,
)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_committed(text: str) -> dict[int, float]:
    """``3:3.00,4:3.36`` (depth:tokens) or ``2.2,2.7,3.0`` (depths 1, 2, 3, ...)."""
    out: dict[int, float] = {}
    for i, item in enumerate(x.strip() for x in text.split(",") if x.strip()):
        if ":" in item:
            k, v = item.split(":", 1)
            out[int(k)] = float(v)
        else:
            out[i + 1] = float(item)
    return out


def format_plan(model: ModelSpec, hw, cfg: PlanConfig, res: PlanResult) -> str:
    c = cfg.context
    lines = [f"model {model.name}: {model.num_mla_layers} MLA + {model.num_kda_layers} KDA"
             + (f" + {model.num_attn_layers} attention" if model.num_attn_layers else "") + " layers"
             + (f", {model.mla_query_heads} MLA query heads ({model.mla_query_heads / cfg.tp:g} per GPU at TP{cfg.tp})"
                if model.mla_query_heads else "")
             + (f", latent {model.latent_dim} values" if model.num_mla_layers else "")]
    lines.append(f"hardware {hw.name}: {hw.hbm_gb:g} GB HBM at {hw.hbm_tbps:g} TB/s, {hw.gpus_per_node} GPUs per node, "
                 f"host link {hw.host_link_gbps:g} GB/s")
    lines.append(f"parallelism TP {cfg.tp}, DCP {cfg.dcp}; cache {cfg.kv_dtype} ({DTYPE_BYTES[cfg.kv_dtype]:g} B/value), "
                 f"context {c:,} tokens")
    lines.append("")
    if model.num_mla_layers:
        lines.append(f"MLA bytes per token: {res.mla_bytes_per_token_layer:,.0f} B per layer, "
                     f"{res.mla_bytes_per_token:,.0f} B for {model.num_mla_layers} layers "
                     f"(TP replicates the latent; DCP {cfg.dcp} leaves {res.mla_bytes_per_token_gpu:,.0f} B per GPU)")
        lines.append(f"MLA bytes per GPU at {c:,} tokens: {human_bytes(res.mla_bytes_gpu)}  "
                     f"({c:,} x {model.num_mla_layers} x {res.mla_bytes_per_token_layer:,.0f} B / {cfg.dcp})")
    if model.num_attn_layers:
        lines.append(f"attention KV bytes per GPU at {c:,} tokens: {human_bytes(c * res.attn_bytes_per_token_gpu)}")
    if model.num_kda_layers:
        lines.append(f"KDA checkpoint: {human_bytes(res.kda_state_bytes)} ({model.num_kda_layers} layers x "
                     f"{model.kda_heads} heads x {model.kda_head_dim}x{model.kda_head_dim} {cfg.state_dtype} + conv), "
                     f"{human_bytes(res.kda_state_bytes_gpu)} per GPU at TP {cfg.tp}")
    lines.append(f"resident session ({c:,} tokens + {cfg.checkpoints_per_session} KDA checkpoint(s)): "
                 f"{human_bytes(res.session_bytes_gpu)} per GPU, {human_bytes(res.session_bytes_host)} in a host tier")
    lines.append("")
    if res.weights_bytes_gpu is None:
        lines.append("weights: parameter count unknown; pass --weights-gb to size device memory")
    else:
        tag = " (ASSUMED parameter count, not published)" if res.params_assumed else ""
        lines.append(f"weights per GPU: {human_bytes(res.weights_bytes_gpu)}{tag}; free for state "
                     f"({cfg.gpu_mem_util:.0%} of HBM, {cfg.reserve_gb:g} GB reserve): {human_bytes(max(res.free_bytes_gpu, 0))}")
        lines.append(f"resident sessions per TP{cfg.tp} group on device: {res.sessions_per_group:,} "
                     f"({res.sessions_per_group / cfg.tp:,.1f} per GPU); {res.groups_per_node} group(s) per node")
    host_gb = cfg.host_gb if cfg.host_gb is not None else hw.host_gb
    assumed = "" if cfg.host_gb is not None else " (assumed host DRAM; set --host-gb)"
    lines.append(f"resident sessions per host tier: {res.sessions_per_host_tier:,} "
                 f"({cfg.host_fraction:.0%} of {host_gb:g} GB per node{assumed})")
    lines.append(f"session host -> device: {res.host_load_s * 1e3:,.1f} ms"
                 + (f"; recompute: {res.recompute_s:,.2f} s (FP8 peak x {cfg.mfu}), "
                    f"{res.recompute_s / res.host_load_s:,.0f}x the load" if res.recompute_s else ""))
    for w in res.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def _speculative(args: argparse.Namespace) -> str | None:
    committed: dict[int, float] | None = None
    if args.committed:
        committed = parse_committed(args.committed)
    elif args.acceptance:
        e = committed_from_acceptance(_floats(args.acceptance), args.max_drafts)
        committed = dict(enumerate(e))
    if committed is None:
        return None
    cycle = cycle_costs(sorted(committed), args.verify_ms, args.draft_ms, args.verify_ms_per_token,
                        args.cycle_growth)
    return format_depths(depth_table(committed, cycle))


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        model = load_model(args.model)
        hw = load_hardware(args.hardware)
        cfg = PlanConfig(tp=args.tp, dcp=args.dcp, context=args.context, kv_dtype=args.kv_dtype,
                         state_dtype=args.state_dtype, weight_dtype=args.weight_dtype, weights_gb=args.weights_gb,
                         gpu_mem_util=args.gpu_mem_util, reserve_gb=args.reserve_gb,
                         checkpoints_per_session=args.checkpoints_per_session, host_gb=args.host_gb,
                         host_fraction=args.host_fraction, use_assumptions=not args.no_assumptions)
        res = plan(model, hw, cfg)
        spec = _speculative(args)
    except ValueError as exc:
        print(f"disagg plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        doc = {"model": model.name, "hardware": hw.name, "config": asdict(cfg), "result": asdict(res)}
        print(json.dumps(doc, default=lambda x: None if isinstance(x, float) and not math.isfinite(x) else x))
    else:
        print(format_plan(model, hw, cfg, res))
        if spec:
            print("\nspeculative decoding (draft depth):")
            print(spec)
    if args.emit_profile:
        from disagg.tools.plan.roofline import roofline_profile

        try:
            prof = roofline_profile(model, hw, cfg)
        except ValueError as exc:
            print(f"disagg plan: {exc}", file=sys.stderr)
            return 2
        prof.save(args.emit_profile)
        print(f"\nwrote simulator profile {args.emit_profile} ({prof.name}); fit:\n{prof.fit_report().format()}",
              file=sys.stderr)
    return 0


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="memory / capacity arithmetic for a model on a GPU type",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="kimi-k3", help="kimi-k3, a reference preset, or a config.json / model dir")
    p.add_argument("--hardware", default="mi355x", help=f"one of {', '.join(HW_PRESETS)}")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel GPUs per replica")
    p.add_argument("--dcp", type=int, default=1, help="decode context parallel degree (divides --tp)")
    p.add_argument("--context", type=int, default=142_000, help="tokens per session")
    p.add_argument("--kv-dtype", default="fp8", choices=sorted(DTYPE_BYTES), help="MLA cache dtype")
    p.add_argument("--state-dtype", default="fp32", choices=sorted(DTYPE_BYTES), help="KDA recurrent state")
    p.add_argument("--weight-dtype", default="fp8", choices=sorted(DTYPE_BYTES), help="weights dtype")
    p.add_argument("--weights-gb", type=float, help="whole model's weights in GB (overrides parameter counts)")
    p.add_argument("--no-assumptions", action="store_true", help="never use unpublished parameter counts")
    p.add_argument("--gpu-mem-util", type=float, default=0.90, help="share of GPU memory the engine may use")
    p.add_argument("--reserve-gb", type=float, default=8.0, help="per GPU: activations, graphs, workspace")
    p.add_argument("--checkpoints-per-session", type=int, default=1, help="KDA checkpoints kept per session")
    p.add_argument("--host-gb", type=float, help="host DRAM per node (default: the preset's assumption)")
    p.add_argument("--host-fraction", type=float, default=0.8, help="share of host DRAM in the host tier")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--committed", help="committed tokens per cycle by depth: '3:3.00,4:3.36' or '2.2,2.7,3.0'")
    g.add_argument("--acceptance", help="acceptance rate(s): '0.8' (constant) or '0.9,0.8,0.7' (per position)")
    g.add_argument("--max-drafts", type=int, default=6, help="depths 0..N with a constant --acceptance")
    g.add_argument("--cycle-growth", type=float, help="relative cycle growth per extra draft (e.g. 0.10)")
    g.add_argument("--verify-ms", type=float, help="target verify step (ms)")
    g.add_argument("--verify-ms-per-token", type=float, default=0.0, help="verify cost per verified token (ms)")
    g.add_argument("--draft-ms", type=float, help="one draft step (ms)")
    p.add_argument("--emit-profile", metavar="FILE", help="also write a roofline simulator profile")
    p.add_argument("--json", action="store_true", help="machine-readable memory figures")
    p.set_defaults(func=cmd_plan)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
