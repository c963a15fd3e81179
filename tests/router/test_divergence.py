"""The router's divergence learner (disagg.router.divergence) and the decisions that carry it."""

from __future__ import annotations

import random

import pytest

from disagg.reuse.placement import CheckpointPlacement
from disagg.router.divergence import DivergenceLearner, _shared_blocks
from disagg.router.router import StateAwareRouter
from tests.router.helpers import chain, req, workers

BS = 4


def _window(prev: list[bytes], blocks_back: int) -> bytes:
    lo = max(0, len(prev) - blocks_back - 1)
    return b"".join(h[:8] for h in prev[lo:])


@pytest.mark.parametrize("seed", range(20))
def test_shared_blocks_matches_a_linear_scan(seed):
    """Against the first disagreeing digest, over random lengths and divergence points: inside the
    window the exact count, before it None (too far back to learn), a prompt shorter than the
    window's start 0 or None."""
    rng = random.Random(seed)
    n = rng.randrange(1, 120)
    prev = chain(n, f"p{seed}")
    keep = rng.randrange(0, n + 1)
    new = prev[:keep] + chain(rng.randrange(0, 40), f"q{seed}")
    expect = next((i for i, (a, b) in enumerate(zip(prev, new, strict=False)) if a != b), min(n, len(new)))
    got = _shared_blocks(new, n, _window(prev, 64))
    lo = max(0, n - 65)
    if expect > lo or (lo == 0 and expect == 0):
        assert got == expect
    else:
        assert got is None


def test_learner_names_the_tail_every_session_drops():
    """Sessions whose follow-ups drop a 3-block tail: after the first follow-up the hint names 3 blocks
    back (in tokens); a session id under another tenant's salt is another session."""
    dl = DivergenceLearner()
    assert dl.hint() is None
    for s in range(4):
        ctx = chain(10, f"s{s}")
        dl.observe(f"s{s}", ctx + chain(3, f"e{s}a"), 13 * BS + 2, BS)
        dl.observe(f"s{s}", ctx + chain(5, f"e{s}b"), 15 * BS + 2, BS)
    assert dl.placement.num_observed == 4
    assert dl.hint() == (3 * BS,)
    dl.observe("", chain(40, "x"), 40 * BS, BS)  # no session: nothing learned
    assert dl.placement.num_observed == 4


def test_learner_skips_rewrites_and_forgets_old_sessions():
    dl = DivergenceLearner(max_sessions=2)
    dl.observe("a", chain(20, "a"), 20 * BS, BS)
    dl.observe("a", chain(20, "z"), 20 * BS, BS)  # a rewrite: shares nothing, not learned
    assert dl.placement.num_observed == 0
    dl.observe("b", chain(8, "b"), 8 * BS, BS)
    dl.observe("c", chain(8, "c"), 8 * BS, BS)  # evicts "a" (the oldest)
    dl.observe("a", chain(20, "z") + chain(2, "y"), 22 * BS, BS)
    assert dl.placement.num_observed == 0  # "a" was forgotten: no predecessor to compare with


def test_placement_uses_the_given_distances_in_place_of_its_own():
    pl = CheckpointPlacement(64)
    for _ in range(8):
        pl.observe(prev_len=20 * 64, shared=18 * 64)  # its own: 2 blocks back
    assert pl.positions(30 * 64 + 5, seen=30 * 64) == (28 * 64,)
    assert pl.positions(30 * 64 + 5, seen=30 * 64, back=[5, 1]) == (25 * 64, 29 * 64)
    assert pl.positions(30 * 64 + 5, seen=30 * 64, back=[]) == ()


def test_decisions_carry_what_the_router_learned():
    """Every decision names the learned distances once a follow-up was seen (2 blocks back, then the
    cold-start prior's 1 and 4 that one observation leaves, CheckpointPlacement.prior); off by config,
    none."""
    ws = workers(4)
    for hints, expect in ((True, (2 * BS, 1 * BS, 4 * BS)), (False, None)):
        router = StateAwareRouter(config={"checkpoint_hints": hints})
        ctx = chain(12, "c")
        first = req(ctx + chain(2, "t1"), sid="s1", rid="a")
        d = router.route(first, ws)
        assert d.checkpoint_back is None  # nothing learned yet
        router.on_routed(first, d)
        follow = req(ctx + chain(6, "t2"), sid="s1", rid="b")
        router.on_routed(follow, router.route(follow, ws))
        other = req(chain(9, "o"), sid="s2", rid="c")
        assert router.route(other, ws).checkpoint_back == expect


def test_sessions_that_never_come_back_end_the_back_prior():
    """One-turn sessions teach nothing: until ``one_turn_after`` sessions started the hint is None
    (each worker keeps its own placement's cold-start prior), from then on ``()`` (no back points:
    the worker's placement keeps none, CheckpointPlacement.positions with back=[]); the first
    follow-up learned brings the learned distances back, whatever came before."""
    dl = DivergenceLearner(one_turn_after=3)
    for s in range(2):
        dl.observe(f"q{s}", chain(10, "doc") + chain(2, f"q{s}"), 12 * BS + 1, BS)
        assert dl.hint() is None
    dl.observe("q2", chain(10, "doc") + chain(2, "q2"), 12 * BS + 1, BS)
    assert dl.sessions_started == 3
    assert dl.hint() == ()
    pl = CheckpointPlacement(BS)
    assert pl.positions(30 * BS + 1, seen=30 * BS) and pl.positions(30 * BS + 1, seen=30 * BS, back=[]) == ()
    dl.observe("q2", chain(10, "doc") + chain(1, "q2") + chain(4, "q2b"), 15 * BS + 1, BS)  # 1 block back
    assert dl.sessions_started == 3 and dl.placement.num_observed == 1
    assert dl.hint() == (1 * BS, 2 * BS, 4 * BS)  # learned 1, and the prior's 2 and 4 that one observation leaves
    with pytest.raises(ValueError, match="one_turn_after"):
        DivergenceLearner(one_turn_after=0)


def test_router_decisions_name_no_distances_after_one_turn_sessions():
    """Through the router: the configured count of sessions without a follow-up, then ``()``."""
    ws = workers(4)
    router = StateAwareRouter(config={"one_turn_after": 2})
    seen = []
    for i in range(3):
        r = req(chain(8, "doc") + chain(2, f"q{i}"), sid=f"q{i}", rid=f"r{i}")
        d = router.route(r, ws)
        seen.append(d.checkpoint_back)
        router.on_routed(r, d)
    assert seen == [None, None, ()]
    with pytest.raises(ValueError, match="one_turn_after"):
        StateAwareRouter(config={"one_turn_after": 0})
