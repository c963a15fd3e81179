"""Model shapes for capacity planning: presets and any HF ``config.json``.

What the arithmetic needs of a model::

    MLA layers L_m, latent values per token per layer r + d_rope   (K3: 24, 512 + 64 = 576)
    KDA layers L_k, heads H_k, head dim K (= V), short-conv width w  (K3: 69, 32, 128, 4)
    plain attention layers L_a with kv heads H_a and head dim D_a    (GQA/MHA models)
    total and active parameters                                      (weights, FLOPs)

``from_hf_config`` reads the three families it meets: Kimi Linear / K3
(``linear_attn_config``), pure MLA (DeepSeek-V3, Kimi K2: ``kv_lora_rank``
without linear attention) and plain attention (``num_key_value_heads``,
``head_dim``). Parameter counts of a config are estimated from its shapes
(embeddings, attention, KDA, dense and MoE MLPs); presets carry published
counts where there are any.

A figure that is not published is an *assumption*: it is kept apart
(``assumptions``), used only when asked for, and printed as such.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class ModelSpec:
    name: str
    num_mla_layers: int = 0  # MLA (latent attention) layers
    mla_query_heads: int = 0  # MLA query heads (split by TP)
    kv_lora_rank: int = 512  # MLA latent width
    qk_rope_head_dim: int = 64  # MLA decoupled key dims (cached with the latent)
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    num_kda_layers: int = 0  # KDA (linear attention) layers
    kda_heads: int = 0  # KDA heads (split by TP)
    kda_head_dim: int = 128  # K == V
    conv_kernel: int = 4  # KDA short-conv width (state keeps width - 1 inputs)
    num_attn_layers: int = 0  # plain (GQA/MHA) attention layers
    attn_kv_heads: int = 0
    attn_head_dim: int = 0
    hidden_size: int | None = None
    num_experts: int | None = None  # routed experts per MoE layer
    experts_per_token: int | None = None
    total_params: float | None = None  # parameters (None: not known)
    active_params: float | None = None  # parameters used per token
    notes: list[str] = field(default_factory=list)  # sources
    assumptions: dict[str, float] = field(default_factory=dict)  # unpublished stand-ins (see module docstring)

    def __post_init__(self) -> None:
        for key in ("num_mla_layers", "num_kda_layers", "num_attn_layers", "mla_query_heads", "kda_heads"):
            if getattr(self, key) < 0:
                raise ValueError(f"{self.name}: {key} must be >= 0")
        if self.num_mla_layers + self.num_kda_layers + self.num_attn_layers == 0:
            raise ValueError(f"{self.name}: a model needs at least one attention or KDA layer")

    @property
    def latent_dim(self) -> int:
        """MLA values cached per token per layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def params(self, use_assumptions: bool = False) -> tuple[float | None, float | None, bool]:
        """(total, active, assumed?) parameters."""
        total, active = self.total_params, self.active_params
        assumed = False
        if use_assumptions:
            if total is None and "total_params" in self.assumptions:
                total, assumed = self.assumptions["total_params"], True
            if active is None and "active_params" in self.assumptions:
                active, assumed = self.assumptions["active_params"], True
        return total, active, assumed


KIMI_K3 = ModelSpec(
    "kimi-k3",
    num_mla_layers=24,
    mla_query_heads=96,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    num_kda_layers=69,
    kda_heads=32,
    kda_head_dim=128,
    conv_kernel=4,
    num_experts=896,
    experts_per_token=16,
    notes=[
        "published: 24 MLA layers, 69 KDA layers, 96 MLA query heads (12 per GPU at TP8), "
        "576-value latent (kv_lora_rank 512 + 64), MoE 16 of 896 experts",
        "KDA: 32 heads of 128 x 128 fp32 (~2 MiB of recurrent state per layer before the TP split) "
        "and width-4 short conv, as in the design notes",
    ],
    assumptions={"total_params": 1.04e12, "active_params": 32e9},  # Kimi K2's published sizes, a stand-in
)

PRESETS: dict[str, ModelSpec] = {"kimi-k3": KIMI_K3}


def _count_layers(cfg: dict[str, Any]) -> tuple[int, int]:
    la = cfg["linear_attn_config"]
    return len(la.get("full_attn_layers", [])), len(la.get("kda_layers", []))


