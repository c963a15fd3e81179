"""`disagg plan`: the published K3 arithmetic, model shapes from configs, draft depth, errors."""

from __future__ import annotations

import json
import re

import pytest

from disagg.launch.cli import main as disagg_main
from disagg.tools.plan.hardware import load_hardware
from disagg.tools.plan.memory import PlanConfig, human_bytes, plan
from disagg.tools.plan.models import KIMI_K3, from_hf_config, load_model
from disagg.tools.plan.roofline import roofline_profile
from disagg.tools.plan.speculative import committed_from_acceptance, cycle_costs, depth_table

MI355X = load_hardware("mi355x")


def _mla_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("MLA bytes per GPU"))


def test_cli_prints_the_published_mla_bytes(capsys):
    assert disagg_main(["plan", "--model", "kimi-k3", "--tp", "8", "--context", "142000", "--kv-dtype", "fp8"]) == 0
    assert re.search(r": 1\.96 GB", _mla_line(capsys.readouterr().out))
    assert disagg_main(["plan", "--model", "kimi-k3", "--tp", "8", "--dcp", "8", "--context", "142000",
                        "--kv-dtype", "fp8"]) == 0
    assert re.search(r": 245 MB", _mla_line(capsys.readouterr().out))


def test_mla_and_kda_arithmetic():
    res = plan(KIMI_K3, MI355X, PlanConfig(tp=8, context=142_000, kv_dtype="fp8"))
    assert res.mla_bytes_gpu == 142_000 * 24 * 576
    assert human_bytes(res.mla_bytes_gpu) == "1.96 GB"
    dcp = plan(KIMI_K3, MI355X, PlanConfig(tp=8, dcp=8, context=142_000, kv_dtype="fp8"))
    assert dcp.mla_bytes_gpu == 142_000 * 24 * 576 / 8
    assert human_bytes(dcp.mla_bytes_gpu) == "245 MB"
    bf16 = plan(KIMI_K3, MI355X, PlanConfig(tp=8, context=142_000, kv_dtype="bf16"))
    assert bf16.mla_bytes_gpu == 2 * res.mla_bytes_gpu
    per_layer = 32 * 128 * 128 * 4 + 3 * 3 * 32 * 128 * 2  # recurrent fp32 + conv (3 inputs of q, k, v) bf16
    assert res.kda_state_bytes == 69 * per_layer
    assert res.kda_state_bytes_gpu == 69 * per_layer / 8
    assert res.session_bytes_host == 142_000 * 24 * 576 + 69 * per_layer


def test_resident_sessions_follow_free_memory():
    cfg = PlanConfig(tp=8, context=100_000, weights_gb=800, reserve_gb=8, gpu_mem_util=0.9)
    res = plan(KIMI_K3, MI355X, cfg)
    free = 288e9 * 0.9 - 800e9 / 8 - 8e9
    assert res.free_bytes_gpu == pytest.approx(free)
    assert res.sessions_per_group == int(free // (100_000 * 24 * 576 + 69 * (32 * 128 * 128 * 4 + 9 * 32 * 128 * 2) / 8))
    more = plan(KIMI_K3, MI355X, PlanConfig(tp=8, dcp=8, context=100_000, weights_gb=800))
    assert more.sessions_per_group > 5 * res.sessions_per_group  # DCP8 frees most of the latent
    host = plan(KIMI_K3, MI355X, PlanConfig(tp=8, context=100_000, host_gb=1000, host_fraction=0.5))
    assert host.sessions_per_host_tier == int(500e9 // host.session_bytes_host)
    assert not plan(KIMI_K3, MI355X, PlanConfig(use_assumptions=False)).weights_bytes_gpu


def test_hf_configs():
    k48 = load_model("kimi-linear-48b")
    assert (k48.num_mla_layers, k48.num_kda_layers, k48.kda_heads, k48.latent_dim) == (7, 20, 32, 576)
    assert 45e9 < k48.total_params < 52e9 and 2e9 < k48.active_params < 4.5e9  # "48B-A3B"
    gqa = from_hf_config({"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                          "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}, "llama-8b")
    res = plan(gqa, load_hardware("h100"), PlanConfig(tp=1, context=8192, kv_dtype="bf16"))
    assert res.attn_bytes_per_token_gpu == 32 * 2 * 8 * 128 * 2  # 128 KiB per token
    assert 7.5e9 < gqa.total_params < 8.5e9
    with pytest.raises(ValueError, match="hidden_size"):
        from_hf_config({"num_hidden_layers": 2})


def test_config_json_on_disk(tmp_path, capsys):
    cfg = {"hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8, "kv_lora_rank": 256,
           "qk_rope_head_dim": 32, "vocab_size": 1000, "intermediate_size": 2048}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert disagg_main(["plan", "--model", str(tmp_path), "--tp", "1", "--context", "1000", "--kv-dtype", "bf16"]) == 0
    assert "1000 x 4 x 576 B" in capsys.readouterr().out.replace(",", "")


def test_draft_depth_breakeven():
    rows = depth_table({3: 3.00, 4: 3.36})
    assert rows[0].breakeven_growth == pytest.approx(0.12)
    grow = depth_table({3: 3.00, 4: 3.36}, cycle_costs([3, 4], growth=0.11))
    assert grow[1].rate > grow[0].rate  # 11% growth: the 4th draft pays
    shrink = depth_table({3: 3.00, 4: 3.36}, cycle_costs([3, 4], growth=0.13))
    assert shrink[1].rate < shrink[0].rate  # 13%: it does not
    e = committed_from_acceptance([0.8], 4)
    assert e == pytest.approx([(1 - 0.8 ** (k + 1)) / 0.2 for k in range(5)])
    assert committed_from_acceptance([1.0, 0.5, 0.5]) == pytest.approx([1, 2, 2.5, 2.75])
    times = cycle_costs([0, 1, 2], verify_ms=20, draft_ms=2, verify_ms_per_token=1)
    assert times == {0: 21, 1: 24, 2: 27}


def test_cli_draft_depth(capsys):
    assert disagg_main(["plan", "--committed", "3:3.00,4:3.36", "--cycle-growth", "0.10"]) == 0
    out = capsys.readouterr().out
    assert "12.0%" in out and "best depth: 4 drafts" in out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--tp", "8", "--dcp", "3"], "dcp dividing tp"),
        (["--model", "no-such-model"], "unknown model"),
        (["--hardware", "tpu9"], "unknown hardware"),
        (["--acceptance", "1.5"], "acceptance rates"),
        (["--committed", "3:0.5"], "committed tokens"),
    ],
)
def test_bad_input_is_a_clear_error(capsys, argv, match):
    assert disagg_main(["plan", *argv]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_roofline_profile_is_a_simulator_profile(tmp_path):
    prof = roofline_profile(KIMI_K3, MI355X, PlanConfig(tp=8, kv_dtype="fp8"))
    cm = prof.cost_model()
    assert prof.source["kind"] == "roofline" and prof.gpus_per_worker == 8
    assert cm.bytes_per_token == 24 * 576
    assert cm.decode_step_time(64, 64 * 32768) > cm.decode_step_time(1, 32768)
    assert prof.fit_report().decode_max_rel_err < 0.01  # a batch curve + a context slope is exact here
    with pytest.raises(ValueError, match="parameter counts"):
        roofline_profile(KIMI_K3, MI355X, PlanConfig(use_assumptions=False))
