"""Token sampling: greedy, temperature, top-p, per-request seeds.

Seeded sampling draws token i of a request from a generator seeded with
(seed, i), so the same request samples the same tokens whichever engine
(prefill or decode replica) samples which position.
"""

from __future__ import annotations

import torch

from disagg.engine.protocol import SamplingParams, TokenLogprob


def token_logprob(logits: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    """``token``'s log probability under ``logits`` [vocab] and the ``num_top`` most likely tokens'."""
    logp = torch.log_softmax(logits.float(), dim=-1).clamp(min=-9999.0)  # JSON has no -inf (vLLM's floor)
    top = torch.topk(logp, min(num_top, logp.shape[-1])) if num_top else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else []
    return TokenLogprob(float(logp[token].item()), pairs)


def sample(logits: torch.Tensor, params: SamplingParams, output_index: int) -> int:
    """Pick one token from ``logits`` [vocab] (any float dtype)."""
    logits = logits.float()
    if params.temperature < 1e-5:  # greedy; a tinier temperature would overflow logits / temperature
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        keep = cum - sorted_p < params.top_p
        keep[0] = True  # always keep the top token (a top_p below the dtype's resolution keeps nothing else)
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        probs = probs / probs.sum()
    gen = None
    if params.seed is not None:
        gen = torch.Generator(device="cpu")
        gen.manual_seed((params.seed * 1_000_003 + output_index) % (2**63))
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
