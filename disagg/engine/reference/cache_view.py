"""What the model needs from whoever owns a sequence's state.

The model is stateless: for every sequence in a step it reads and writes state
through a ``SequenceCache``. The engine implements it over its paged MLA cache
and KDA slot pool; ``DenseSequenceCache`` is the plain version for tests and
one-off generation.

    positions   0 ........ start_pos-1 | start_pos ... start_pos+n-1
                 history (in the cache) |  new tokens of this step
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


class SequenceCache(Protocol):
    def mla_history(self, mla_idx: int) -> torch.Tensor:
        """Latent rows [start_pos, latent_dim] of MLA layer ``mla_idx`` (0-based among MLA layers)."""

    def mla_append(self, mla_idx: int, rows: torch.Tensor) -> None:
        """Store latent rows [n, latent_dim] for the step's new tokens."""

    def kda_state(self, kda_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [conv_width-1, 3*H*K], recurrent [H, K, V]) before the step's tokens."""

    def kda_update(self, kda_idx: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Replace the KDA state with the state after the step's tokens."""


@dataclass(slots=True, repr=False)
class SeqInput:
    """One sequence's share of a forward step."""

    input_ids: torch.Tensor  # [n] new token ids
    start_pos: int  # tokens already in the cache before this step
    cache: SequenceCache  # state reader/writer for this sequence
    all_logits: bool = False  # return logits for every new token, else only the last


@dataclass(slots=True)
class DenseSequenceCache:
    """A growing, unpaged cache for one sequence (tests, one-off generation)."""

    mla: list[torch.Tensor] = field(default_factory=list)  # per MLA layer [T, latent]
    kda_conv: list[torch.Tensor] = field(default_factory=list)  # per KDA layer
    kda_rec: list[torch.Tensor] = field(default_factory=list)  # per KDA layer

    @classmethod
    def empty(cls, config, dtype: torch.dtype = torch.float32, device="cpu") -> DenseSequenceCache:
        """Zero state for a fresh sequence under a ``K3Config``."""
        latent = config.kv_lora_rank + config.qk_rope_head_dim
        la = config.linear_attn_config
        h, d, w = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
        return cls(
            mla=[torch.zeros(0, latent, dtype=dtype, device=device) for _ in config.mla_layer_ids],
            kda_conv=[torch.zeros(w - 1, 3 * h * d, dtype=dtype, device=device) for _ in config.kda_layer_ids],
            kda_rec=[
                torch.zeros(h, d, d, dtype=torch.float32 if dtype != torch.float64 else dtype, device=device)
                for _ in config.kda_layer_ids
            ],
        )

    @property
    def num_tokens(self) -> int:
        return self.mla[0].shape[0] if self.mla else 0

    def mla_history(self, mla_idx: int) -> torch.Tensor:
        return self.mla[mla_idx]

    def mla_append(self, mla_idx: int, rows: torch.Tensor) -> None:
        self.mla[mla_idx] = torch.cat([self.mla[mla_idx], rows.to(self.mla[mla_idx].dtype)], dim=0)

    def kda_state(self, kda_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kda_conv[kda_idx], self.kda_rec[kda_idx]

    def kda_update(self, kda_idx: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.kda_conv[kda_idx] = conv
        self.kda_rec[kda_idx] = recurrent

    def clone(self) -> DenseSequenceCache:
        return DenseSequenceCache(
            [t.clone() for t in self.mla], [t.clone() for t in self.kda_conv], [t.clone() for t in self.kda_rec]
        )
