"""Checkpoints: HF-style safetensors + config.json in, out and fingerprinted.

Layout of a model directory::

    config.json                        K3Config keys (HF KimiLinearConfig)
    model.safetensors                  one file, or
    model-0000i-of-0000n.safetensors   shards listed by
    model.safetensors.index.json       {"weight_map": {tensor name: shard file}}

Tensor names are the HF / vLLM names (``model.layers.{i}.self_attn.q_proj.weight``,
``...block_sparse_moe.experts.{j}.w1.weight``, ``lm_head.weight``, ...).

NOTES
1. Loading is strict: a missing, unexpected or wrongly shaped tensor is a
   ``ValueError`` naming the tensor. Tolerated: ``lm_head.weight`` when the
   embeddings are tied, multi-token-prediction layers (ids >= num_hidden_layers),
   and the two layouts of equal size that checkpoints use for conv weights
   ([D, W] vs [D, 1, W]) and A_log ([H] vs [1, 1, H, 1]).
2. ``weights_fingerprint`` hashes names, dtypes, shapes and bytes in sorted
   name order: equal weights give equal ids on any machine.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from disagg.engine.reference.config import K3Config
from disagg.engine.reference.model import K3ForCausalLM, cast_model

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_RESHAPE_OK = ("conv1d.weight", "A_log")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def _checkpoint_names(model: K3ForCausalLM) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def save_safetensors(model: K3ForCausalLM, directory: str | Path) -> Path:
    """Write ``model.safetensors`` and ``config.json`` (torch_dtype set to the model's dtype)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in _checkpoint_names(model).items()}
    save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})
    cfg = K3Config.from_json(model.config.to_dict())
    cfg.torch_dtype = str(model.dtype).removeprefix("torch.")
    cfg.save(path)
    return path


def _shard_map(path: Path) -> dict[str, str]:
    """tensor name -> shard file name."""
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        return dict(weight_map)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    out: dict[str, str] = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                if key in out:
                    raise ValueError(f"tensor {key!r} appears in both {out[key]} and {name}")
                out[key] = name
    return out


def _skippable(name: str, config: K3Config) -> bool:
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return True
    if "rotary_emb.inv_freq" in name:
        return True
    m = _LAYER_RE.match(name)
    return m is not None and int(m.group(1)) >= config.num_hidden_layers  # MTP layers


def _parse_dtype(name: str | None) -> torch.dtype:
    dtype = getattr(torch, name or "float32", None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"torch_dtype: {name!r} is not a torch dtype")
    return dtype


def load_model(
    directory: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> K3ForCausalLM:
    """Load config.json + safetensors from ``directory`` (dtype None: the config's torch_dtype)."""
    path = Path(directory)
    if not (path / "config.json").exists():
        raise ValueError(f"{path}: config.json is missing")
    config = K3Config.from_json(path)
    dtype = dtype or _parse_dtype(config.torch_dtype)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model.to_empty(device=device)
    model.tie_weights()
    model = cast_model(model, dtype, device)
    params = _checkpoint_names(model)
    shard_of = _shard_map(path)
    unexpected = sorted(n for n in shard_of if n not in params and not _skippable(n, config))
    if unexpected:
        raise ValueError(
            f"unexpected tensor {unexpected[0]!r} in checkpoint ({len(unexpected)} unexpected)"
        )
    missing = sorted(n for n in params if n not in shard_of)
    if missing:
        raise ValueError(f"missing tensor {missing[0]!r} in checkpoint ({len(missing)} missing)")
    by_file: dict[str, list[str]] = {}
    for name in params:
        by_file.setdefault(shard_of[name], []).append(name)
    with torch.no_grad():
        for fname, names in sorted(by_file.items()):
            if not (path / fname).exists():
                raise ValueError(f"shard {fname!r} (holding tensor {names[0]!r}) is missing")
            with safe_open(str(path / fname), framework="pt") as f:
                available = set(f.keys())
                for name in names:
                    if name not in available:
                        raise ValueError(f"missing tensor {name!r}: not in shard {fname}")
                    t = f.get_tensor(name)
                    dst = params[name]
                    if tuple(t.shape) != tuple(dst.shape):
                        if name.endswith(_RESHAPE_OK) and t.numel() == dst.numel():
                            t = t.reshape(dst.shape)
                        else:
                            raise ValueError(
                                f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}"
                            )
                    dst.copy_(t.to(dst.dtype))
    return model.eval()


def weights_fingerprint(model: torch.nn.Module, length: int = 16) -> str:
    """Short sha256 over parameter names, dtypes, shapes and bytes (NOTE 2)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:length]
