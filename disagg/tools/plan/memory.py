"""Memory and capacity arithmetic: state bytes per token, per GPU, per session, per tier.

Per model (see ``disagg.tools.plan.models``), with ``b_kv`` bytes per cached value::

    MLA bytes / token            = L_m * (r + d_rope) * b_kv                 (K3 fp8: 24 * 576 = 13,824 B)
    MLA bytes / GPU at C tokens  = C * L_m * (r + d_rope) * b_kv / DCP        (TP replicates the latent,
                                                                               DCP spreads positions)
    K3, C = 142,000, fp8:  142,000 * 24 * 576 B = 1.96 GB per GPU at TP8; 245 MB under DCP8
    plain attention / token / GPU = L_a * 2 * H_kv * D * b_kv / min(TP, H_kv)
    KDA state (one checkpoint)    = L_k * (H_k * K * K * b_state + (w - 1) * 3 * H_k * K * b_conv)
    ... per GPU                   = that / TP                                  (heads split by TP)

Resident sessions (a session's MLA history plus ``checkpoints_per_session``
KDA states, e.g. its turn end)::

    per TP group  = (HBM * util - weights / TP - reserve) / session bytes per GPU
    per host tier = host bytes * host_fraction / (MLA of the session, stored once
                    + checkpoints_per_session * KDA state, all shards)

Resume vs recompute: moving a session into the group takes
``session bytes per GPU / host link`` (every GPU loads its share at once);
recomputing it takes ``2 * active params * C / (TP * FP8 peak * mfu)`` plus
MLA attention, so the ratio says what a host tier is worth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from disagg.tools.plan.hardware import HardwareSpec
from disagg.tools.plan.models import ModelSpec

DTYPE_BYTES: dict[str, float] = {"fp4": 0.5, "fp8": 1.0, "bf16": 2.0, "fp16": 2.0, "fp32": 4.0}


def dtype_bytes(name: str) -> float:
    key = name.lower()
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


@dataclass(slots=True)
class PlanConfig:
    tp: int = 8  # tensor parallel GPUs per engine replica
    dcp: int = 1  # decode context parallel degree (divides TP)
    context: int = 142_000  # tokens per session
    kv_dtype: str = "fp8"  # MLA / attention cache dtype
    state_dtype: str = "fp32"  # KDA recurrent state
    conv_dtype: str = "bf16"  # KDA short-conv state
    weight_dtype: str = "fp8"
    weights_gb: float | None = None  # whole model's weights (GB); None: from parameters
    gpu_mem_util: float = 0.90  # share of HBM the engine may use
    reserve_gb: float = 8.0  # per GPU: activations, graphs, workspace
    checkpoints_per_session: int = 1  # KDA states kept per resident session (turn end)
    host_gb: float | None = None  # host DRAM per node (None: the hardware preset's)
    host_fraction: float = 0.8  # share of host DRAM given to the host tier
    mfu: float = 0.4  # prefill compute efficiency (recompute estimate)
    use_assumptions: bool = True  # use a preset's unpublished stand-ins (printed as such)

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dcp < 1 or self.tp % self.dcp:
            raise ValueError(f"need tp >= 1, dcp >= 1 and dcp dividing tp (got tp={self.tp}, dcp={self.dcp})")
        if self.context < 1:
            raise ValueError("context must be >= 1 token")
        for key in ("kv_dtype", "state_dtype", "conv_dtype", "weight_dtype"):
            dtype_bytes(getattr(self, key))
        if not 0 < self.gpu_mem_util <= 1 or not 0 < self.host_fraction <= 1 or not 0 < self.mfu <= 1:
            raise ValueError("gpu_mem_util, host_fraction and mfu must be in (0, 1]")
        if self.checkpoints_per_session < 0 or self.reserve_gb < 0:
            raise ValueError("checkpoints_per_session and reserve_gb must be >= 0")


@dataclass(slots=True)
class PlanResult:
    mla_bytes_per_token_layer: float  # one MLA layer, whole latent
    mla_bytes_per_token: float  # all MLA layers, per TP group (what the host tier stores)
    mla_bytes_per_token_gpu: float  # per GPU (DCP divides)
    attn_bytes_per_token_gpu: float  # plain attention layers, per GPU
    mla_bytes_gpu: float  # per GPU at the context
    kda_state_bytes: float  # one KDA state (checkpoint), all TP shards
    kda_state_bytes_gpu: float  # per GPU
    session_bytes_gpu: float  # a resident session, per GPU
    session_bytes_host: float  # a resident session in the host tier (stored once)
    weights_bytes_gpu: float | None  # None: unknown
    free_bytes_gpu: float | None  # for session state
    sessions_per_group: int | None  # resident sessions a TP group holds on device
    groups_per_node: int  # TP groups per node
    sessions_per_host_tier: int  # per node
    host_load_s: float  # a session from host into the group (all GPUs in parallel)
    recompute_s: float | None  # recomputing it (None: active parameters unknown)
    params_assumed: bool = False  # parameter counts are stand-ins, not published figures
    warnings: list[str] = field(default_factory=list)


def plan(model: ModelSpec, hw: HardwareSpec, cfg: PlanConfig) -> PlanResult:
    b_kv = dtype_bytes(cfg.kv_dtype)
    warnings: list[str] = []
    if model.mla_query_heads and model.mla_query_heads % cfg.tp:
        warnings.append(f"{model.mla_query_heads} MLA query heads do not split evenly over TP {cfg.tp}")
    if model.kda_heads and model.kda_heads % cfg.tp:
        warnings.append(f"{model.kda_heads} KDA heads do not split evenly over TP {cfg.tp}")
    mla_layer = model.latent_dim * b_kv if model.num_mla_layers else 0.0
    mla_tok = model.num_mla_layers * mla_layer
    mla_tok_gpu = mla_tok / cfg.dcp
    attn_tok_gpu = 0.0
    if model.num_attn_layers:
        per = model.num_attn_layers * 2 * model.attn_kv_heads * model.attn_head_dim * b_kv
        attn_tok_gpu = per / min(cfg.tp, max(model.attn_kv_heads, 1))
    h, k = model.kda_heads, model.kda_head_dim
    kda_layer = h * k * k * dtype_bytes(cfg.state_dtype) + (model.conv_kernel - 1) * 3 * h * k * dtype_bytes(cfg.conv_dtype)
    kda = model.num_kda_layers * kda_layer
    kda_gpu = kda / cfg.tp
    c = cfg.context
    session_gpu = c * (mla_tok_gpu + attn_tok_gpu) + cfg.checkpoints_per_session * kda_gpu
    attn_tok_group = attn_tok_gpu * min(cfg.tp, max(model.attn_kv_heads, 1)) if model.num_attn_layers else 0.0
    session_host = c * (mla_tok + attn_tok_group) + cfg.checkpoints_per_session * kda
    total, active, assumed = model.params(cfg.use_assumptions)
    if cfg.weights_gb is not None:
        weights_gpu = cfg.weights_gb * 1e9 / cfg.tp
    elif total is not None:
        weights_gpu = total * dtype_bytes(cfg.weight_dtype) / cfg.tp
    else:
        weights_gpu = None
    free = None
    per_group = None
    if weights_gpu is not None:
        free = hw.hbm_gb * 1e9 * cfg.gpu_mem_util - weights_gpu - cfg.reserve_gb * 1e9
        if free <= 0:
            warnings.append(f"weights ({weights_gpu / 1e9:.1f} GB per GPU) leave no memory for sessions at TP {cfg.tp}")
        per_group = max(0, math.floor(free / session_gpu)) if session_gpu > 0 else None
    host_bytes = (cfg.host_gb if cfg.host_gb is not None else hw.host_gb) * 1e9 * cfg.host_fraction
    per_host = math.floor(host_bytes / session_host) if session_host > 0 else 0
    load_s = session_gpu / (hw.host_link_gbps * 1e9)
    recompute = None
    if active is not None:
        flops = 2 * active * c
        if model.num_mla_layers:  # causal MLA attention over the context (prefill form, per head q.k and p.v)
            flops += 2 * model.num_mla_layers * model.mla_query_heads * (
                model.qk_nope_head_dim + model.qk_rope_head_dim + model.v_head_dim) * c * c / 2
        recompute = flops / (cfg.tp * hw.fp8_tflops * 1e12 * cfg.mfu)
    return PlanResult(mla_layer, mla_tok, mla_tok_gpu, attn_tok_gpu, c * mla_tok_gpu, kda, kda_gpu, session_gpu,
                      session_host, weights_gpu, free, per_group, max(1, hw.gpus_per_node // cfg.tp), per_host,
                      load_s, recompute, assumed and cfg.weights_gb is None, warnings)


def human_bytes(n: float) -> str:
    """Decimal units, as the published arithmetic writes them (1.96 GB, 245 MB)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"