def estimate_params(cfg: dict[str, Any]) -> tuple[float, float]:
    """(total, active) parameters of an HF config, from its shapes (embeddings and projections)."""
    h = int(cfg["hidden_size"])
    vocab = int(cfg.get("vocab_size", 0))
    n_layers = int(cfg["num_hidden_layers"])
    heads = int(cfg.get("num_attention_heads", 0))
    emb = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    la = cfg.get("linear_attn_config")
    kda_set = set(la.get("kda_layers", [])) if la else set()
    attn_total = 0.0
    for i in range(n_layers):
        if (i + 1) in kda_set:
            hk = int(la["num_heads"]) * int(la["head_dim"])
            attn_total += 4 * h * hk + 2 * h * 128 + 128 * hk + h * int(la["num_heads"]) + 3 * hk * 4
        elif cfg.get("kv_lora_rank"):
            r, dr = int(cfg["kv_lora_rank"]), int(cfg.get("qk_rope_head_dim", 64))
            dn, dv = int(cfg.get("qk_nope_head_dim", 128)), int(cfg.get("v_head_dim", 128))
            q_lora = cfg.get("q_lora_rank")
            q = h * q_lora + q_lora * heads * (dn + dr) if q_lora else h * heads * (dn + dr)
            attn_total += q + h * (r + dr) + r * heads * (dn + dv) + heads * dv * h
        else:
            hd = int(cfg.get("head_dim") or h // max(heads, 1))
            kv = int(cfg.get("num_key_value_heads") or heads)
            attn_total += h * heads * hd * 2 + 2 * h * kv * hd
    experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    topk = cfg.get("num_experts_per_token") or cfg.get("num_experts_per_tok") or 0
    first_dense = int(cfg.get("first_k_dense_replace", 0))
    freq = int(cfg.get("moe_layer_freq", 1))
    moe_w = int(cfg.get("moe_intermediate_size") or 0)
    shared = int(cfg.get("num_shared_experts") or cfg.get("n_shared_experts") or 0)
    dense_w = int(cfg.get("intermediate_size") or 0)
    mlp_total = mlp_active = 0.0
    for i in range(n_layers):
        if experts and i >= first_dense and i % freq == 0:
            per = 3 * h * moe_w
            mlp_total += experts * per + shared * per + h * experts
            mlp_active += topk * per + shared * per + h * experts
        else:
            mlp_total += 3 * h * dense_w
            mlp_active += 3 * h * dense_w
    total = emb + attn_total + mlp_total
    return total, total - mlp_total + mlp_active


def from_hf_config(source: str | Path | dict[str, Any], name: str | None = None) -> ModelSpec:
    """A ``ModelSpec`` from an HF ``config.json`` (a dict, a file, or a model directory)."""
    if isinstance(source, dict):
        cfg, where = source, name or "config"
    else:
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"{source}: no config.json there")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        where = name or path.parent.name or path.stem
    for key in ("hidden_size", "num_hidden_layers"):
        if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
            raise ValueError(f"{where}: config.json needs a positive integer {key!r}")
    heads = int(cfg.get("num_attention_heads", 0))
    experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts")
    topk = cfg.get("num_experts_per_token") or cfg.get("num_experts_per_tok")
    common = dict(hidden_size=cfg["hidden_size"], num_experts=experts, experts_per_token=topk,
                  notes=[f"shapes from {where}'s config.json; parameter counts estimated from them"])
    if "linear_attn_config" in cfg:
        la = cfg["linear_attn_config"]
        n_mla, n_kda = _count_layers(cfg)
        spec = ModelSpec(where, num_mla_layers=n_mla, mla_query_heads=heads,
                         kv_lora_rank=int(cfg.get("kv_lora_rank", 512)),
                         qk_rope_head_dim=int(cfg.get("qk_rope_head_dim", 64)),
                         qk_nope_head_dim=int(cfg.get("qk_nope_head_dim", 128)),
                         v_head_dim=int(cfg.get("v_head_dim", 128)), num_kda_layers=n_kda,
                         kda_heads=int(la["num_heads"]), kda_head_dim=int(la["head_dim"]),
                         conv_kernel=int(la.get("short_conv_kernel_size", 4)), **common)
    elif cfg.get("kv_lora_rank"):
        spec = ModelSpec(where, num_mla_layers=cfg["num_hidden_layers"], mla_query_heads=heads,
                         kv_lora_rank=int(cfg["kv_lora_rank"]), qk_rope_head_dim=int(cfg.get("qk_rope_head_dim", 64)),
                         qk_nope_head_dim=int(cfg.get("qk_nope_head_dim", 128)),
                         v_head_dim=int(cfg.get("v_head_dim", 128)), **common)
    else:
        if heads <= 0:
            raise ValueError(f"{where}: config.json needs num_attention_heads")
        spec = ModelSpec(where, num_attn_layers=cfg["num_hidden_layers"],
                         attn_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                         attn_head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads), **common)
    total, active = estimate_params(cfg)
    return replace(spec, total_params=total, active_params=active)


def reference_preset(name: str) -> ModelSpec:
    """A reference-engine preset (``tiny``, ``small``, ``kimi-linear-48b``) as a ``ModelSpec``."""
    from disagg.engine.reference.config import PRESET_DIR

    return from_hf_config(PRESET_DIR / f"{name}.json", name)


def load_model(name_or_path: str) -> ModelSpec:
    """A planning preset (``kimi-k3``), a reference preset, or a config.json / model directory."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    from disagg.engine.reference.config import PRESETS as REF_PRESETS

    if name_or_path in REF_PRESETS:
        return reference_preset(name_or_path)
    path = Path(name_or_path)
    if path.exists():
        return from_hf_config(path)
    known = ", ".join([*PRESETS, *REF_PRESETS])
    raise ValueError(f"unknown model {name_or_path!r}: not a preset ({known}) nor a config.json path")
