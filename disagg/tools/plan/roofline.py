"""A simulator profile from published figures: a roofline of one TP group.

For an engine replica of ``tp`` GPUs (experts spread over them, attention
heads split, the MLA latent replicated unless DCP spreads it)::

    expert params x = (total - active) / (E - k),  shared params N = active - k * x
    experts touched by a batch of B tokens: E_t = E * (1 - (1 - k / E)^B)      (uniform routing)

    decode step(B, c) = max(bytes / (HBM * mbu), flops / (FP8 * mfu_decode)) + step_overhead
        bytes = (N + E_t * x) * b_w / tp  +  B * c * MLA bytes per token per GPU  +  2 * B * KDA state per GPU
        flops = 2 * active * B / tp  +  2 * L_m * (H_q / tp) * (r + d_rope + r) * c * B / DCP
    prefill(n, ctx) = max(weights / (HBM * mbu), flops / (FP8 * mfu_prefill)) + step_overhead
        flops = 2 * active * n / tp  +  2 * L_m * (H_q / tp) * (d_nope + d_rope + d_v) * n * (ctx + n / 2)

The points (a grid of n, ctx and B, c) are what a profile file holds; the
simulator fits its cost model to them as it does to measured points.
Transfers: each GPU loads its own share over its own host link, so a group
reads the latent at ``host_link * DCP`` (TP replicas each need the whole
latent) and the network at ``nic * DCP``.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

from disagg.costs.profile import DecodePoint, EngineProfile, PrefillPoint
from disagg.tools.plan.hardware import HardwareSpec
from disagg.tools.plan.memory import PlanConfig, dtype_bytes, plan
from disagg.tools.plan.models import ModelSpec


@dataclass(slots=True)
class RooflineConfig:
    mbu: float = 0.6  # share of HBM bandwidth reached
    mfu_decode: float = 0.3  # share of FP8 peak reached in decode
    mfu_prefill: float = 0.4  # share of FP8 peak reached in prefill
    step_overhead_s: float = 0.010  # per step: launches, TP collectives, MoE dispatch, sampling
    nic_gbps: float = 50.0  # per GPU network (400 Gb/s RDMA NIC)
    disk_gbps: float = 25.0  # per node NVMe
    max_decode_batch: int = 256
    max_prefill_tokens_per_step: int = 16384
    block_size: int = 256

    def __post_init__(self) -> None:
        if not (0 < self.mbu <= 1 and 0 < self.mfu_decode <= 1 and 0 < self.mfu_prefill <= 1):
            raise ValueError("mbu and mfu must be in (0, 1]")


def _expert_split(model: ModelSpec, total: float, active: float) -> tuple[float, float]:
    e, k = model.num_experts or 0, model.experts_per_token or 0
    if e <= k or total <= active:
        return active, 0.0
    x = (total - active) / (e - k)
    return max(active - k * x, 0.0), x


def decode_step_s(model: ModelSpec, hw: HardwareSpec, pc: PlanConfig, rc: RooflineConfig,
                  total: float, active: float, batch: int, context: int) -> float:
    res = plan(model, hw, PlanConfig(**{**_fields(pc), "context": max(context, 1)}))
    shared, per_expert = _expert_split(model, total, active)
    e, k = model.num_experts or 0, model.experts_per_token or 0
    touched = e * (1.0 - (1.0 - k / e) ** batch) if e else 0.0
    b_w = dtype_bytes(pc.weight_dtype)
    nbytes = (shared + touched * per_expert) * b_w / pc.tp
    nbytes += batch * context * (res.mla_bytes_per_token_gpu + res.attn_bytes_per_token_gpu)
    nbytes += 2 * batch * res.kda_state_bytes_gpu
    flops = 2 * active * batch / pc.tp
    flops += 2 * model.num_mla_layers * (model.mla_query_heads / pc.tp) * (2 * model.kv_lora_rank + model.qk_rope_head_dim) \
        * context * batch / pc.dcp
    t_mem = nbytes / (hw.hbm_tbps * 1e12 * rc.mbu)
    t_flop = flops / (hw.fp8_tflops * 1e12 * rc.mfu_decode)
    return max(t_mem, t_flop) + rc.step_overhead_s


def prefill_s(model: ModelSpec, hw: HardwareSpec, pc: PlanConfig, rc: RooflineConfig,
              total: float, active: float, new_tokens: int, context: int) -> float:
    steps = math.ceil(new_tokens / rc.max_prefill_tokens_per_step)
    flops = 2 * active * new_tokens / pc.tp
    flops += 2 * model.num_mla_layers * (model.mla_query_heads / pc.tp) * (
        model.qk_nope_head_dim + model.qk_rope_head_dim + model.v_head_dim) * new_tokens * (context + new_tokens / 2)
    weights = total * dtype_bytes(pc.weight_dtype) / pc.tp
    t = max(weights * steps / (hw.hbm_tbps * 1e12 * rc.mbu), flops / (hw.fp8_tflops * 1e12 * rc.mfu_prefill))
    return t + steps * rc.step_overhead_s


def _fields(pc: PlanConfig) -> dict:
    return {f: getattr(pc, f) for f in pc.__dataclass_fields__}


def roofline_profile(model: ModelSpec, hw: HardwareSpec, pc: PlanConfig, rc: RooflineConfig | None = None,
                     name: str | None = None) -> EngineProfile:
    """Profile points of one TP group of ``hw`` serving ``model`` (``source.kind = roofline``)."""
    rc = rc or RooflineConfig()
    total, active, assumed = model.params(pc.use_assumptions)
    if total is None or active is None:
        raise ValueError(f"{model.name}: parameter counts unknown; a roofline needs total and active parameters")
    pre = [PrefillPoint(n, ctx, prefill_s(model, hw, pc, rc, total, active, n, ctx),
                        math.ceil(n / rc.max_prefill_tokens_per_step))
           for n in (1024, 4096, 16384, 65536) for ctx in (0, 32768, 131072)]
    dec = [DecodePoint(b, c, decode_step_s(model, hw, pc, rc, total, active, b, c))
           for b in (1, 16, 64, 256) for c in (8192, 32768, 131072)]
    res = plan(model, hw, pc)
    bs = rc.block_size
    block_bytes = bs * res.mla_bytes_per_token
    host_bytes = (pc.host_gb if pc.host_gb is not None else hw.host_gb) * 1e9 * pc.host_fraction
    memory: dict[str, float] = {"host_blocks_per_node": math.floor(host_bytes / block_bytes)}
    if res.free_bytes_gpu is not None and res.free_bytes_gpu > 0:
        memory["device_blocks"] = math.floor(res.free_bytes_gpu / (bs * res.mla_bytes_per_token_gpu))
    notes = [f"roofline of {model.name} on {pc.tp} x {hw.name} (TP {pc.tp}, DCP {pc.dcp}, {pc.kv_dtype} KV, "
             f"{pc.weight_dtype} weights): mbu {rc.mbu}, mfu decode {rc.mfu_decode}, prefill {rc.mfu_prefill}, "
             f"step overhead {rc.step_overhead_s * 1e3:g} ms", *model.notes]
    if assumed:
        notes.append(f"ASSUMED (not published): {total:.3g} total and {active:.3g} active parameters "
                     f"({', '.join(f'{k}={v:.3g}' for k, v in model.assumptions.items())})")
    notes.append(f"hardware: {hw.hbm_gb:g} GB HBM, {hw.hbm_tbps:g} TB/s, {hw.fp8_tflops:g} dense FP8 TFLOPS "
                 f"(vendor peaks); host link {hw.host_link_gbps:g} GB/s per GPU (measured on an H200)")
    return EngineProfile(
        name or f"{hw.name}-{model.name}-tp{pc.tp}" + (f"-dcp{pc.dcp}" if pc.dcp > 1 else ""),
        {"kind": "roofline", "command": f"disagg plan --model {model.name} --hardware {hw.name} --tp {pc.tp} "
                                        f"--dcp {pc.dcp} --kv-dtype {pc.kv_dtype} --emit-profile FILE",
         "date": dt.date.today().isoformat(), "notes": notes},
        model=model.name, hardware=hw.name, gpus_per_worker=pc.tp, block_size=bs, prefill=pre, decode=dec,
        transfer={"host": {"gbps": hw.host_link_gbps * pc.dcp, "latency_s": 50e-6},
                  "disk": {"gbps": rc.disk_gbps, "latency_s": 500e-6},
                  "remote": {"gbps": rc.nic_gbps * pc.dcp, "latency_s": 1e-3}},
        state={"bytes_per_token": res.mla_bytes_per_token, "checkpoint_bytes": res.kda_state_bytes},
        limits={"max_prefill_tokens_per_step": rc.max_prefill_tokens_per_step, "max_decode_batch": rc.max_decode_batch},
        memory=memory,
        description=f"{model.name} on {pc.tp} x {hw.name}: roofline from published figures",
    )
