"""Build an engine (and its tokenizer) from the typed configuration."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from disagg.config import AppConfig, ModelConfig


def load_reference_model(cfg: ModelConfig):
    """The reference model from a preset name or a model directory. Returns (model, model_id)."""
    from disagg.engine.reference.config import PRESETS, load_preset
    from disagg.engine.reference.model import K3ForCausalLM
    from disagg.engine.reference.weights import load_model, weights_fingerprint

    dtype = getattr(torch, cfg.dtype)
    if cfg.name in PRESETS:
        model = K3ForCausalLM.random_init(load_preset(cfg.name), seed=cfg.seed, dtype=dtype).to(cfg.device)
        model_id = f"{cfg.name}-seed{cfg.seed}-{cfg.dtype}"
    elif Path(cfg.name).is_dir():
        model = load_model(cfg.name, dtype=dtype, device=cfg.device)
        model_id = f"{Path(cfg.name).name}-{weights_fingerprint(model)}-{cfg.dtype}"
    else:
        raise ValueError(f"model {cfg.name!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")
    model.eval()
    return model, model_id


def build_reference_engine(app: AppConfig):
    from disagg.engine.reference.engine import EngineOptions, ReferenceEngine

    e = app.engine
    if e.num_threads:
        torch.set_num_threads(e.num_threads)
    model, model_id = load_reference_model(app.model)
    opts = EngineOptions(
        block_size=e.block_size,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        cache_budget_bytes=e.cache_budget_mb << 20,
        checkpoint_interval=e.checkpoint_interval,
        resident_sessions=e.resident_sessions,
        cuda_graphs=e.cuda_graphs,
        decode_graphs=e.decode_graphs,
    )
    return ReferenceEngine(model, model_id, opts)


def build_tokenizer(app: AppConfig):
    from disagg.engine.reference.tokenizer import load_tokenizer

    name = app.model.name
    return load_tokenizer(name if Path(name).is_dir() else None)


@dataclass(slots=True)
class EngineLimits:
    max_model_len: int  # prompt + output tokens one request may hold
    vocab_size: int  # valid token ids are [0, vocab_size)
    eos_token_id: int | None  # the model's end-of-sequence id


def engine_limits(app: AppConfig) -> EngineLimits:
    """What a replica of this config will accept, computed from the config alone (no weights)."""
    from disagg.engine.reference.config import PRESETS, K3Config, load_preset
    from disagg.engine.reference.paged_cache import size_cache

    name = app.model.name
    mc = load_preset(name) if name in PRESETS else K3Config.from_json(Path(name) / "config.json")
    layout = layout_for(mc, "limits", app.engine.block_size, app.model.dtype)
    geo = size_cache(layout, app.engine.cache_budget_mb << 20, app.engine.max_num_seqs)
    cap = geo.num_blocks * app.engine.block_size
    if app.engine.max_model_len:
        cap = min(cap, app.engine.max_model_len)
    return EngineLimits(cap, mc.vocab_size, mc.eos_token_id)


def layout_for(mc, model_id: str, block_size: int, dtype: str):
    """The ``StateLayout`` of a K3 config (the reference engine's cache layout)."""
    from kv_transfer.objects import StateLayout

    la = mc.linear_attn_config
    state = "float64" if dtype == "float64" else "float32"
    return StateLayout(model_id, block_size, len(mc.mla_layer_ids), mc.kv_lora_rank + mc.qk_rope_head_dim,
                       len(mc.kda_layer_ids), la["num_heads"], la["head_dim"], la["head_dim"],
                       la["short_conv_kernel_size"], dtype, dtype, state)
