"""``K3Config``: the Kimi Linear / K3 model configuration, HF ``config.json`` keys.

The keys and their meaning follow vLLM's ``KimiLinearConfig``:

    layer i (0-based) is KDA  iff  i + 1 in linear_attn_config["kda_layers"]
                      is MLA  iff  i + 1 in linear_attn_config["full_attn_layers"]
    layer i uses MoE  iff  num_experts is set and i >= first_k_dense_replace
                           and i % moe_layer_freq == 0
    MLA cache row per token = kv_lora_rank + qk_rope_head_dim values (latent_dim)

Example (the tiny preset, abridged)::

    {"hidden_size": 256, "num_hidden_layers": 8, "kv_lora_rank": 128,
     "linear_attn_config": {"kda_layers": [1,2,3,5,6,7], "full_attn_layers": [4,8],
                            "num_heads": 4, "head_dim": 64, "short_conv_kernel_size": 4}}

NOTES
1. Keys this class does not model (``rope_theta``, ``head_dim``, ...) are kept in
   ``extra`` and written back by ``to_dict`` unchanged.
2. Every layer appears in exactly one of ``kda_layers`` / ``full_attn_layers``;
   a violation is a ``ValueError`` naming the key and the layer.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PRESET_DIR = Path(__file__).parent / "presets"
PRESETS: tuple[str, ...] = ("tiny", "small", "kimi-linear-48b")

_LINEAR_REQUIRED = (
    "kda_layers",
    "full_attn_layers",
    "num_heads",
    "head_dim",
    "short_conv_kernel_size",
)
_ROUTER_FUNCS = ("sigmoid", "softmax")


def _default_linear_attn() -> dict[str, Any]:
    return {
        "kda_layers": [i for i in range(1, 28) if i % 4 != 0 and i != 27],
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    }


@dataclass(slots=True)
class K3Config:
    """Validated model configuration (defaults: Kimi-Linear-48B-A3B)."""

    vocab_size: int = 163840
    hidden_size: int = 2304
    intermediate_size: int = 9216  # dense SwiGLU width
    num_hidden_layers: int = 27
    num_attention_heads: int = 32  # MLA query heads
    num_key_value_heads: int = 32  # kept for HF compatibility (MLA has one latent KV head)
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    q_lora_rank: int | None = None  # None: q_proj is full rank (Kimi Linear)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True  # no rotary embedding on the "rope" dims
    num_experts: int | None = 256  # None: every layer dense
    num_experts_per_token: int = 8
    moe_intermediate_size: int = 1024
    num_shared_experts: int | None = 1
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    moe_renormalize: bool = True
    moe_router_activation_func: str = "sigmoid"
    routed_scaling_factor: float = 2.446
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    linear_attn_config: dict[str, Any] = field(default_factory=_default_linear_attn)
    bos_token_id: int | None = 163584
    eos_token_id: int | None = 163586
    pad_token_id: int | None = 163839
    model_type: str = "kimi_linear"
    architectures: list[str] = field(default_factory=lambda: ["KimiLinearForCausalLM"])
    torch_dtype: str = "bfloat16"
    extra: dict[str, Any] = field(default_factory=dict)  # unknown keys, kept (NOTE 1)

    def __post_init__(self) -> None:
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
        ):
            _positive_int(key, getattr(self, key))
        if self.q_lora_rank is not None:
            _positive_int("q_lora_rank", self.q_lora_rank)
        if not self.mla_use_nope:
            raise ValueError("mla_use_nope: only NoPE MLA (true) is supported; rotary MLA is not")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {self.hidden_act!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        self._validate_linear_attn()
        self._validate_moe()
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            tok = getattr(self, key)
            if tok is not None and not (isinstance(tok, int) and 0 <= tok < self.vocab_size):
                raise ValueError(
                    f"{key}: {tok!r} is not an id in [0, vocab_size={self.vocab_size})"
                )

    def _validate_linear_attn(self) -> None:
        la = self.linear_attn_config
        if not isinstance(la, dict):
            raise ValueError("linear_attn_config must be an object")
        for key in _LINEAR_REQUIRED:
            if key not in la:
                raise ValueError(f"linear_attn_config.{key} is missing")
        for key in ("num_heads", "head_dim", "short_conv_kernel_size"):
            _positive_int(f"linear_attn_config.{key}", la[key])
        for key in ("head_k_dim", "head_v_dim"):  # the reference keeps K == V == head_dim
            if key in la and la[key] != la["head_dim"]:
                raise ValueError(
                    f"linear_attn_config.{key}={la[key]} differs from head_dim={la['head_dim']}"
                )
        n = self.num_hidden_layers
        kda, full = la["kda_layers"], la["full_attn_layers"]
        for key, ids in (("kda_layers", kda), ("full_attn_layers", full)):
            if not isinstance(ids, list) or len(set(ids)) != len(ids):
                raise ValueError(
                    f"linear_attn_config.{key} must be a list of distinct 1-based layer ids"
                )
            for i in ids:
                if not isinstance(i, int) or not 1 <= i <= n:
                    raise ValueError(
                        f"linear_attn_config.{key}: layer {i!r} outside 1..{n} (1-based)"
                    )
        both = sorted(set(kda) & set(full))
        if both:
            raise ValueError(
                f"linear_attn_config: layer {both[0]} (1-based) is in both kda_layers and full_attn_layers"
            )
        missing = sorted(set(range(1, n + 1)) - set(kda) - set(full))
        if missing:
            raise ValueError(
                f"linear_attn_config: layer {missing[0]} (1-based) is in neither kda_layers nor full_attn_layers"
            )

    def _validate_moe(self) -> None:
        if self.num_experts is None:
            return
        _positive_int("num_experts", self.num_experts)
        _positive_int("num_experts_per_token", self.num_experts_per_token)
        _positive_int("moe_intermediate_size", self.moe_intermediate_size)
        _positive_int("moe_layer_freq", self.moe_layer_freq)
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(
                f"num_experts_per_token={self.num_experts_per_token} exceeds num_experts={self.num_experts}"
            )
        if self.first_k_dense_replace < 0:
            raise ValueError(
                f"first_k_dense_replace must be >= 0, got {self.first_k_dense_replace}"
            )
        if self.moe_router_activation_func not in _ROUTER_FUNCS:
            raise ValueError(f"moe_router_activation_func must be one of {_ROUTER_FUNCS}")
        if self.num_shared_experts is not None and self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be >= 0, got {self.num_shared_experts}")
        _positive_int("num_expert_group", self.num_expert_group)
        if self.num_experts % self.num_expert_group:
            raise ValueError(
                f"num_expert_group={self.num_expert_group} does not divide num_experts={self.num_experts}"
            )
        if not 1 <= self.topk_group <= self.num_expert_group:
            raise ValueError(
                f"topk_group={self.topk_group} must be in 1..num_expert_group={self.num_expert_group}"
            )
        if (
            self.topk_group * (self.num_experts // self.num_expert_group)
            < self.num_experts_per_token
        ):
            raise ValueError(
                "topk_group: the chosen groups hold fewer experts than num_experts_per_token"
            )

    # -- derived geometry ---------------------------------------------------------
    @property
    def kda_layer_ids(self) -> list[int]:
        """0-based ids of the KDA layers, ascending."""
        return sorted(i - 1 for i in self.linear_attn_config["kda_layers"])

    @property
    def mla_layer_ids(self) -> list[int]:
        """0-based ids of the MLA (full attention) layers, ascending."""
        return sorted(i - 1 for i in self.linear_attn_config["full_attn_layers"])

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_num_heads(self) -> int:
        return self.linear_attn_config["num_heads"]

    @property
    def kda_head_dim(self) -> int:
        return self.linear_attn_config["head_dim"]

    @property
    def conv_width(self) -> int:
        return self.linear_attn_config["short_conv_kernel_size"]

    def is_kda_layer(self, i: int) -> bool:
        return i + 1 in self.linear_attn_config["kda_layers"]

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts is not None
            and i >= self.first_k_dense_replace
            and i % self.moe_layer_freq == 0
        )

    # -- (de)serialisation ----------------------------------------------------------
    @classmethod
    def from_json(cls, source: str | Path | dict[str, Any]) -> K3Config:
        """Build from a dict, a config.json path, or a directory holding config.json."""
        if isinstance(source, dict):
            data = dict(source)
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from e
            if not isinstance(data, dict):
                raise ValueError(f"{path}: the top level must be a JSON object")
        if "text_config" in data and isinstance(data["text_config"], dict):
            raise ValueError(
                "text_config: nested (multimodal) configs are not supported; pass the text config"
            )
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known}
        if "linear_attn_config" in kwargs and isinstance(kwargs["linear_attn_config"], dict):
            kwargs["linear_attn_config"] = dict(kwargs["linear_attn_config"])
        try:
            return cls(**kwargs, extra=extra)
        except TypeError as e:  # a wrong type surfacing as a comparison error
            raise ValueError(f"config.json: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out["linear_attn_config"] = dict(self.linear_attn_config)
        out["architectures"] = list(self.architectures)
        return {**out, **self.extra}

    def save(self, directory: str | Path) -> Path:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        out = path / "config.json"
        out.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return out


def load_preset(name: str) -> K3Config:
    """A named preset from ``presets/<name>.json`` (see ``PRESETS``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return K3Config.from_json(PRESET_DIR / f"{name}.json")


def _positive_int(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
