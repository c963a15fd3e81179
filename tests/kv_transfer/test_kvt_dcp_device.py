from __future__ import annotations

import itertools
import threading

import pytest
import torch
from kvt_util import bit_equal, mla_block, small_layout

from kv_transfer.dcp import merge_dcp, reshard_dcp, split_dcp
from kv_transfer.device import gather_blocks, gather_slots, scatter_blocks, scatter_slots
from kv_transfer.events import EventLog, StoreEvent
from kv_transfer.objects import dcp_positions

LAYOUT = small_layout(cache_dtype="float32")
SIZES = [1, 2, 4, 8]


@pytest.mark.parametrize("a,b", list(itertools.permutations(SIZES, 2)))
def test_dcp_reshard_round_trips_losslessly(a: int, b: int) -> None:
    blocks = [mla_block(LAYOUT, 0, 16, seed=1), mla_block(LAYOUT, 16, 16, seed=1), mla_block(LAYOUT, 32, 5, seed=1)]
    shards_a = [s for blk in blocks for s in (split_dcp(blk, a) if a > 1 else [blk])]
    shards_b = reshard_dcp(shards_a, a, b)
    assert len(shards_b) == len(blocks) * b
    for s in shards_b:
        assert s.dcp_size == b
        assert s.rows.shape[1] == dcp_positions(s.start, s.span, b, s.dcp_rank).numel()
    back = reshard_dcp(shards_b, b, a)
    assert all(bit_equal(x.rows, y.rows) for x, y in zip(back, shards_a, strict=True))
    merged = reshard_dcp(shards_b, b, 1)
    assert all(bit_equal(x.rows, y.rows) for x, y in zip(merged, blocks, strict=True))


def test_dcp_interleave_is_t_mod_d() -> None:
    blk = mla_block(LAYOUT, 8, 8)
    shard = split_dcp(blk, 4)[1]  # positions 9 and 13
    assert bit_equal(shard.rows, blk.rows[:, [1, 5]])
    assert bit_equal(merge_dcp(split_dcp(blk, 4)).rows, blk.rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("stacked", [False, True])
def test_gather_scatter_blocks_round_trip_bit_exact(dtype: torch.dtype, stacked: bool) -> None:
    layers, num_blocks, bs, dim = 3, 10, 4, 6
    src = torch.randn(layers, num_blocks, bs, dim).to(dtype)
    caches = src if stacked else list(src.clone().unbind(0))
    ids = [7, 2, 9, 0]
    staging = torch.empty(layers, len(ids) * bs, dim, dtype=dtype)
    out, handle = gather_blocks(caches, ids, out=staging)
    handle.wait()
    assert out is staging and handle.done()
    for li in range(layers):
        assert bit_equal(out[li].view(len(ids), bs, dim), src[li, ids])
    dst = torch.zeros(layers, num_blocks, bs, dim).to(dtype)
    scatter_blocks(out, dst if stacked else list(dst.unbind(0)), torch.tensor([1, 3, 5, 8])).wait()
    assert bit_equal(dst[:, [1, 3, 5, 8]], src[:, ids])
    assert not dst[:, [0, 2, 4, 6, 7, 9]].view(torch.uint8).any()


def test_gather_scatter_kda_slot_pools() -> None:
    conv = [torch.randn(6, 3, 24) for _ in range(2)]  # [slots, w - 1, C] per layer
    rec = [torch.randn(6, 2, 4, 4) for _ in range(2)]  # [slots, H, K, V] per layer
    for pools in (conv, rec):
        out, h = gather_slots(pools, [4, 1])
        h.wait()
        assert out.shape[:2] == (2, 2) and bit_equal(out[1, 0], pools[1][4])
        dst = [torch.zeros_like(p) for p in pools]
        scatter_slots(out, dst, [0, 5]).wait()
        assert all(bit_equal(d[[0, 5]], p[[4, 1]]) for d, p in zip(dst, pools, strict=True))


def test_event_log_is_bounded_thread_safe_and_drains() -> None:
    log = EventLog(max_events=1000)

    def emit(w: int) -> None:
        for i in range(500):
            log.emit(StoreEvent("stored", f"mla:{i}", "mla", "host", f"w{w}", nbytes=i))

    threads = [threading.Thread(target=emit, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert log.num_emitted == 2000 and log.num_dropped == 1000 and len(log) == 1000
    first = log.take(10)
    assert len(first) == 10 and len(log.take()) == 990 and log.take() == []
    assert "stored" in repr(first[0])


def test_layer_groups_cover_every_layer_once_within_the_byte_limit():
    from kv_transfer.device import _groups

    for layers, layer_bytes, limit in [(24, 38 << 20, 1 << 30), (69, 9 << 20, 1 << 30), (5, 3 << 30, 1 << 30)]:
        groups = _groups(layers, layer_bytes, limit)
        assert [i for g in groups for i in g] == list(range(layers))
        assert all(len(g) == 1 or len(g) * layer_bytes <= limit for g in groups)
