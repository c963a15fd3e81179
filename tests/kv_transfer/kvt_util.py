"""Shared helpers for the kv_transfer tests: a tiny layout and synthetic states."""

from __future__ import annotations

import contextlib

import torch

from kv_transfer.keys import BlockHasher, KeyExtras
from kv_transfer.objects import KDACheckpoint, MLABlock, ResumeState, StateLayout

BS = 16


def small_layout(cache_dtype: str = "bfloat16", **kw) -> StateLayout:
    args = dict(model_id="tiny-k3", block_size=BS, num_mla_layers=2, latent_dim=8, num_kda_layers=2,
                kda_heads=8, head_k=4, head_v=4, conv_width=4, cache_dtype=cache_dtype)
    args.update(kw)
    return StateLayout(**args)


def hasher(layout: StateLayout, salt: str = "") -> BlockHasher:
    return BlockHasher(layout.block_size, KeyExtras(layout.model_id, cache_salt=salt))


def _rand(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return raw.view(dtype) if dtype.itemsize == 1 else raw.to(dtype)


def mla_block(layout: StateLayout, start: int, span: int, seed: int = 0) -> MLABlock:
    dtype = getattr(torch, layout.cache_dtype)
    rows = _rand((layout.num_mla_layers, span, layout.latent_dim), dtype, seed * 7919 + start)
    return MLABlock(rows, start, span)


def kda_shard(layout: StateLayout, position: int, tp_rank: int = 0, tp_size: int = 1, seed: int = 0) -> KDACheckpoint:
    h = layout.kda_heads // tp_size
    conv = _rand((layout.num_kda_layers, layout.conv_width - 1, 3 * h * layout.head_k),
                 getattr(torch, layout.conv_dtype), seed * 31 + position * 8 + tp_rank)
    rec = _rand((layout.num_kda_layers, h, layout.head_k, layout.head_v),
                getattr(torch, layout.state_dtype), seed * 37 + position * 8 + tp_rank + 1)
    return KDACheckpoint(conv, rec, position, tp_rank, tp_size)


def make_state(layout: StateLayout, position: int, tp_size: int = 1, tp_ranks=None, seed: int = 0,
               first_block: int = 0) -> ResumeState:
    """State at ``position``: every full block (from first_block), the tail, KDA shards."""
    bs = layout.block_size
    n_full = position // bs
    blocks = [mla_block(layout, i * bs, bs, seed) for i in range(first_block, n_full)]
    tail = mla_block(layout, n_full * bs, position % bs, seed + 1000 + position) if position % bs else None
    ranks = range(tp_size) if tp_ranks is None else tp_ranks
    kda = [kda_shard(layout, position, r, tp_size, seed) for r in ranks]
    return ResumeState(layout, position, blocks, first_block, tail, kda)


def tokens(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50000, (n,), generator=g).tolist()


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(a.contiguous().view(torch.uint8).numpy()) == bytes(b.contiguous().view(torch.uint8).numpy())


def states_equal(a: ResumeState, b: ResumeState) -> bool:
    if (a.position, a.first_block, len(a.mla_blocks), len(a.kda)) != (b.position, b.first_block, len(b.mla_blocks), len(b.kda)):
        return False
    if (a.tail is None) != (b.tail is None):
        return False
    pairs = [(x.rows, y.rows) for x, y in zip(a.mla_blocks, b.mla_blocks, strict=True)]
    if a.tail is not None:
        pairs.append((a.tail.rows, b.tail.rows))
    for x, y in zip(sorted(a.kda, key=lambda k: k.tp_rank), sorted(b.kda, key=lambda k: k.tp_rank), strict=True):
        pairs += [(x.conv, y.conv), (x.recurrent, y.recurrent)]
    return all(bit_equal(x, y) for x, y in pairs)


@contextlib.contextmanager
def host_pair(kind: str, capacity: int, slab_bytes: int):
    """(tier to use, its owner): a host tier used directly ("in-process") or through a
    HostTierClient of its server ("client", as the node store process serves it)."""
    from kv_transfer.tiers.host import HostTier
    from kv_transfer.tiers.host_ipc import HostTierClient, HostTierServer

    owner = HostTier(capacity, slab_bytes=slab_bytes)
    try:
        if kind == "in-process":
            yield owner, owner
            return
        server = HostTierServer(owner)
        client = HostTierClient(server.socket_path)
        try:
            yield client, owner
        finally:
            client.close()
            server.close()
    finally:
        owner.close()
