"""The reuse ledger and checkpoint placement (disagg.reuse.ledger, disagg.reuse.placement)."""

from __future__ import annotations

import random

from disagg.reuse.ledger import ReuseLedger
from disagg.reuse.placement import CheckpointPlacement
from kv_transfer.keys import BlockHasher, KeyExtras

BS = 64
H = BlockHasher(BS, KeyExtras("m"))


def ids(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(4, 260) for _ in range(n)]


def test_bound_is_the_longest_seen_prefix_with_tails():
    led = ReuseLedger(BS)
    a = ids(300, 1)
    assert led.view(a, H, "s").bound == 0
    led.note_seen(a, H, "s")
    assert led.view(a + ids(50, 2), H, "s").bound == 300  # full blocks, then the 44-token tail
    assert led.view(a[:200] + ids(50, 3), H, "s").bound == 192  # diverged inside block 3
    assert led.view(a, H, "s").bound == 299  # the last prompt token is always computed


def test_points_published_pending_and_raced():
    led = ReuseLedger(BS)
    a = ids(300, 1)
    led.note_seen(a, H, "s")
    led.note_points(a, H, (256, 300), "pending")
    v = led.view(a + ids(10, 2), H, "s")
    assert v.pending == (256, 300) and v.published == {}
    led.note_points(a, H, (256, 300), "published")
    assert set(led.published_since(a + ids(10, 2), H, v)) == {256, 300}
    v2 = led.view(a + ids(10, 2), H, "s")
    assert set(v2.published) == {256, 300} and v2.pending == ()


def test_stale_pending_counts_as_dropped():
    led = ReuseLedger(BS, pending_ttl_s=0.0)
    a = ids(300, 1)
    led.note_seen(a, H, "s")
    led.note_points(a, H, (256,), "pending")
    assert led.view(a + [5], H, "s").pending == ()


def test_branch_point_is_where_another_sessions_blocks_end():
    led = ReuseLedger(BS)
    system = ids(256, 9)
    led.note_seen(system + ids(300, 1), H, "s1")
    assert led.view(system + ids(200, 2), H, "s2").branch == 256
    assert led.view(system + ids(200, 2), H, "s1").branch == 0  # its own blocks: not a cross-session share


def test_salts_are_separate_but_the_unsalted_bound_sees_both():
    led = ReuseLedger(BS)
    a = ids(300, 1)
    salted = H.with_salt("t1")
    led.note_seen(a, salted, "s", unsalted=H)
    v = led.view(a + [5], H.with_salt("t2"), "s", unsalted=H)
    assert v.bound == 0 and v.bound_any_salt == 256


def test_ledger_is_bounded():
    led = ReuseLedger(BS, max_entries=8)
    for i in range(20):
        led.note_seen(ids(640, i), H, f"s{i}")
    assert len(led._blocks) <= 8
    assert led.view(ids(640, 0) + [5], H, "x").bound == 0  # forgotten: "never seen", not a miss


def test_placement_learns_where_follow_ups_diverge():
    pl = CheckpointPlacement(BS, prior_back=(), start_points=0)  # the learned part alone (priors: test_placement)
    assert pl.positions(1000) == ()
    for _ in range(10):
        pl.observe(prev_len=700, shared=512)  # 640 - 512: two blocks back from the last full block
    pl.observe(prev_len=700, shared=640)
    pl.observe(prev_len=700, shared=256)  # a compaction: not learned
    assert pl.learned() == [2]  # distance 0 is the engine's own point, below the first quantile
    assert 1000 // BS * BS - 2 * BS in pl.positions(1000)
    assert pl.positions(1000, resume=900) == ()
    assert 256 in pl.positions(1000, branch=256)
    assert all(p % BS == 0 and 0 < p < 1000 for p in pl.positions(1000, branch=256))


def test_pending_among_sees_in_flight_points_until_they_land_or_drop():
    led = ReuseLedger(BS)
    a = ids(300, 1)
    led.note_points(a, H, (128, 256, 300), "pending")
    assert led.pending_among(a, H, (64, 128, 256, 300)) == (128, 256, 300)
    led.note_points(a, H, (128,), "published")
    led.note_points(a, H, (300,), "dropped")
    assert led.pending_among(a + ids(20, 2), H, (128, 256, 300)) == (256,)


def test_private_blocks_are_a_sessions_own_in_its_contexts_order():
    """Ledger NOTE 4: the blocks a session sent first and nobody else sent, in the order last sent
    (its latest prompt's); a block another session sent too is shared for good."""
    led = ReuseLedger(BS)
    system = ids(2 * BS, 1)
    a1 = system + ids(3 * BS, 2)
    led.note_seen(a1, H, "a")
    led.note_seen(ids(2 * BS, 3), H, "c")  # another session's blocks in between
    led.note_seen(system + ids(BS, 4), H, "b")  # "b" sends the system prompt too
    a2 = a1 + ids(2 * BS, 5)
    led.note_seen(a2, H, "a")
    hashes = H.block_hashes(a2)
    assert led.private_blocks("a") == hashes[2:]  # past the shared system prompt, context order
    assert led.private_blocks("b") == H.block_hashes(system + ids(BS, 4))[2:]
    assert led.private_blocks("nobody") == []
