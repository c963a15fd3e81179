"""MLA (NoPE): absorbed decode equals the expanded form; cache rows; causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disagg.engine.reference.cache_view import DenseSequenceCache
from disagg.engine.reference.layers import TokenSpan
from disagg.engine.reference.mla import mla_absorbed, mla_expanded

H, R, DN, DR, DV = 4, 32, 16, 8, 12


def setup(total: int, n: int, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, H, DN + DR, generator=g, dtype=dtype)
    latent = torch.randn(total, R + DR, generator=g, dtype=dtype)
    w = torch.randn(H * (DN + DV), R, generator=g, dtype=dtype) / R**0.5
    return q, latent, w, dict(kv_lora_rank=R, nope=DN, v_dim=DV, scale=(DN + DR) ** -0.5)


@pytest.mark.parametrize("total, n", [(1, 1), (50, 1), (50, 7), (9, 9)])
def test_absorbed_equals_expanded(total, n):
    q, latent, w, kw = setup(total, n)
    torch.testing.assert_close(
        mla_absorbed(q, latent, w, **kw), mla_expanded(q, latent, w, **kw), rtol=1e-10, atol=1e-12
    )
    q, latent, w = q.float(), latent.float(), w.float()
    torch.testing.assert_close(
        mla_absorbed(q, latent, w, **kw), mla_expanded(q, latent, w, **kw), rtol=1e-5, atol=1e-5
    )


def test_expanded_matches_sdpa_per_head():
    q, latent, w, kw = setup(20, 20)
    kv = (latent[:, :R] @ w.T).view(20, H, DN + DV)
    k = torch.cat([kv[..., :DN], latent[:, None, R:].expand(20, H, DR)], dim=-1)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        kv[..., DN:].transpose(0, 1),
        is_causal=True,
        scale=kw["scale"],
    ).transpose(0, 1)
    torch.testing.assert_close(mla_expanded(q, latent, w, **kw), ref)


def test_new_queries_only_see_history_and_earlier_new_tokens():
    q, latent, w, kw = setup(30, 5)
    out = mla_expanded(q, latent, w, **kw)
    for i in range(5):  # query i sits at position 25 + i
        torch.testing.assert_close(
            out[i : i + 1], mla_expanded(q[i : i + 1], latent[: 26 + i], w, **kw)
        )


def test_layer_cache_rows_and_decode_modes(tiny_fp64):
    cfg = tiny_fp64.config
    layer = tiny_fp64.model.layers[cfg.mla_layer_ids[0]].self_attn
    x = torch.randn(
        12, cfg.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    cache = DenseSequenceCache.empty(cfg, torch.float64)
    full = layer(x, [TokenSpan(0, 12, 0, cache)], 0)
    rows = cache.mla_history(0)
    assert rows.shape == (12, cfg.latent_dim)
    ckv = layer.kv_a_proj_with_mqa(x)
    torch.testing.assert_close(
        rows[:, : cfg.kv_lora_rank], layer.kv_a_layernorm(ckv[:, : cfg.kv_lora_rank])
    )
    torch.testing.assert_close(rows[:, cfg.kv_lora_rank :], ckv[:, cfg.kv_lora_rank :])
    for absorbed in (True, False, None):
        step = DenseSequenceCache.empty(cfg, torch.float64)
        layer(x[:11], [TokenSpan(0, 11, 0, step)], 0, absorbed=absorbed)
        last = layer(x[11:], [TokenSpan(0, 1, 11, step)], 0, absorbed=absorbed)
        torch.testing.assert_close(last, full[11:], rtol=1e-10, atol=1e-12)


def test_layer_rejects_a_cache_out_of_step(tiny_fp32):
    cfg = tiny_fp32.config
    layer = tiny_fp32.model.layers[cfg.mla_layer_ids[0]].self_attn
    cache = DenseSequenceCache.empty(cfg, torch.float32)
    with pytest.raises(AssertionError, match="start_pos"):
        layer(torch.randn(2, cfg.hidden_size), [TokenSpan(0, 2, 3, cache)], 0)
