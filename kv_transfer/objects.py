"""The units of per-request state that kv_transfer stores and moves.

Layouts follow vLLM's so one codec serves both engines:

    MLA page   [block_size, latent_dim]            per MLA layer, cache dtype
    KDA conv   [conv_width - 1, 3 * heads * head_dim]   per KDA layer ("SD")
    KDA state  [heads, head_k, head_v]             per KDA layer, fp32

A resume point ``p`` is made of the MLA blocks before ``p``, the MLA rows of the
partial block ending at ``p`` (the tail, only when ``p`` is not block-aligned)
and the KDA checkpoint at ``p``:

    position   0        bs       2bs      p
               |--blk 1-|--blk 2-|--tail--|
               MLA rows of every MLA layer; KDA state after token p-1

NOTES
1. An MLA block holds all MLA layers for one block of positions and is stored
   once per TP group (TP splits heads, not the latent cache).
2. Under DCP, rank r of a DCP group of size d holds positions t with
   t % d == r; ``reshard_dcp`` moves rows between DCP sizes losslessly.
3. A KDA checkpoint holds one TP rank's head shard of every KDA layer.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class StateLayout:
    """Model geometry that decides whether stored state fits an engine."""

    model_id: str  # model identity (also part of every key)
    block_size: int  # tokens per MLA block
    num_mla_layers: int  # MLA layers in the model
    latent_dim: int  # kv_lora_rank + qk_rope_head_dim (576 for K3)
    num_kda_layers: int  # KDA layers in the model
    kda_heads: int  # KDA heads before any TP split
    head_k: int  # KDA key dim per head
    head_v: int  # KDA value dim per head
    conv_width: int  # short-conv kernel size (state keeps width - 1 inputs)
    cache_dtype: str = "float32"  # MLA latent dtype (torch dtype name)
    conv_dtype: str = "float32"  # KDA conv state dtype
    state_dtype: str = "float32"  # KDA recurrent state dtype

    def fingerprint(self) -> str:
        """Short stable id of this layout, written into every object header."""
        return _fingerprint(self)

    def mla_block_bytes(self) -> int:
        itemsize = getattr(torch, self.cache_dtype).itemsize
        return self.num_mla_layers * self.block_size * self.latent_dim * itemsize

    def kda_checkpoint_bytes(self, tp_size: int = 1) -> int:
        h = self.kda_heads // tp_size
        conv = getattr(torch, self.conv_dtype).itemsize
        rec = getattr(torch, self.state_dtype).itemsize
        per_layer = (self.conv_width - 1) * 3 * h * self.head_k * conv
        per_layer += h * self.head_k * self.head_v * rec
        return self.num_kda_layers * per_layer


@dataclass(slots=True, repr=False)
class MLABlock:
    """Latent rows of every MLA layer for one block (or a tail) of positions.

    rows: [num_mla_layers, num_rows, latent_dim]. With dcp_size == 1 the rows
    are positions start .. start + num_rows - 1; with DCP they are the positions
    t in [start, start + span) with t % dcp_size == dcp_rank.
    """

    rows: torch.Tensor  # [num_mla_layers, num_rows, latent_dim]
    start: int  # absolute position of the block's first position
    span: int  # positions covered by the block (block_size, or tail length)
    dcp_size: int = 1  # DCP group size the rows are interleaved for
    dcp_rank: int = 0  # which interleave class the rows hold

    def __post_init__(self) -> None:
        assert self.rows.dim() == 3, "MLA rows must be [layers, rows, latent]"
        assert 0 <= self.dcp_rank < self.dcp_size
        assert self.rows.shape[1] == dcp_count(self.start, self.span, self.dcp_size, self.dcp_rank), (
            "row count does not match the DCP interleave"
        )

    def __repr__(self) -> str:
        return (
            f"MLABlock(start={self.start}, span={self.span}, rows={tuple(self.rows.shape)}, "
            f"dtype={self.rows.dtype}, dcp={self.dcp_rank}/{self.dcp_size})"
        )


@dataclass(slots=True, repr=False)
class KDACheckpoint:
    """KDA state of every KDA layer after ``position`` tokens (one TP shard)."""

    conv: torch.Tensor  # [num_kda_layers, conv_width - 1, 3 * heads_local * head_k]
    recurrent: torch.Tensor  # [num_kda_layers, heads_local, head_k, head_v]
    position: int  # tokens processed when the state was taken
    tp_rank: int = 0  # head shard index
    tp_size: int = 1  # number of head shards

    def __repr__(self) -> str:
        return (
            f"KDACheckpoint(position={self.position}, conv={tuple(self.conv.shape)}, "
            f"recurrent={tuple(self.recurrent.shape)}, tp={self.tp_rank}/{self.tp_size})"
        )


@dataclass(slots=True, repr=False)
class ResumeState:
    """Everything an engine needs to continue a sequence at ``position``.

    mla_blocks[i] covers positions [(first_block + i) * bs, (first_block + i + 1) * bs);
    blocks before ``first_block`` are not carried (the receiver already has
    them or loads them separately by key).
    """

    layout: StateLayout  # geometry of the engine that produced the state
    position: int  # tokens whose state this is
    mla_blocks: list[MLABlock] = field(default_factory=list)  # full blocks
    first_block: int = 0  # index of mla_blocks[0]
    tail: MLABlock | None = None  # rows of the partial block ending at position
    kda: list[KDACheckpoint] = field(default_factory=list)  # one per TP shard
    mla_rows: torch.Tensor | None = None  # [layers, n * bs, D]: the blocks' rows as one buffer, when
    # a loader decoded them into one (``StateStore.load_state(contiguous=True)``); blocks are its views

    def __post_init__(self) -> None:
        bs = self.layout.block_size
        n_full = self.position // bs
        assert self.first_block + len(self.mla_blocks) <= n_full, "blocks past the resume point"
        assert (self.tail is None) == (self.position % bs == 0), "tail iff position is unaligned"
        for k in self.kda:
            assert k.position == self.position, "KDA checkpoint must sit at the resume point"

    @property
    def nbytes(self) -> int:
        """Bytes of state carried: the blocks' and the tail's rows, and every KDA shard."""
        rows = sum(b.rows.nbytes for b in self.mla_blocks) + (self.tail.rows.nbytes if self.tail else 0)
        return rows + sum(k.conv.nbytes + k.recurrent.nbytes for k in self.kda)

    def __repr__(self) -> str:
        return (
            f"ResumeState(position={self.position}, blocks={self.first_block}+{len(self.mla_blocks)}, "
            f"tail={self.tail is not None}, kda_shards={len(self.kda)})"
        )


@functools.lru_cache(maxsize=64)
def _fingerprint(layout: StateLayout) -> str:  # checked on every decode: computed once per layout
    blob = json.dumps(asdict(layout), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def dcp_count(start: int, span: int, dcp_size: int, dcp_rank: int) -> int:
    """How many positions in [start, start+span) ``dcp_rank`` owns (``len(dcp_positions(...))``)."""
    first = start + (dcp_rank - start) % dcp_size
    return len(range(first, start + span, dcp_size))


def dcp_positions(start: int, span: int, dcp_size: int, dcp_rank: int) -> torch.Tensor:
    """Absolute positions in [start, start+span) owned by ``dcp_rank``."""
    pos = torch.arange(start, start + span)
    return pos[pos % dcp_size == dcp_rank]
