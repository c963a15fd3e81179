"""The vLLM presets build a Serve app whose engine configs vLLM accepts (engine not started).

No accelerator here, so vLLM's ``create_engine_config`` (which asks the GPU
platform for its device) cannot run; the config objects it would make are
built from the same ``AsyncEngineArgs`` with vLLM's own classes and a CPU
``DeviceConfig``. The K3 model is replaced by a K3-shaped local config (8 heads,
so TP8 divides them); the weights are never loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import k3_harness as H
import pytest

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "deployments" / "configs").glob("vllm-*.yaml"))


@pytest.fixture(scope="module")
def k3_like(tmp_path_factory) -> Path:
    cfg = json.loads((H.TINY / "config.json").read_text())
    cfg.update(num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=262144)
    cfg["linear_attn_config"] = dict(cfg["linear_attn_config"], num_heads=8, head_dim=16)
    d = tmp_path_factory.mktemp("k3-like")
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _roles(app) -> list[str]:
    return ["prefill", "decode"] if app.deployment.mode == "disaggregated" else ["decode"]


def _vllm_config(args):
    """The VllmConfig ``create_engine_config`` would build (minus platform-specific steps)."""
    from vllm.config import CacheConfig, DeviceConfig, ParallelConfig, SchedulerConfig, VllmConfig

    mc = args.create_model_config()
    return VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=args.block_size, cache_dtype=args.kv_cache_dtype,
                                 enable_prefix_caching=args.enable_prefix_caching,
                                 gpu_memory_utilization=args.gpu_memory_utilization),
        parallel_config=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                       decode_context_parallel_size=args.decode_context_parallel_size),
        scheduler_config=SchedulerConfig(max_model_len=mc.max_model_len, is_encoder_decoder=False,
                                         max_num_batched_tokens=args.max_num_batched_tokens,
                                         max_num_seqs=args.max_num_seqs, enable_chunked_prefill=True),
        kv_transfer_config=args.kv_transfer_config, device_config=DeviceConfig("cpu"))


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_preset_builds_an_app_and_engine_configs_vllm_accepts(path, k3_like):
    from deployments.app import build_app
    from disagg.config import load_config
    from disagg.engine.vllm.engine import VLLMEngine
    from disagg.engine.vllm.options import options
    from kv_transfer.vllm_connector import K3StateConnector

    app = load_config(path)
    assert app.engine.backend == "vllm"
    build_app(app)  # the Serve application graph (deployments bound, nothing started)
    opts = options(app)
    assert set(opts.env) <= {"VLLM_ROCM_USE_AITER"}
    if "mi355x" in path.name:
        assert opts.env == {"VLLM_ROCM_USE_AITER": "1"}
    local = app.model_copy(deep=True)
    local.engine.vllm = dict(app.engine.vllm, model=str(k3_like))
    for role in _roles(app):
        engine = VLLMEngine(local, role, host_socket=None, start=False, engine_id=f"{role}-0")
        args = engine.engine_args  # vLLM's AsyncEngineArgs: every field name and type checked
        ktc = args.kv_transfer_config
        assert (ktc.kv_connector, ktc.kv_connector_module_path) == ("K3StateConnector", "kv_transfer.vllm_connector")
        assert ktc.kv_role == "kv_both"  # both roles resume from stored prefixes and save their state
        assert ktc.kv_load_failure_policy == "recompute" and ktc.is_kv_producer and ktc.is_kv_consumer
        assert args.kv_cache_dtype == "fp8" and args.speculative_config["num_speculative_tokens"] >= 2
        assert args.block_size == app.engine.block_size and args.enable_prefix_caching
        vc = _vllm_config(args)
        assert vc.parallel_config.tensor_parallel_size == args.tensor_parallel_size
        assert vc.cache_config.cache_dtype == "fp8"
        # the connector accepts the geometry vLLM plans for this parallel layout
        vc.kv_transfer_config.kv_connector_extra_config["local_tier"] = H.make_tier()[0]
        kcc = _k3_cache_plan(vc, args)
        conn = K3StateConnector(vc, _role("SCHEDULER"), kcc)
        lay = conn.geometry.layout
        assert (lay.model_id, lay.block_size) == ("kimi-k3|bfloat16", app.engine.block_size)
        assert conn.geometry.dcp_size == args.decode_context_parallel_size
        assert lay.kda_heads == 8 and lay.cache_dtype == "float8_e4m3fn"
        conn.shutdown()


def _role(name: str):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    return KVConnectorRole[name]


def _k3_cache_plan(vc, args):
    """vLLM's grouping of K3-shaped layers for this TP / DCP (FP8 latent, 576 wide)."""
    import torch
    from vllm.v1.attention.backends.utils import record_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

    tp, dcp, block = args.tensor_parallel_size, args.decode_context_parallel_size, args.block_size
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False  # the CPU DeviceConfig turned HMA off
    record_kv_cache_layout(vc.cache_config, "LBNHC")
    mla = MLAAttentionSpec(block_size=block // dcp, num_kv_heads=1, head_size=576, dtype=torch.float8_e4m3fn,
                           cache_dtype_str="fp8")
    h = 8 // tp
    kda = MambaSpec(block_size=block, shapes=((3, 3 * h * 16), (h, 16, 16)), dtypes=(torch.bfloat16, torch.float32),
                    page_size_padded=mla.page_size_bytes, mamba_cache_mode="align")
    specs = {"model.layers.3.self_attn.attn": mla} | {f"model.layers.{i}.self_attn": kda for i in range(3)}
    return get_kv_cache_config_from_groups(vc, get_kv_cache_groups(vc, specs), 16 * mla.page_size_bytes)
