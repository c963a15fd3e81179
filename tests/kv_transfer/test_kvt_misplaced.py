"""Objects with valid checksums stored under another piece's key (a misplaced write, a key
collision, a buggy peer): ``load_state`` must never return them as part of a state, and must
treat them as corrupt: counted, deleted from their tier, the next tier tried."""

from __future__ import annotations

import pytest

from kv_transfer import codec
from kv_transfer.keys import ObjectKey
from kv_transfer.store import StateStore
from kv_transfer.tiers.host import HostTier
from tests.kv_transfer.kvt_util import hasher, make_state, small_layout, tokens

KiB, MiB = 1 << 10, 1 << 20
LAYOUT = small_layout()  # block size 16
H = hasher(LAYOUT)
TOKS = tokens(200)


def _tier() -> HostTier:
    return HostTier(4 * MiB, slab_bytes=256 * KiB)


def _swap(tier: HostTier, key: str, data: bytes) -> None:
    assert tier.delete(key) and tier.put_bytes(key, data)


def _misplace(kind: str, tier: HostTier, tp_size: int) -> tuple[int, str]:
    """Put one misplaced object of ``kind`` in ``tier``: (the resume point, its key)."""
    if kind == "block":  # block 0's object under block 1's key
        h = H.block_hashes(TOKS[:32])
        key = str(ObjectKey("mla", h[1]))
        _swap(tier, key, tier.get_bytes(str(ObjectKey("mla", h[0]))))
        return 32, key
    if kind == "tail":  # the tail of 37 (span 5) under the tail of 35's key (span 3)
        key = str(ObjectKey("tail", H.prefix_digest(TOKS, 35)))
        _swap(tier, key, tier.get_bytes(str(ObjectKey("tail", H.prefix_digest(TOKS, 37)))))
        return 35, key
    if kind == "kda position":  # a KDA checkpoint of 48 under the one of 32
        key = str(ObjectKey("kda", H.prefix_digest(TOKS, 32), f"tp0of{tp_size}"))
        _swap(tier, key, codec.encode(make_state(LAYOUT, 48, tp_size=tp_size).kda[0], LAYOUT))
        return 32, key
    # kind == "kda rank": TP rank 1's shard under rank 0's key
    d = H.prefix_digest(TOKS, 32)
    key = str(ObjectKey("kda", d, f"tp0of{tp_size}"))
    _swap(tier, key, tier.get_bytes(str(ObjectKey("kda", d, f"tp1of{tp_size}"))))
    return 32, key


@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("kind", ["block", "tail", "kda position", "kda rank"])
def test_a_misplaced_piece_is_never_loaded_and_is_deleted(kind, contiguous):
    tp = 2 if kind == "kda rank" else 1
    host = _tier()
    store = StateStore([host], LAYOUT, tp_size=tp)
    for p in (32, 35, 37, 48):
        store.put_state(TOKS, make_state(LAYOUT, p, tp_size=tp), H, tp_rank=None)
    position, key = _misplace(kind, host, tp)
    assert store.load_state(TOKS, position, H, contiguous=contiguous) is None
    assert store.stats()["num_corrupt_pieces"] == 1
    assert host.contains([key]) == [False]  # so no later lookup offers the point again
    assert store.resumable_length(TOKS[: position + 1], H).position < position


@pytest.mark.parametrize("kind", ["block", "tail", "kda position"])
def test_a_misplaced_piece_falls_through_to_the_next_tier(kind):
    """The host tier's copy is misplaced, the lower tier's is right: the load succeeds from it
    and returns exactly the state that was stored."""
    host, lower = _tier(), _tier()
    store = StateStore([host, lower], LAYOUT)
    states = {p: make_state(LAYOUT, p) for p in (32, 35, 37, 48)}
    for s in states.values():
        store.put_state(TOKS, s, H)
    position, key = _misplace(kind, host, 1)
    good = StateStore([_tier()], LAYOUT)  # the correct object, encoded the same way
    good.put_state(TOKS, states[position], H)
    assert lower.put_bytes(key, good.tiers[0].get_bytes(key))
    got = store.load_state(TOKS, position, H)
    want = states[position]
    assert got is not None and store.stats()["num_corrupt_pieces"] == 1
    assert all(a.rows.equal(b.rows) and a.start == b.start for a, b in zip(got.mla_blocks, want.mla_blocks, strict=True))
    assert (got.tail is None) == (want.tail is None)
    assert got.tail is None or (got.tail.rows.equal(want.tail.rows) and got.tail.span == want.tail.span)
    assert got.kda[0].position == position and got.kda[0].recurrent.equal(want.kda[0].recurrent)
