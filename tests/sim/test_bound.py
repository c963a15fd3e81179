"""Capacity bound: Belady's choices, resume points, and the infinite-cache limit."""

from __future__ import annotations

import pytest

from disagg.tools.sim.bound import belady_hits
from disagg.tools.sim.workload import SimRequest

BS = 4


def _p(session: str, ids: list[int], extra: int = 1) -> SimRequest:
    return SimRequest(session, 0, 0.0, 0.0, len(ids) * BS + extra, 1, ids, BS)


def test_belady_keeps_what_comes_back_where_lru_would_not():
    # capacity 2: LRU would drop a for c; Belady bypasses c (never used again)
    prompts = [_p("s1", [1, 2]), _p("s2", [3]), _p("s1", [1, 2])]
    assert belady_hits(prompts, [0, 0, 0], 2, 0) == [0, 0, 2 * BS]


def test_evicts_the_block_used_furthest_in_the_future():
    # capacity 2 after [1, 2]: block 3 is used next-soonest, so 2 (used last) is evicted for it
    prompts = [_p("a", [1, 2]), _p("b", [3]), _p("c", [3]), _p("d", [1]), _p("e", [2])]
    assert belady_hits(prompts, [0] * 5, 2, 1) == [0, 0, BS, BS, 0]  # every block a resume point


def test_resume_points_are_checkpoint_multiples_or_earlier_last_full_blocks():
    # the second prompt diverges after 3 blocks; block 3 was not a last full block: back to 2
    first, second = _p("s", [1, 2, 3, 9]), _p("s", [1, 2, 3, 4])
    assert belady_hits([first, second], [0, 0], 100, 2) == [0, 2 * BS]
    # the first prompt's last full block is a resume point
    first = _p("s", [1, 2, 3])
    assert belady_hits([first, second], [0, 0], 100, 2) == [0, 3 * BS]
    # no periodic checkpoints and no earlier last full block at the divergence: nothing
    assert belady_hits([_p("s", [1, 2, 3, 9]), second], [0, 0], 100, 0) == [0, 0]


def test_capped_at_prompt_minus_one_and_salted_apart():
    exact = SimRequest("s", 1, 0.0, 0.0, 2 * BS, 1, [1, 2], BS)  # aligned: at most 2 * BS - 1
    assert belady_hits([_p("s", [1, 2]), exact], [0, 0], 10, 0) == [0, 2 * BS - 1]
    assert belady_hits([_p("s", [1, 2]), _p("s", [1, 2])], [0, 1], 10, 0) == [0, 0]  # another salt


def test_zero_capacity_and_bad_input():
    assert belady_hits([_p("s", [1]), _p("s", [1])], [0, 0], 0, 1) == [0, 0]
    with pytest.raises(ValueError):
        belady_hits([], [], -1, 0)


def test_capacity_bound_of_a_run_pools_the_tiers_and_reserves_a_checkpoint_per_lane():
    """The run's own arrival order against devices + host tiers, less one checkpoint per live session."""
    from disagg.costs.model import CostModel
    from disagg.tools.sim.bound import capacity_bound
    from disagg.tools.sim.metrics import RequestRecord
    from disagg.tools.sim.simulator import ClusterConfig

    prompts = [_p("s1", [1, 2]), _p("s2", [3]), _p("s1", [1, 2])]
    prompts[2] = SimRequest("s1", 1, 0.0, 0.0, 2 * BS + 1, 1, [1, 2], BS)
    recs = [RequestRecord(r.session_id, r.session_id, r.turn, r.input_length, 1, arrival=float(t), finish=1.0)
            for t, r in enumerate(prompts)]
    recs.append(RequestRecord("x", "s9", 0, 4, 1, arrival=9.0))  # never finished: not replayed
    cost = CostModel(bytes_per_token=1.0, checkpoint_bytes=BS)  # a checkpoint weighs one block
    # 1 worker: 2 device + 1 host blocks = 3; one lane's checkpoint leaves 2 (Belady keeps s1's)
    cluster = ClusterConfig(num_workers=1, device_blocks=2, host_blocks=1, workers_per_node=1,
                            checkpoint_every_blocks=1)
    assert capacity_bound(prompts, recs, cluster, cost, live_sessions=1) == 2 * BS
    assert capacity_bound(prompts, recs, cluster, cost, live_sessions=2) == BS  # room for one block
    assert capacity_bound(prompts, recs[::-1], cluster, cost, live_sessions=1) == 2 * BS  # sorted by arrival


