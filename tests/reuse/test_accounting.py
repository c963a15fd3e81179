"""The reuse accounting's in-flight notes (disagg.reuse.accounting, disagg.flow NOTE 8), as plain data."""

from __future__ import annotations

import random

from disagg.reuse.accounting import ReuseAccounting
from disagg.reuse.placement import CheckpointPlacement
from kv_transfer.keys import BlockHasher, KeyExtras

BS = 64
H = BlockHasher(BS, KeyExtras("m"))


def ids(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(4, 260) for _ in range(n)]


def test_a_branch_point_is_in_flight_from_begin_until_settled():
    """s2 branches off s1's system prompt: its branch checkpoint is noted in flight at ``begin``
    (before any await), so s3, beginning next, waits for it; once s2 settles, nothing is left."""
    acc = ReuseAccounting(BS, CheckpointPlacement(BS, prior_back=(), start_points=0))
    system = ids(5 * BS, 9)
    acc.begin(system + ids(300, 1), H, "s1", "r1")
    t2 = acc.begin(system + ids(280, 2), H, "s2", "r2")
    assert 5 * BS in t2.planned and 5 * BS in t2.pending
    t3 = acc.begin(system + ids(350, 3), H, "s3", "r3")
    assert acc.awaited(t3) == (5 * BS,) and 5 * BS not in t3.pending  # s2's to publish, not s3's
    assert acc.still_pending(t3, (5 * BS,))
    acc.settle(t2, (5 * BS,))
    assert not acc.still_pending(t3, (5 * BS,))
    assert 5 * BS in acc.ledger.view(system + ids(10, 4), H, "s4").published


def test_settle_drops_what_was_not_stored_and_checkpoint_at_what_is_resumed_past():
    acc = ReuseAccounting(BS, CheckpointPlacement(BS, prior_back=(), start_points=0))
    system = ids(5 * BS, 9)
    acc.begin(system + ids(300, 1), H, "s1", "r1")
    prompt = system + ids(280, 2)
    t2 = acc.begin(prompt, H, "s2", "r2")
    assert acc.checkpoint_at(t2, resume=6 * BS) == ()  # resumed past the branch: it is dropped
    assert acc.ledger.pending_among(prompt, H, (5 * BS,)) == ()
    acc.settle(t2, ())
    assert acc.ledger.pending_among(prompt, H, t2.pending) == () and t2.settled


def test_the_start_priors_points_are_named_speculative_and_demoted_as_they_land():
    """A first turn of 1,300 tokens (20 full blocks) plans the back prior's points 1, 2 and 4 blocks
    before its last full block (19, 18, 16) and the start prior's 2^k blocks (16, 8, 4; 16 is the
    back prior's); the ticket names the start prior's speculative, and with retention on, the
    session's publish of them returns them to demote at once, with nothing superseded yet."""
    from disagg.reuse.retention import SessionCheckpoints

    placement = CheckpointPlacement(BS)
    acc = ReuseAccounting(BS, placement, retention=SessionCheckpoints(BS, keep=8))
    prompt = ids(1300, 5)
    t = acc.begin(prompt, H, "s1", "r1")
    assert t.speculative == (4 * BS, 8 * BS)
    assert set(t.speculative) < set(t.planned)
    assert t.planned == placement.positions(1300)  # the same points as before, named
    stored = (*t.planned, 1300 // BS * BS, 1300)
    demoted = acc.superseded("s1", "r1", prompt, H, stored, t.hashes, t.speculative)
    assert sorted(pt.position for pt in demoted) == list(t.speculative)
    assert acc.superseded("s1", "r1", prompt, H, stored, t.hashes) == []  # without them: a first turn keeps all
