"""Small building blocks shared by the reference model's layers.

    RMSNorm(x) = w * x / sqrt(mean(x^2) + eps)    (computed in >= fp32, cast back)
    l2norm(x)  = x / sqrt(sum(x^2) + eps)          (over the last dim, eps 1e-6)

``TokenSpan`` tells a sequence-mixing layer which rows of the batch's
concatenated token matrix belong to which sequence:

    rows     0 ......... n0-1 | n0 ........ n0+n1-1 | ...
             sequence 0 (new) | sequence 1 (new)     |
    span_i = TokenSpan(offset, num_tokens, start_pos, cache)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from disagg.engine.reference.cache_view import SequenceCache


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype reductions run in: fp32 for half types, else the dtype itself."""
    return torch.promote_types(dtype, torch.float32)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """KDA recurrent-state dtype for a model dtype: fp64 for fp64 models, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale, checkpoint name ``<prefix>.weight``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(compute_dtype(x.dtype))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


@dataclass(slots=True)
class TokenSpan:
    """One sequence's rows in the step's concatenated token matrix."""

    offset: int  # first row of this sequence in the concatenated batch
    num_tokens: int  # new tokens of this sequence in the step
    start_pos: int  # tokens already cached (absolute position of row ``offset``)
    cache: SequenceCache  # where this sequence's MLA rows / KDA state live

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.num_tokens)
