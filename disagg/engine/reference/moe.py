"""Feed-forward blocks: the dense SwiGLU MLP and the sigmoid top-k MoE.

    SwiGLU(x)  = down(silu(gate(x)) * up(x))               (experts: w2(silu(w1 x) * w3 x))

Routing (``route``), per token, E experts, in >= fp32:

    s        = sigmoid(x W_g^T)                      (softmax when so configured)
    chosen   = top-k of (s + e_score_correction_bias) (optionally group-limited first)
    weight_j = s[chosen_j]                           (the bias only selects)
    weight   = weight / sum(weight)                  when moe_renormalize
    weight  *= routed_scaling_factor
    MoE(x)   = sum_j weight_j expert_{chosen_j}(x) + shared_experts(x)   (shared unscaled)

Group-limited top-k (``num_expert_group`` > 1): each group scores the sum of its
two best biased scores, the best ``topk_group`` groups stay eligible.

NOTES
1. Each token's expert outputs are added in ascending expert id, so a token's
   result does not depend on which other tokens share the batch.
2. ``moe_renormalize`` also applies when top_k == 1 (weight 1 * scaling), as
   in vLLM's fused MoE; HF's remote code skips renormalization for top-1.
3. For few tokens (decode steps) every expert runs over every token as three
   batched matmuls and unchosen experts get weight 0: on a GPU this replaces
   the loop's handful of small kernels per expert with a few large ones; on a
   CPU it is used only when the loop would average at most one token per
   expert. The sum over experts is then one reduction, so it rounds like a
   different batch would (model NOTE 4).
4. For many tokens (prefill) experts run one after another over their own
   tokens. The (token, slot) pairs are grouped by one stable sort and the group
   sizes are read back once per layer; a per-expert ``nonzero`` would make the
   host wait for the device once per expert (~32 waits a layer), which leaves
   a GPU idle whenever the stepping thread is late, e.g. when another thread
   holds the GIL. Each expert sees the same tokens in the same order as with
   ``nonzero``, so results are bit-identical to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disagg.engine.reference.layers import compute_dtype

DENSE_MAX_TOKENS_CUDA = 512  # NOTE 3


class SwiGLU(nn.Module):
    """Dense MLP with names gate_proj / up_proj / down_proj."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Expert(nn.Module):
    """A routed expert with the checkpoint names w1 (gate), w2 (down), w3 (up)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEGate(nn.Module):
    """Router parameters: ``gate.weight`` [E, hidden], ``gate.e_score_correction_bias`` [E]."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))


def route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    *,
    top_k: int,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    activation: str = "sigmoid",
    num_expert_group: int = 1,
    topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose experts per token. router_logits [N, E] -> (ids [N, k] int64, weights [N, k])."""
    logits = router_logits.to(compute_dtype(router_logits.dtype))
    if activation == "sigmoid":
        scores = logits.sigmoid()
    elif activation == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"moe_router_activation_func {activation!r} is not supported")
    choice = scores if correction_bias is None else scores + correction_bias.to(scores.dtype)
    n, e = choice.shape
    if num_expert_group > 1:
        grouped = choice.view(n, num_expert_group, e // num_expert_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(n, e)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights * routed_scaling_factor


class SparseMoE(nn.Module):
    """Routed experts plus shared experts (module name ``block_sparse_moe`` in the model)."""

    def __init__(self, config):
        super().__init__()
        c = config
        self.top_k = c.num_experts_per_token
        self.renormalize = c.moe_renormalize
        self.scaling = c.routed_scaling_factor
        self.activation = c.moe_router_activation_func
        grouped = c.use_grouped_topk
        self.num_expert_group = c.num_expert_group if grouped else 1
        self.topk_group = c.topk_group if grouped else 1
        self.gate = MoEGate(c.hidden_size, c.num_experts)
        self.experts = nn.ModuleList(
            Expert(c.hidden_size, c.moe_intermediate_size) for _ in range(c.num_experts)
        )
        n_shared = c.num_shared_experts or 0
        self.shared_experts = (
            SwiGLU(c.hidden_size, c.moe_intermediate_size * n_shared) if n_shared else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cd = compute_dtype(x.dtype)
        logits = x.to(cd) @ self.gate.weight.to(cd).T
        return route(
            logits,
            self.gate.e_score_correction_bias,
            top_k=self.top_k,
            renormalize=self.renormalize,
            routed_scaling_factor=self.scaling,
            activation=self.activation,
            num_expert_group=self.num_expert_group,
            topk_group=self.topk_group,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = self._dense(x, ids, weights) if self._use_dense(x) else self._grouped(x, ids, weights)
        out = out.to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each chosen expert over its tokens (NOTE 4): one stable sort groups the (token, slot)
        pairs by expert, and one host read of the group sizes is the only synchronisation."""
        n, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert; ascending token within each expert
        counts = torch.zeros(len(self.experts), dtype=torch.long, device=ids.device)
        counts = counts.scatter_add_(0, flat, torch.ones_like(flat)).tolist()
        tok_all, slot_all = order // k, order % k
        out = torch.zeros(n, x.shape[1], dtype=weights.dtype, device=x.device)
        start = 0
        for e, c in enumerate(counts):  # ascending expert id (NOTE 1)
            if not c:
                continue
            tok, slot = tok_all[start : start + c], slot_all[start : start + c]
            start += c
            y = self.experts[e](x[tok]).to(out.dtype)
            out.index_add_(0, tok, y * weights[tok, slot].unsqueeze(-1))  # tokens distinct: exact order
        return out

    def _use_dense(self, x: torch.Tensor) -> bool:
        """NOTE 3: every expert over every token when the per-expert loop would be launch-bound."""
        n, e = x.shape[0], len(self.experts)
        if x.is_cuda:
            return n <= DENSE_MAX_TOKENS_CUDA
        return n * self.top_k <= e  # CPU: at most one token per expert on average

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(W1 and W3 as [E*I, hidden], W2 as [E, hidden, I]); built once, weights are frozen after load."""
        w = self.experts[0].w1.weight
        key = (w.device, w.dtype, w.data_ptr())
        if getattr(self, "_stack_key", None) != key:
            self._stack = (torch.cat([m.w1.weight for m in self.experts]),
                           torch.cat([m.w3.weight for m in self.experts]),
                           torch.stack([m.w2.weight for m in self.experts]))
            self._stack_key = key
        return self._stack

    def _dense(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = self._stacked()
        n, e = x.shape[0], w2.shape[0]
        act = (F.silu(x @ w1.T) * (x @ w3.T)).view(n, e, -1).transpose(0, 1)  # [E, N, I]
        y = torch.bmm(act, w2.transpose(1, 2)).to(weights.dtype)  # [E, N, hidden]
        gate = torch.zeros(n, e, dtype=weights.dtype, device=x.device).scatter_(1, ids, weights)
        return torch.einsum("enh,ne->nh", y, gate)
