"""Decode-context-parallel (DCP) resharding of MLA blocks.

Under DCP of size d, rank r holds the rows of positions t with t % d == r:

    positions   start ... start+span-1       (d = 4, start = 8, span = 8)
    t           8  9  10 11 12 13 14 15
    rank        0  1  2  3  0  1  2  3
    rank 1 rows [9, 13]

``merge_dcp`` puts the d shards of one block back in position order,
``split_dcp`` deals a block's rows to d ranks, and ``reshard_dcp`` goes from
one DCP size to another through the merged block. Rows are moved, never
recomputed, so any reshard is lossless.
"""

from __future__ import annotations

import torch

from kv_transfer.objects import MLABlock, dcp_positions


def merge_dcp(shards: list[MLABlock]) -> MLABlock:
    """The d shards of one block (any order) -> one block with dcp_size 1."""
    assert shards, "nothing to merge"
    d = shards[0].dcp_size
    start, span = shards[0].start, shards[0].span
    assert len(shards) == d, f"need all {d} shards, got {len(shards)}"
    assert sorted(s.dcp_rank for s in shards) == list(range(d)), "duplicate or missing DCP rank"
    ref = shards[0].rows
    rows = torch.empty((ref.shape[0], span, ref.shape[2]), dtype=ref.dtype, device=ref.device)
    for s in shards:
        assert (s.start, s.span, s.dcp_size) == (start, span, d), "shards of different blocks"
        idx = (dcp_positions(start, span, d, s.dcp_rank) - start).to(ref.device)
        rows.index_copy_(1, idx, s.rows)
    return MLABlock(rows, start, span)


def split_dcp(block: MLABlock, dcp_size: int) -> list[MLABlock]:
    """A dcp_size-1 block -> its ``dcp_size`` interleaved shards, rank order."""
    assert block.dcp_size == 1, "split a merged block"
    out = []
    for r in range(dcp_size):
        idx = (dcp_positions(block.start, block.span, dcp_size, r) - block.start).to(block.rows.device)
        out.append(MLABlock(block.rows.index_select(1, idx), block.start, block.span, dcp_size, r))
    return out


def reshard_dcp(blocks: list[MLABlock], from_size: int, to_size: int) -> list[MLABlock]:
    """Reshard the MLA blocks of a sequence from DCP ``from_size`` to ``to_size``.

    Args:
        blocks: for every block (or tail), all ``from_size`` shards, grouped by
            block in position order (block 0 ranks 0..d-1, block 1 ranks 0..d-1, ...).
        from_size: the DCP size the shards were written for.
        to_size: the DCP size wanted.

    Returns:
        For every block, its ``to_size`` shards in rank order, same grouping.
    """
    assert from_size > 0 and to_size > 0, "DCP sizes must be positive"
    assert len(blocks) % from_size == 0, "every block needs all of its shards"
    out: list[MLABlock] = []
    for i in range(0, len(blocks), from_size):
        group = blocks[i : i + from_size]
        assert all(b.dcp_size == from_size for b in group), "shard of another DCP size"
        merged = merge_dcp(group) if from_size > 1 else group[0]
        out.extend(split_dcp(merged, to_size) if to_size > 1 else [merged])
    return out
