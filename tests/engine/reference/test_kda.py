"""KDA: chunkwise form vs the token-by-token oracle, position alignment, short conv, the layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disagg.engine.reference.cache_view import DenseSequenceCache
from disagg.engine.reference.kda import (
    causal_conv,
    fla_available,
    kda_chunked,
    kda_fla,
    kda_mix,
    kda_recurrent,
)
from disagg.engine.reference.layers import TokenSpan

H, K, V = 3, 16, 16


def inputs(t: int, seed: int = 0, zero_state: bool = False, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(t, H, K, generator=g, dtype=torch.float64), dim=-1) * K**-0.5
    k = F.normalize(torch.randn(t, H, K, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(t, H, V, generator=g, dtype=torch.float64)
    logdecay = -0.3 * torch.rand(t, H, K, generator=g, dtype=torch.float64)  # alpha in (0.74, 1]
    beta = torch.rand(t, H, generator=g, dtype=torch.float64)
    state = (
        torch.zeros(H, K, V, dtype=torch.float64)
        if zero_state
        else torch.randn(H, K, V, generator=g, dtype=torch.float64)
    )
    return [x.to(dtype) for x in (q, k, v, logdecay, beta, state)]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("t", [1, 37, 64, 100, 128, 200])
@pytest.mark.parametrize("zero_state", [True, False])
def test_chunked_matches_recurrence(t, zero_state):
    args = inputs(t, seed=t, zero_state=zero_state)
    o_ref, s_ref = kda_recurrent(*args)
    o, s = kda_chunked(*args)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-12)
    o32, s32 = kda_chunked(*[x.float() for x in args])
    assert o32.dtype == torch.float32
    assert rel(o32, o_ref) < 1e-5 and rel(s32, s_ref) < 1e-5


def test_recurrence_matches_the_delta_rule_written_out():
    q, k, v, g, beta, s0 = inputs(5, seed=3)
    o, s = kda_recurrent(q, k, v, g, beta, s0)
    S = s0.clone()
    for t in range(5):
        for h in range(H):
            kt = k[t, h].unsqueeze(1)  # [K, 1]
            S[h] = (
                (torch.eye(K, dtype=S.dtype) - beta[t, h] * kt @ kt.T)
                @ torch.diag(g[t, h].exp())
                @ S[h]
            )
            S[h] = S[h] + beta[t, h] * kt @ v[t, h].unsqueeze(0)
            torch.testing.assert_close(o[t, h], S[h].T @ q[t, h])
    torch.testing.assert_close(s, S)


@pytest.mark.parametrize("start_pos", [0, 5, 63, 64, 100])
def test_mix_at_any_start_matches_recurrence(start_pos):
    args = inputs(150, seed=start_pos)
    o_ref, s_ref = kda_recurrent(*args)
    o, s = kda_mix(*args, start_pos=start_pos)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-12)


def test_split_at_chunk_boundaries_repeats_the_same_arithmetic():
    args = inputs(300, seed=7, dtype=torch.float32)
    o_full, s_full = kda_mix(*args, start_pos=0)
    outs, state = [], args[-1]
    for a, b in [(0, 64), (64, 192), (192, 300)]:
        o, state = kda_mix(*[x[a:b] for x in args[:-1]], state, start_pos=a)
        outs.append(o)
    assert torch.equal(torch.cat(outs), o_full) and torch.equal(state, s_full)


def test_causal_conv_matches_conv1d_and_carries_state():
    g = torch.Generator().manual_seed(0)
    x, w = (
        torch.randn(20, 6, generator=g, dtype=torch.float64),
        torch.randn(6, 4, generator=g, dtype=torch.float64),
    )
    ref = F.silu(F.conv1d(F.pad(x.T.unsqueeze(0), (3, 0)), w.unsqueeze(1), groups=6)[0].T)
    y, state = causal_conv(x, torch.zeros(3, 6, dtype=torch.float64), w)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(state, x[-3:])
    y1, st = causal_conv(x[:7], torch.zeros(3, 6, dtype=torch.float64), w)
    y2, st = causal_conv(x[7:8], st, w)
    y3, st = causal_conv(x[8:], st, w)
    assert torch.equal(torch.cat([y1, y2, y3]), y) and torch.equal(st, state)


def test_layer_state_layout_and_split_prefill(tiny_fp64):
    cfg = tiny_fp64.config
    layer = tiny_fp64.model.layers[0].self_attn
    x = torch.randn(
        130, cfg.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    full_cache = DenseSequenceCache.empty(cfg, torch.float64)
    full = layer(x, [TokenSpan(0, 130, 0, full_cache)], 0)
    conv, rec = full_cache.kda_state(0)
    hk = cfg.kda_num_heads * cfg.kda_head_dim
    assert conv.shape == (cfg.conv_width - 1, 3 * hk) and rec.shape == (
        cfg.kda_num_heads,
        cfg.kda_head_dim,
        cfg.kda_head_dim,
    )
    assert rec.dtype == torch.float64
    # the conv state is the last 3 raw projections, q | k | v (vLLM "SD" layout)
    raw = torch.cat([layer.q_proj(x[-3:]), layer.k_proj(x[-3:]), layer.v_proj(x[-3:])], dim=-1)
    torch.testing.assert_close(conv, raw)
    cache = DenseSequenceCache.empty(cfg, torch.float64)
    parts = [
        layer(x[a:b], [TokenSpan(0, b - a, a, cache)], 0) for a, b in [(0, 64), (64, 65), (65, 130)]
    ]
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(cache.kda_state(0)[1], rec, rtol=1e-10, atol=1e-12)


def test_layer_state_is_fp32_for_fp32_models(tiny_fp32):
    cfg = tiny_fp32.config
    layer = tiny_fp32.model.layers[0].self_attn
    cache = DenseSequenceCache.empty(cfg, torch.float32)
    layer(torch.randn(10, cfg.hidden_size), [TokenSpan(0, 10, 0, cache)], 0)
    assert (
        cache.kda_state(0)[1].dtype == torch.float32
        and cache.kda_state(0)[0].dtype == torch.float32
    )


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and fla_available(torch.zeros(1, device="cuda"))),
    reason="needs CUDA and fla-core",
)
def test_fla_kernels_match_chunked_reference():
    args = [x.float().cuda() for x in inputs(300, seed=11)]
    o_ref, s_ref = kda_chunked(*args)
    o, s = kda_fla(*args)
    assert rel(o, o_ref) < 1e-2 and rel(s, s_ref) < 1e-2
    o1, s1 = kda_fla(*[x[:1] for x in args[:-1]], args[-1], chunk_mode=False)
    o1_ref, s1_ref = kda_recurrent(*[x[:1] for x in args[:-1]], args[-1])
    assert rel(o1, o1_ref) < 1e-2 and rel(s1, s1_ref) < 1e-2
