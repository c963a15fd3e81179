"""Prompts routed and not stored yet (``disagg.router.pending``), and where the router credits them."""

from __future__ import annotations

import pytest

from disagg.router.index import PrefixIndex
from disagg.router.pending import PendingPrefixes
from disagg.router.router import StateAwareRouter
from disagg.router.types import RouteRequest, WorkerState
from tests.router.helpers import chain, req

BS = 4


def test_points_are_the_last_full_block_the_divergences_and_the_largest_powers_of_two():
    p = PendingPrefixes(start_points=3)
    assert p.points(170, 0, [1, 2, 4]) == [170, 169, 168, 166, 128, 64, 32]
    assert p.points(170, 100, [1, 2, 80]) == [170, 169, 168, 128]  # only past what the prefill resumed
    assert PendingPrefixes(start_points=0).points(40, 0) == [40]
    assert p.points(40, 40) == []


def _booked(step_tokens: int = 64) -> tuple[PendingPrefixes, list[bytes]]:
    p, h = PendingPrefixes(step_tokens=step_tokens), chain(40)
    p.add(req(h, rid="a"), "w0", 0, now=0.0)  # points 40, 32, 16, 8 (blocks)
    return p, h


def test_a_request_sharing_a_booked_prefix_is_credited_its_furthest_point_once_queued_a_step_behind():
    p, h = _booked()
    b = req(h + chain(10, "b"), rid="b")
    assert p.credit(b, 1.0) == {}  # nothing routed behind "a" yet: "b" would start in its last step
    p.add(req(chain(16, "c"), 63, rid="c"), "w0", 0, now=1.0)  # 63 tokens behind "a": not a full step
    assert p.credit(b, 1.0) == {}
    p.add(req(chain(1, "d"), 1, rid="d"), "w1", 0, now=1.0)  # another worker's queue does not count
    assert p.credit(b, 1.0) == {}
    p.add(req(chain(1, "e"), 1, rid="e"), "w0", 0, now=1.0)  # 64 behind "a"
    assert p.credit(b, 1.0) == {"w0": 40 * BS}
    assert p.credit(req(h[:20] + chain(5, "f"), rid="f"), 1.0) == {"w0": 16 * BS}  # shares 20 blocks: point 16
    assert p.credit(req(h, 40 * BS, rid="g"), 1.0) == {"w0": 32 * BS}  # a point at its end computes nothing
    assert p.credit(req(chain(40, "x"), rid="x"), 1.0) == {}


def test_an_entry_ends_when_its_request_finishes_or_its_ttl_passes():
    p, h = _booked(step_tokens=0)
    b = req(h + chain(10, "b"), rid="b")
    assert p.credit(b, 1.0) == {"w0": 40 * BS}
    p.remove("a")
    assert p.credit(b, 1.0) == {} and len(p) == 0
    p, h = _booked(step_tokens=0)
    assert p.credit(b, p.ttl_s) == {"w0": 40 * BS}
    assert p.credit(b, p.ttl_s + 1.0) == {} and len(p) == 0


def test_a_request_routed_again_lives_from_its_last_routing():
    """A re-route (a replica lost, the request placed again) books the request anew: it is not
    expired by its first routing's time."""
    p, h = _booked(step_tokens=0)
    p.add(req(h, rid="a"), "w1", 0, now=100.0)
    b = req(h + chain(10, "b"), rid="b")
    assert p.credit(b, p.ttl_s + 50.0) == {"w1": 40 * BS} and len(p) == 1
    assert p.credit(b, p.ttl_s + 101.0) == {}


def test_a_request_that_resumed_its_whole_prompt_books_nothing():
    p, h = PendingPrefixes(step_tokens=0), chain(40)
    p.add(req(h, rid="a"), "w0", 40 * BS, now=0.0)
    assert len(p) == 0 and p.credit(req(h + chain(3, "b"), rid="b"), 0.0) == {}


def _pair(busy_other: int) -> tuple[StateAwareRouter, list[WorkerState], list[bytes]]:
    """w0 computes a's 161 tokens; session sb's last turn ran on w1 (so b, its next, is no first turn)."""
    t = [0.0]
    r = StateAwareRouter(PrefixIndex(), {"pending_credit": True, "pending_step_tokens": 0},
                         clock=lambda: t[0])
    ws = [WorkerState("w0", "both", "n0"), WorkerState("w1", "both", "n1", queued_prefill_tokens=busy_other)]
    h = chain(40)
    for rq, pool in ((RouteRequest("b0", "sb", chain(2, "sb"), 9, BS), ws[1:]),
                     (RouteRequest("a", "sa", h, 40 * BS + 1, BS), ws[:1])):
        r.on_routed(rq, r.route(rq, pool))
    r.on_finished("b0", 0)
    return r, ws, h


@pytest.mark.parametrize("busy_other, picked, cached", [(0, "w1", 0), (1000, "w0", 40 * BS)])
def test_the_router_credits_a_queued_prefix_only_where_waiting_for_it_is_the_shortest_way(busy_other, picked, cached):
    """b shares 160 of a's tokens. With w1 idle, waiting behind a costs more than computing the prefix
    on w1 (161 - 160 > 0 - 0): no credit, and b stays on its session's w1 (credited, it would go to w0).
    With 1,000 tokens queued on w1 it does not: b is credited a's prefix on w0, as a device resume,
    and goes there."""
    r, ws, h = _pair(busy_other)
    b = RouteRequest("b", "sb", h + chain(8, "b"), 48 * BS + 1, BS)
    d = r.route(b, ws)
    assert (d.decode_worker, d.predicted_cached_tokens) == (picked, cached)
    assert d.source_tier == ("device" if cached else None)


def test_a_finished_request_stops_crediting_its_prefix():
    r, ws, h = _pair(1000)
    r.on_finished("a", 0)
    b = RouteRequest("b", "sb", h + chain(8, "b"), 48 * BS + 1, BS)
    assert r.route(b, ws).predicted_cached_tokens == 0 and len(r.pending) == 0


def test_the_credit_is_off_by_default():
    r = StateAwareRouter(PrefixIndex())
    assert r.pending is None
    a = RouteRequest("a", "sa", chain(4), 17, BS)
    r.on_routed(a, r.route(a, [WorkerState("w0")]))
    r.on_finished("a", 0)
    with pytest.raises(ValueError, match="pending_step_tokens"):
        StateAwareRouter(PrefixIndex(), {"pending_credit": True, "pending_step_tokens": -1})
