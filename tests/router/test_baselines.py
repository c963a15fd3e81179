from __future__ import annotations

import pytest

from disagg.router.baselines import BASELINES
from disagg.router.baselines.dynamo_cost import DynamoCostRouter
from disagg.router.baselines.power_of_two import PowerOfTwoRouter
from disagg.router.baselines.prefix_affinity import PrefixAffinityRouter, text_chain
from disagg.router.baselines.round_robin import RoundRobinRouter
from disagg.router.index import PrefixIndex
from disagg.router.types import RouteRequest, WorkerState
from tests.router.helpers import chain, req, store, workers


def _route(router, r, ws):
    d = router.route(r, ws)
    router.on_routed(r, d)
    return d


def test_round_robin_cycles_each_pool():
    rr = RoundRobinRouter()
    assert [_route(rr, req([]), workers(3)).decode_worker for _ in range(4)] == ["w0", "w1", "w2", "w0"]
    pd = [WorkerState("p0", "prefill"), WorkerState("p1", "prefill"), WorkerState("d0", "decode")]
    ds = [_route(rr, req([]), pd) for _ in range(2)]
    assert [(d.prefill_worker, d.decode_worker) for d in ds] == [("p0", "d0"), ("p1", "d0")]


def test_power_of_two_picks_shorter_queue_of_two():
    ws = workers(2)
    ws[0].queued_prefill_requests = 5
    p2 = PowerOfTwoRouter(seed=1)
    assert {_route(p2, req([]), ws).decode_worker for _ in range(10)} == {"w1"}
    ws3 = workers(3)
    ws3[2].running_decode_requests = 9  # never chosen: always loses its pair
    assert "w2" not in {_route(p2, req([]), ws3).decode_worker for _ in range(30)}


def test_prefix_affinity_deepest_match_then_least_cached_then_imbalance():
    pa = PrefixAffinityRouter(seed=0)
    ws = workers(3)
    h = chain(10)
    first = _route(pa, req(h), ws)
    assert first.reason == "least_cached"
    again = _route(pa, req(h[:5] + chain(5, "other")), ws)
    assert (again.reason, again.decode_worker) == ("prefix_match", first.decode_worker)
    # match rate below 0.1: 1 of 20 blocks
    low = _route(pa, req(h[:1] + chain(19, "z")), ws)
    assert low.reason == "least_cached" and low.decode_worker != first.decode_worker
    busy = PrefixAffinityRouter(imbalanced_threshold=2, seed=0)
    ws[0].queued_prefill_requests = 10
    assert busy.route(req(h), ws).reason == "imbalanced"


def test_prefix_affinity_text_mode_and_eviction():
    assert len(text_chain("x" * 130, 64)) == 2
    pa = PrefixAffinityRouter(eviction_threshold_blocks=4, eviction_target_blocks=2)
    r = RouteRequest("r", "s", [], 10, 4, text="a" * 64 * 6)
    d = _route(pa, r, workers(2))
    assert pa.held_blocks(d.decode_worker) == 2  # 6 inserted, evicted down to the target


def test_dynamo_cost_formula():
    idx, h = PrefixIndex(), chain(8)
    ws = workers(3)
    for x in h[:4]:
        store(idx, "mla", x, "device", "w0")
    for x in h[:8]:
        store(idx, "mla", x, "host", "w1")
    ws[0].queued_prefill_tokens = 16  # 4 blocks of 4 tokens
    ws[2].running_decode_tokens = 8
    dyn = DynamoCostRouter(idx)
    costs = dyn.costs(req(h, 33), ws)  # new_blocks = ceil(33 / 4) = 9
    assert costs == pytest.approx({"w0": 4 + 9 - 4.0, "w1": 9 - 0.75 * 8, "w2": 9 + 2.0})
    assert dyn.route(req(h, 33), ws).decode_worker == "w1"


def test_p_d_baselines_count_inbound_decodes():
    """A P/D decode worker's requests still prefilling in the pool count where the peers count them:
    in Ray Serve's queue length (the replica holds them) and in Dynamo's decode blocks (its books
    count a request from its routing on)."""
    ws = [WorkerState("p0", "prefill"), WorkerState("d0", "decode", running_decode_tokens=40),
          WorkerState("d1", "decode", running_decode_requests=1, inbound_decode_requests=2,
                      inbound_decode_tokens=64)]
    assert ws[2].queue_length == 3
    assert DynamoCostRouter(PrefixIndex()).route(req(chain(2), 8), ws).decode_worker == "d0"
    ws[2].inbound_decode_tokens = 0
    assert DynamoCostRouter(PrefixIndex()).route(req(chain(2), 8), ws).decode_worker == "d1"


def test_every_baseline_in_table_routes():
    idx = PrefixIndex()
    for name, make in BASELINES.items():
        d = make(idx, 0).route(req(chain(3)), workers(2))
        assert d.decode_worker in ("w0", "w1"), name
