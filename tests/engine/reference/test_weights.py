"""Checkpoints: save/load round trip, shards, strict errors naming the tensor or key."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from disagg.engine.reference.cache_view import DenseSequenceCache, SeqInput
from disagg.engine.reference.weights import load_model, save_safetensors, weights_fingerprint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tiny_fp32):
    return save_safetensors(tiny_fp32, tmp_path_factory.mktemp("ckpt"))


def logits(model, ids):
    return model(
        [SeqInput(ids, 0, DenseSequenceCache.empty(model.config, model.dtype), all_logits=True)]
    )[0]


def copy_ckpt(src, dst, edit=None, config_edit=None):
    tensors = load_file(str(src / "model.safetensors"))
    if edit:
        edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_round_trip_reproduces_logits(ckpt, tiny_fp32, helpers):
    names = set(load_file(str(ckpt / "model.safetensors")))
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in names
    assert "model.layers.0.self_attn.q_conv1d.weight" in names and "lm_head.weight" in names
    loaded = load_model(ckpt, dtype=torch.float32)
    assert weights_fingerprint(loaded) == weights_fingerprint(tiny_fp32)
    ids = helpers.token_ids(70)
    assert torch.equal(logits(loaded, ids), logits(tiny_fp32, ids))
    assert json.loads((ckpt / "config.json").read_text())["torch_dtype"] == "float32"
    assert load_model(ckpt).dtype == torch.float32  # dtype from config.json


def test_sharded_checkpoint_with_index(ckpt, tmp_path, tiny_fp32):
    tensors = load_file(str(ckpt / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate([names[:half], names[half:]]):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(tmp_path / fname))
        weight_map.update({n: fname for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    assert weights_fingerprint(load_model(tmp_path, torch.float32)) == weights_fingerprint(
        tiny_fp32
    )


def test_conv_weights_in_linear_layout_are_accepted(ckpt, tmp_path, tiny_fp32):
    def flatten_conv(t):
        for n in list(t):
            if n.endswith("conv1d.weight"):
                t[n] = t[n][:, 0, :].contiguous()

    copy_ckpt(ckpt, tmp_path, flatten_conv)
    assert weights_fingerprint(load_model(tmp_path, torch.float32)) == weights_fingerprint(
        tiny_fp32
    )


BAD_TENSOR = "model.layers.3.self_attn.kv_b_proj.weight"


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda t: t.pop(BAD_TENSOR), f"missing tensor '{BAD_TENSOR}'"),
        (
            lambda t: t.__setitem__(BAD_TENSOR, t[BAD_TENSOR][:, :-1].contiguous()),
            f"tensor '{BAD_TENSOR}' has shape",
        ),
        (
            lambda t: t.__setitem__("model.layers.0.self_attn.extra.weight", torch.zeros(2)),
            "unexpected tensor 'model.layers.0.self_attn.extra.weight'",
        ),
    ],
)
def test_tampered_checkpoint_names_the_tensor(ckpt, tmp_path, edit, needle):
    copy_ckpt(ckpt, tmp_path, edit)
    with pytest.raises(ValueError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        load_model(tmp_path, torch.float32)


@pytest.mark.parametrize(
    "config_edit, needle",
    [
        (lambda c: c["linear_attn_config"]["kda_layers"].append(4), "both"),
        (lambda c: c.__setitem__("num_experts_per_token", 99), "num_experts_per_token"),
        (lambda c: c.__setitem__("torch_dtype", "float33"), "torch_dtype"),
    ],
)
def test_bad_config_names_the_key(ckpt, tmp_path, config_edit, needle):
    copy_ckpt(ckpt, tmp_path, config_edit=config_edit)
    with pytest.raises(ValueError, match=needle):
        load_model(tmp_path)


def test_missing_config_or_weights(tmp_path, ckpt):
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text((ckpt / "config.json").read_text())
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path)


def test_fingerprint_tracks_the_weights(tiny_config):
    from disagg.engine.reference.model import K3ForCausalLM

    a = K3ForCausalLM.random_init(tiny_config, seed=3)
    fp = weights_fingerprint(a)
    assert len(fp) == 16
    with torch.no_grad():
        a.model.norm.weight[0] += 1e-3
    assert weights_fingerprint(a) != fp
