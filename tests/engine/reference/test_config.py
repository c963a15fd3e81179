"""K3Config: HF keys, presets, derived layer ids, validation errors that name the key."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from disagg.engine.reference.config import PRESETS, K3Config, load_preset
from disagg.engine.reference.model import K3ForCausalLM

VLLM_TINY = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "torch_dtype": "bfloat16",
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "q_lora_rank": None,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "mla_use_nope": True,
    "mla_use_output_gate": False,
    "num_experts": 4,
    "num_experts_per_token": 2,
    "moe_intermediate_size": 64,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "num_nextn_predict_layers": 0,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3],
        "full_attn_layers": [4],
        "num_heads": 4,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
    },
}


def test_presets_load_and_have_expected_geometry():
    assert set(PRESETS) == {"tiny", "small", "kimi-linear-48b"}
    tiny = load_preset("tiny")
    assert tiny.mla_layer_ids == [3, 7]
    assert tiny.kda_layer_ids == [0, 1, 2, 4, 5, 6]
    assert tiny.latent_dim == 128 + 32
    big = load_preset("kimi-linear-48b")
    assert big.mla_layer_ids == [3, 7, 11, 15, 19, 23, 26]
    assert len(big.kda_layer_ids) == 20 and big.latent_dim == 576
    assert not big.is_moe_layer(0) and all(big.is_moe_layer(i) for i in range(1, 27))
    small = load_preset("small")
    assert small.mla_layer_ids == [3, 7, 11, 15] and small.num_experts_per_token == 4


def test_vllm_tiny_config_round_trips_and_keeps_unknown_keys(tmp_path):
    cfg = K3Config.from_json(VLLM_TINY)
    assert cfg.extra["rope_theta"] == 10000.0 and cfg.extra["head_dim"] == 32
    assert cfg.to_dict() == VLLM_TINY
    cfg.save(tmp_path)
    again = K3Config.from_json(tmp_path)  # a directory holding config.json
    assert again == cfg
    assert json.loads((tmp_path / "config.json").read_text()) == VLLM_TINY


def test_moe_layer_rule():
    d = copy.deepcopy(VLLM_TINY) | {"first_k_dense_replace": 0, "moe_layer_freq": 2}
    cfg = K3Config.from_json(d)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    cfg = K3Config.from_json(VLLM_TINY | {"num_experts": None})
    assert not any(cfg.is_moe_layer(i) for i in range(4))


def _with(**changes):
    d = copy.deepcopy(VLLM_TINY)
    for key, value in changes.items():
        if key.startswith("la_"):
            d["linear_attn_config"][key[3:]] = value
        else:
            d[key] = value
    return d


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"la_kda_layers": [1, 2, 3, 4]}, "both"),
        ({"la_kda_layers": [1, 2]}, "neither"),
        ({"la_full_attn_layers": [4, 5]}, "full_attn_layers"),
        ({"la_head_dim": 0}, "linear_attn_config.head_dim"),
        ({"la_head_k_dim": 16}, "head_k_dim"),
        ({"la_num_heads": None}, "linear_attn_config.num_heads"),
        ({"num_experts_per_token": 5}, "num_experts_per_token"),
        ({"q_lora_rank": -3}, "q_lora_rank"),
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"hidden_size": "128"}, "hidden_size"),
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"moe_router_activation_func": "relu"}, "moe_router_activation_func"),
        ({"num_expert_group": 3}, "num_expert_group"),
        ({"eos_token_id": 5000}, "eos_token_id"),
    ],
)
def test_invalid_configs_name_the_key(changes, needle):
    with pytest.raises(ValueError, match=needle):
        K3Config.from_json(_with(**changes))


def test_missing_linear_attn_key_is_named():
    d = copy.deepcopy(VLLM_TINY)
    del d["linear_attn_config"]["short_conv_kernel_size"]
    with pytest.raises(ValueError, match="short_conv_kernel_size"):
        K3Config.from_json(d)


def test_bad_json_file_and_unknown_preset(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        K3Config.from_json(tmp_path / "config.json")
    with pytest.raises(ValueError, match="unknown preset"):
        load_preset("huge")


def test_small_preset_size():
    with torch.device("meta"):
        model = K3ForCausalLM(load_preset("small"))
    assert 0.5e9 < model.num_parameters() < 1.0e9
