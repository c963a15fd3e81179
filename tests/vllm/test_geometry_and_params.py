"""Bad input -> clear errors: cache geometries, kv_transfer_params handles, connector settings."""

from __future__ import annotations

import k3_harness as H
import pytest
import torch

pytestmark = pytest.mark.vllm


def _groups(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"model.layers.{i}.x"], s) for i, s in enumerate(specs)])


def _mla(block=16, head=576, dtype=torch.bfloat16):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=head, dtype=dtype, cache_dtype_str="auto")


def _kda(block=16, heads=2, k=16, conv_channels=None):
    from vllm.v1.kv_cache_interface import MambaSpec

    c = conv_channels if conv_channels is not None else 3 * heads * k
    return MambaSpec(block_size=block, shapes=((3, c), (heads, k, k)), dtypes=(torch.bfloat16, torch.float32),
                     mamba_cache_mode="align")


def test_geometry_of_a_hybrid_layout():
    from kv_transfer.vllm.geometry import CacheGeometry

    geo = CacheGeometry.from_vllm(_groups(_kda(), _mla(block=8), _kda()), "m", tp_size=4, dcp_size=2)
    lay = geo.layout
    assert (lay.block_size, lay.num_mla_layers, lay.latent_dim, lay.num_kda_layers) == (16, 1, 576, 2)
    assert (lay.kda_heads, lay.head_k, lay.conv_width) == (8, 16, 4)  # 2 heads per rank x TP4
    assert geo.group_ids("kda") == [0, 2] and geo.mla_rows == 8 and geo.num_kv_groups == 3
    assert [geo.kda_block_index(p) for p in (1, 16, 17, 40)] == [0, 0, 1, 2]


@pytest.mark.parametrize("specs, message", [
    (lambda: (_kda(),), "no MLA group"),
    (lambda: (_mla(), _mla(head=512)), "different page shapes"),
    (lambda: (_mla(), _kda(heads=2), _kda(heads=4)), "different state shapes"),
    (lambda: (_mla(block=16), _kda(block=24)), "does not divide"),
    (lambda: (_mla(), _kda(conv_channels=100)), "conv state channels"),
])
def test_unsupported_geometries_are_refused(specs, message):
    from kv_transfer.vllm.geometry import CacheGeometry

    with pytest.raises(ValueError, match=message):
        CacheGeometry.from_vllm(_groups(*specs()), "m")


def test_handles_round_trip_and_malformed_ones_are_refused():
    from kv_transfer.vllm.jobs import HANDLE_KEY, StateHandle

    h = StateHandle(700, 4, 2, "m|bfloat16", 256, "10.0.0.2:7070", "prefill-0", 1.5)
    assert StateHandle.from_params(h.to_params()) == h
    assert StateHandle.from_params({"do_remote_decode": True}) is None
    assert StateHandle.from_params(None) is None
    with pytest.raises(ValueError, match=HANDLE_KEY):
        StateHandle.from_params({"do_remote_prefill": True, HANDLE_KEY: {"position": "x"}})


@pytest.mark.parametrize("change, message", [
    ({"pipeline_parallel_size": 2}, "pipeline parallelism"),
    ({"decode_context_parallel_size": 2, "cp_kv_cache_interleave_size": 4}, "interleave"),
])
def test_connector_refuses_parallel_layouts_it_cannot_serve(change, message):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kv_transfer.vllm_connector import K3StateConnector

    vc = H.vllm_config(tier=H.make_tier()[0])
    kcc, _, _ = H.kv_cache_config(vc)
    for k, v in change.items():
        setattr(vc.parallel_config, k, v)
    with pytest.raises(ValueError, match=message):
        K3StateConnector(vc, KVConnectorRole.SCHEDULER, kcc)


def test_connector_needs_a_tier():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kv_transfer.vllm_connector import K3StateConnector

    vc = H.vllm_config(tier="never-registered")
    kcc, _, _ = H.kv_cache_config(vc)
    with pytest.raises(ValueError, match="not registered"):
        K3StateConnector(vc, KVConnectorRole.SCHEDULER, kcc)


def test_engine_options_are_validated():
    from disagg.config import load_config
    from disagg.engine.vllm.options import engine_kwargs

    app = load_config({"engine": {"backend": "vllm", "vllm": {"engine_args": {"block_size": 64}}}})
    with pytest.raises(ValueError, match="block_size"):
        engine_kwargs(app, "decode", None, "e")
    app = load_config({"engine": {"backend": "vllm", "vllm": {"unknown": 1}}})
    with pytest.raises(ValueError, match="unknown"):
        engine_kwargs(app, "decode", None, "e")
    app = load_config({"engine": {"backend": "vllm"}})
    with pytest.raises(ValueError, match="role"):
        engine_kwargs(app, "router", None, "e")
