"""Two StateStores over one host tier (two processes of a node): unaligned resume points are found."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.store import StateStore
from kv_transfer.tiers.host import HostTier
from tests.kv_transfer.kvt_util import BS, hasher, make_state, small_layout, tokens


def test_tail_digests_match_one_by_one():
    layout = small_layout()
    h = hasher(layout)
    block = tokens(BS - 1, seed=3)
    assert h.tail_digests(h.root, block) == [h.tail_digest(h.root, block[:t]) for t in range(1, BS)]


@pytest.mark.parametrize("position", [BS * 3 + 5, BS * 2 + 1, BS * 4 - 1, 7])
def test_store_finds_tail_written_by_another_store(position):
    layout = small_layout()
    with HostTier(8 << 20) as host:
        writer, reader = StateStore([host], layout), StateStore([host], layout)
        toks = tokens(BS * 6, seed=1)
        state = make_state(layout, position)
        writer.put_state(toks, state, hasher(layout))
        point = reader.resumable_length(toks, hasher(layout))
        assert point.position == position and point.has_tail
        got = reader.load_state(toks, point.position, hasher(layout))
        assert got is not None and torch.equal(got.tail.rows, state.tail.rows)
        other_tenant = reader.resumable_length(toks, hasher(layout, salt="b"))
        assert other_tenant.position == 0
