"""MoE routing per the spec, and the MoE block against a per-token loop."""

from __future__ import annotations

import copy

import pytest
import torch

from disagg.engine.reference.moe import SparseMoE, route


def test_bias_changes_selection_but_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    s = logits.sigmoid()[0]
    ids, w = route(logits, torch.zeros(4), top_k=2, renormalize=False)
    assert ids[0].tolist() == [0, 1]
    torch.testing.assert_close(w[0], s[[0, 1]])
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])  # lifts expert 3 over expert 1
    ids, w = route(logits, bias, top_k=2, renormalize=False)
    assert sorted(ids[0].tolist()) == [0, 3]
    got = dict(zip(ids[0].tolist(), w[0].tolist(), strict=True))
    assert got == pytest.approx({0: s[0].item(), 3: s[3].item()})  # weights ignore the bias


def test_renormalization_and_scaling():
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    bias = 0.1 * torch.randn(8, generator=torch.Generator().manual_seed(1))
    ids, raw = route(logits, bias, top_k=3, renormalize=False, routed_scaling_factor=1.0)
    _, norm = route(logits, bias, top_k=3, renormalize=True, routed_scaling_factor=2.446)
    torch.testing.assert_close(norm.sum(-1), torch.full((6,), 2.446))
    torch.testing.assert_close(norm, raw / raw.sum(-1, keepdim=True) * 2.446)
    torch.testing.assert_close(raw, logits.sigmoid().gather(1, ids))
    assert raw.dtype == torch.float32 and ids.dtype == torch.int64


def test_routing_runs_in_fp32_for_half_inputs():
    logits = torch.randn(4, 8).bfloat16()
    _, w = route(logits, torch.zeros(8), top_k=2)
    assert w.dtype == torch.float32


def test_group_limited_topk_picks_from_the_best_group():
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.3, 3.0, -3.0, -3.0, -3.0]])
    # group 0 = experts 0-3 (best two sum higher), group 1 = experts 4-7 (one strong expert)
    ids, _ = route(logits, None, top_k=2, num_expert_group=2, topk_group=1)
    assert sorted(ids[0].tolist()) == [2, 3]
    ids, _ = route(logits, None, top_k=2, num_expert_group=1, topk_group=1)
    assert sorted(ids[0].tolist()) == [3, 4]


def test_moe_block_equals_per_token_sum(tiny_fp64):
    cfg = tiny_fp64.config
    moe = tiny_fp64.model.layers[1].block_sparse_moe
    assert isinstance(moe, SparseMoE) and len(moe.experts) == cfg.num_experts
    x = torch.randn(
        9, cfg.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    logits = x @ moe.gate.weight.T
    ids, w = route(
        logits,
        moe.gate.e_score_correction_bias,
        top_k=cfg.num_experts_per_token,
        renormalize=cfg.moe_renormalize,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )
    expect = torch.stack(
        [
            sum(w[t, j] * moe.experts[int(ids[t, j])](x[t : t + 1])[0] for j in range(ids.shape[1]))
            + moe.shared_experts(x[t : t + 1])[0]
            for t in range(9)
        ]
    )
    torch.testing.assert_close(moe(x), expect, rtol=1e-12, atol=1e-12)


def _per_expert_nonzero(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The former loop: one ``nonzero`` per chosen expert."""
    ids, weights = moe.route(x)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=weights.dtype)
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        out.index_add_(0, tok, moe.experts[e](x[tok]).to(out.dtype) * weights[tok, slot].unsqueeze(-1))
    out = out.to(x.dtype)
    return out + moe.shared_experts(x) if moe.shared_experts is not None else out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 300])
def test_grouped_loop_is_bit_identical_to_per_expert_nonzero(tiny_fp64, dtype, n):
    """NOTE 4: one sort and one read of the group sizes, same tokens per expert in the same order."""
    moe = copy.deepcopy(tiny_fp64.model.layers[1].block_sparse_moe).to(dtype)  # the fixture stays fp64
    x = torch.randn(n, tiny_fp64.config.hidden_size, generator=torch.Generator().manual_seed(n)).to(dtype)
    ids, w = moe.route(x)
    got = moe._grouped(x, ids, w).to(dtype) + moe.shared_experts(x)
    assert torch.equal(got, _per_expert_nonzero(moe, x))
    if n * moe.top_k > len(moe.experts):  # the loop path of forward itself
        assert torch.equal(moe(x), _per_expert_nonzero(moe, x))
