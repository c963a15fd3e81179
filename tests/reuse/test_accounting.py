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


def test_finish_tells_the_learner_how_many_turns_back_a_prompt_could_resume():
    """Under ``keep_turns: auto`` each finished request of a session names the point it could
    resume from (its realized resume, or the furthest published point past it): two turns of s1
    published, then a third turn that extends the second resumes one turn back (age 0: the latest
    turn's end), and a rewind to the first turn's prompt reaches one turn further (age 1)."""
    import asyncio

    from disagg.reuse.retention import SessionCheckpoints

    acc = ReuseAccounting(BS, None, retention=SessionCheckpoints(BS, keep=8, keep_turns="auto"))
    first = ids(3 * BS + 10, 1)
    second = first + ids(2 * BS, 2)
    for rid, prompt in (("r1", first), ("r2", second)):
        t = acc.begin(prompt, H, "s1", rid)
        acc.settle(t, (len(prompt),))
        acc.superseded("s1", rid, prompt, H, (len(prompt),), t.hashes)
    ages = acc.retention.ages
    third = acc.begin(second + ids(40, 3), H, "s1", "r3")
    asyncio.run(acc.finish(third, len(second)))  # resumed at the second turn's end
    rewind = acc.begin(first + ids(50, 4), H, "s1", "r4")
    asyncio.run(acc.finish(rewind, 0))  # recomputed, though the first turn's end was published
    other = acc.begin(first + ids(50, 5), H, "s2", "r5")  # another session: not s1's turns to learn
    asyncio.run(acc.finish(other, len(first)))
    assert ages.observed == 2
    assert ages._age[0] > 0.99 and ages._age[1] > 0.99 and sum(ages._age) < 2.01
    assert ages._had[2] > 1.99  # both prompts came when s1 had published two turns


def test_the_routers_empty_distances_leave_a_prompt_no_back_points():
    """A decision naming ``()`` (the router saw ``one_turn_after`` sessions start and none come back,
    ``disagg.router.divergence``) plans none of the back prior's points (19, 18, 16 blocks here),
    only the start prior's; None (nothing known) keeps this worker's own prior."""
    acc = ReuseAccounting(BS, CheckpointPlacement(BS))
    prompt = ids(1300, 5)
    own = acc.begin(prompt, H, "s1", "r1")
    assert {19 * BS, 18 * BS, 16 * BS} <= set(own.planned)
    none = acc.begin(ids(1300, 6), H, "s2", "r2", back=())
    assert none.planned == none.speculative == (4 * BS, 8 * BS, 16 * BS)