def test_learned_placement_makes_every_block_boundary_a_resume_point_of_the_bound():
    """A learned placement may keep a checkpoint anywhere: the bound resumes at any boundary."""
    from disagg.costs.model import CostModel
    from disagg.tools.sim.bound import capacity_bound
    from disagg.tools.sim.metrics import RequestRecord
    from disagg.tools.sim.simulator import ClusterConfig

    prompts = [SimRequest("s", 0, 0.0, 0.0, 4 * BS + 1, 1, [1, 2, 3, 4, 5], BS),
               SimRequest("s", 1, 0.0, 0.0, 4 * BS + 1, 1, [1, 2, 3, 9, 10], BS)]  # diverges at block 3
    recs = [RequestRecord(str(t), "s", t, 4 * BS + 1, 1, arrival=float(t), finish=1.0) for t in range(2)]
    cost = CostModel(bytes_per_token=1.0, checkpoint_bytes=BS)
    periodic = ClusterConfig(num_workers=1, device_blocks=64, host_blocks=0, checkpoint_every_blocks=2)
    learned = ClusterConfig(num_workers=1, device_blocks=64, host_blocks=0, checkpoint_every_blocks=0,
                            learned_checkpoints=True)
    assert capacity_bound(prompts, recs, periodic, cost, live_sessions=1) == 2 * BS  # the multiple of 2 below 3
    assert capacity_bound(prompts, recs, learned, cost, live_sessions=1) == 3 * BS


def test_a_prefix_in_flight_is_no_resume_point_of_the_bound():
    """With times, blocks exist from their prompt's first token on: a session arriving while
    another computes the prefix they share cannot resume it; one arriving after it can."""
    a, b = _p("a", [1, 2, 3]), _p("b", [1, 2, 7])
    assert belady_hits([a, b], [0, 0], 100, 1) == [0, 2 * BS]  # no times: a's blocks at once
    assert belady_hits([a, b], [0, 0], 100, 1, times=[(0.0, 1.0), (0.5, 1.5)]) == [0, 0]
    assert belady_hits([a, b], [0, 0], 100, 1, times=[(0.0, 1.0), (1.0, 2.0)]) == [0, 2 * BS]  # ready at 1.0
    assert belady_hits([a, b], [0, 0], 100, 1, times=[(0.0, 0.0), (0.0, 0.0)]) == [0, 0]  # ready on arrival: after
    with pytest.raises(ValueError):
        belady_hits([a, b], [0, 0], 100, 1, times=[(0.0, 1.0)])


def test_a_cached_chunk_of_a_prefill_in_flight_is_a_resume_point_of_the_bound():
    """Simulator NOTE 11: a prefill's chunk cached before its end is there from the chunk's end on,
    with a resume point at it (no periodic checkpoints here); what a later chunk computes is not."""
    a, b = _p("a", [1, 2, 3, 4]), _p("b", [1, 2, 3, 9])
    times = [(0.0, 1.0), (0.5, 1.5)]
    assert belady_hits([a, b], [0, 0], 100, 0, times=times) == [0, 0]
    assert belady_hits([a, b], [0, 0], 100, 0, times=times, chunks=[[(0.4, 2)], None]) == [0, 2 * BS]
    assert belady_hits([a, b], [0, 0], 100, 0, times=times, chunks=[[(0.4, 2), (0.5, 3)], None]) == [0, 3 * BS]
    assert belady_hits([a, b], [0, 0], 100, 0, times=times, chunks=[[(0.6, 3)], None]) == [0, 0]  # after b looked
    with pytest.raises(ValueError):
        belady_hits([a, b], [0, 0], 100, 0, chunks=[None, None])  # chunks need times


def test_an_earlier_prompt_end_inside_the_next_block_is_a_resume_point():
    """A follow-up that extends its predecessor exactly resumes at the predecessor's end (its
    unaligned tail), as the engine's prompt-end checkpoint lets it."""
    first = SimRequest("s", 0, 0.0, 0.0, 2 * BS + 3, 1, [1, 2, 3], BS)  # ends 3 tokens into block 2
    second = SimRequest("s", 1, 0.0, 0.0, 4 * BS, 1, [1, 2, 3, 4], BS)
    assert belady_hits([first, second], [0, 0], 100, 0) == [0, 2 * BS + 3]
