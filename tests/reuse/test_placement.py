"""Checkpoint placement's cold-start prior and its bound (disagg.reuse.placement), as pure policy."""

from __future__ import annotations

import random

import pytest

from disagg.reuse.placement import CheckpointPlacement

BS = 64


def resume_at(points: tuple[int, ...], shared: int) -> int:
    """Where a later prompt sharing ``shared`` tokens resumes among a prefill's checkpoints."""
    return max((p for p in points if p <= shared), default=0)


@pytest.mark.parametrize("tail_blocks", [1, 2, 3, 4])
def test_cold_prior_catches_the_first_follow_up(tail_blocks):
    """Nothing observed yet: a follow-up dropping a tail of 1-4 blocks (plus a partial one) resumes
    within half of its distance back, at a prior point (1, 2, 4 blocks back)."""
    pl = CheckpointPlacement(BS)
    prev = 20 * BS + 37  # last full block at 20 blocks
    points = pl.positions(prev, seen=prev - 40)
    diverge = (20 - tail_blocks) * BS
    got = resume_at(points, diverge)
    assert diverge - got <= (tail_blocks // 2) * BS, (points, diverge)
    if tail_blocks in (1, 2, 4):
        assert got == diverge


def test_prior_blends_out_as_the_histogram_fills():
    pl = CheckpointPlacement(BS, prior_mass=4)
    seen = []
    for _ in range(5):
        seen.append(len(pl.prior()))
        pl.observe(prev_len=700, shared=640)  # follow-ups extend the whole prompt: distance 0
    assert seen == [3, 3, 2, 1, 0]
    assert pl.positions(1000, seen=990) == ()  # an append-only workload keeps no extra point


def test_learned_distances_replace_the_prior():
    pl = CheckpointPlacement(BS)
    for _ in range(8):
        pl.observe(prev_len=1000, shared=10 * BS)  # 15 - 10: five blocks back, beyond the prior
    last_full = 1000 // BS * BS
    assert pl.prior() == [] and pl.positions(1000, seen=990) == (last_full - 5 * BS,)


@pytest.mark.parametrize("shared_blocks", [1, 3, 5, 9, 12, 15])
def test_start_prior_resumes_an_unseen_shared_prefix_at_half_or_more(shared_blocks):
    """A first prompt no earlier prompt shared keeps points at 2^k blocks: a later prompt sharing
    any prefix of at least the smallest kept point resumes at half of it or more."""
    pl = CheckpointPlacement(BS, prior_back=())
    points = pl.positions(1000)  # 15 full blocks: 2^k in {1, 2, 4, 8}, the three largest kept
    assert points == (2 * BS, 4 * BS, 8 * BS)
    got = resume_at(points, shared_blocks * BS)
    if shared_blocks >= 2:
        assert 2 * got >= shared_blocks * BS
    else:
        assert got == 0


def test_start_prior_only_in_the_unseen_part():
    pl = CheckpointPlacement(BS, prior_back=())
    assert pl.positions(1000, seen=9 * BS) == ()  # 2^k blocks past 9: none short of 15
    assert pl.positions(2000, seen=9 * BS) == (16 * BS,)


def test_branch_and_learned_outrank_the_priors_under_the_bound():
    pl = CheckpointPlacement(BS, max_extra=2)
    points = pl.positions(1000, branch=9 * BS)
    assert len(points) == 2 and 9 * BS in points and 14 * BS in points  # branch, then 1 block back


def test_placed_names_the_rule_behind_each_position():
    """A 17-block prompt (plus 5 tokens) branching at 9 blocks: the back prior 1, 2 and 4 blocks
    before its last full block (16, 15, 13), the start prior's three largest 2^k blocks (16, 8, 4).
    16, asked for by both, is the back prior's (it outranks the start prior)."""
    pl = CheckpointPlacement(BS, max_extra=8)
    n = 17 * BS + 5
    placed = pl.placed(n, branch=9 * BS)
    assert placed == ((4 * BS, "start"), (8 * BS, "start"), (9 * BS, "branch"), (13 * BS, "back"),
                      (15 * BS, "back"), (16 * BS, "back"))
    assert tuple(p for p, _ in placed) == pl.positions(n, branch=9 * BS)


def test_bound_and_alignment_hold_for_any_arguments():
    rng = random.Random(0)
    for _ in range(2000):
        pl = CheckpointPlacement(BS, max_points=rng.randint(0, 5), max_extra=rng.randint(0, 8),
                                 start_points=rng.randint(0, 6), prior_back=(1, 2, 4, 8, 16)[: rng.randint(0, 5)])
        for _ in range(rng.randint(0, 12)):
            prev = rng.randint(1, 5000)
            pl.observe(prev, rng.randint(0, prev))
        n = rng.randint(1, 20000)
        resume, seen = rng.randint(0, n), rng.randint(0, n)
        points = pl.positions(n, resume, branch=rng.choice([0, rng.randint(0, n)]), seen=seen)
        assert len(points) <= pl.max_extra
        assert len(set(points)) == len(points) and list(points) == sorted(points)
        assert all(p % BS == 0 and resume < p < n and p != n // BS * BS for p in points)


@pytest.mark.parametrize("bad", [{"prior_back": (0,)}, {"prior_mass": -1}, {"start_points": -1},
                                 {"max_extra": -1}, {"coverage": 0}])
def test_bad_configuration_is_refused(bad):
    with pytest.raises(ValueError):
        CheckpointPlacement(BS, **bad)


def test_spread_divergences_resume_within_a_quantile_gap():
    """Tails of varying length: follow-ups diverge 10-40 blocks back, evenly. The points sit at the
    distribution's quantiles, the furthest at its 98th percentile, so every follow-up but the
    furthest 2% resumes at most one quantile gap (about 30 / 4 blocks) short of its divergence. The
    four most frequent distances of this sample (23, 28, 30 and 37 blocks, the rule before) left
    the tenth diverging 38-40 blocks back to an older turn's point and others 13 blocks short."""
    pl = CheckpointPlacement(BS, max_points=3, prior_back=(), start_points=0, decay=1.0)
    rng = random.Random(3)
    distances = [rng.randint(10, 40) for _ in range(400)]
    prev_full = 100
    for d in distances:
        pl.observe(prev_len=prev_full * BS + 10, shared=(prev_full - d) * BS)
    learned = pl.learned()
    assert len(learned) == 4 and max(learned) >= 39
    points = pl.positions(prev_full * BS + 10)
    losses = sorted(((prev_full - d) * BS - resume_at(points, (prev_full - d) * BS)) // BS for d in distances)
    assert losses[int(0.98 * len(losses)) - 1] <= 9  # blocks recomputed short of the divergence
    assert sum(losses) / len(losses) <= 5
