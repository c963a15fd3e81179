"""A Serve router sees one deployment's replicas: a one-role pool is placed by its phase's profile."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from disagg.router.index import PrefixIndex
from disagg.router.router import StateAwareRouter
from disagg.router.types import RouteRequest, WorkerState
from tests.router.helpers import chain, store


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_one_role_pool_picks_its_cached_worker(role):
    idx, h = PrefixIndex(), chain(8)
    for x in h:
        store(idx, "mla", x, "device", "w2")
    store(idx, "kda", h[7], "device", "w2")
    ws = [WorkerState(f"w{i}", role, f"n{i}") for i in range(4)]
    d = StateAwareRouter(idx).route(RouteRequest("a", "s", h, 8 * 4 + 1, 4), ws)
    assert (d.decode_worker, d.prefill_worker, d.reason) == ("w2", None, f"{role}_pool/cache_hit")


def test_mixed_pools_still_decide_prefill_and_decode():
    idx, h = PrefixIndex(), chain(8)
    ws = [WorkerState("p0", "prefill", "n0"), WorkerState("d0", "decode", "n0")]
    d = StateAwareRouter(idx, {"decider": {"local_prefill_max_tokens": 4}}).route(RouteRequest("a", "s", h, 33, 4), ws)
    assert (d.decode_worker, d.prefill_worker) == ("d0", "p0") and d.reason.startswith("disagg/")


@pytest.mark.parametrize("reported, role", [("prefill", "prefill"), ("decode", "decode"), ("both", "both"),
                                            (None, "both")])
def test_the_serve_adapter_keeps_the_reported_role(reported, role):
    from deployments.request_router import StateAwareRequestRouter

    rr = object.__new__(StateAwareRequestRouter)  # its pure part: no Serve controller
    rr.initialize_state()
    stats = {"node_id": "n0", "time": time.time(), "load": {}}
    if reported is not None:
        stats["role"] = reported
    rep = SimpleNamespace(replica_id=SimpleNamespace(unique_id="r0"), routing_stats=stats)
    assert rr._sync(rep).role == role


def test_a_decode_pool_told_its_prefill_nodes_scores_as_the_mixed_route_does():
    """Serving's decode router sees only decode replicas (3c); told the prefill pool's nodes, its
    decode profile costs the hand-off to a worker on a pool node over the host link, as the
    simulator's router (both pools, 3b) does: same scores, same pick. Untold, both links cost the same."""
    h = chain(8)
    cfg = {"decider": {"local_prefill_max_tokens": 10**6}}  # local: the decision keeps the decode profile's scores

    def route(workers, prefill_nodes=()):
        return StateAwareRouter(PrefixIndex(), cfg).route(RouteRequest("a", "s", h, 33, 4), workers, prefill_nodes)

    decoders = [WorkerState("d1", "decode", "n1"), WorkerState("d0", "decode", "n0")]
    mixed = route([WorkerState("p0", "prefill", "n0"), *decoders])
    told = route(decoders, {"n0"})
    untold = route(decoders)
    assert mixed.decode_worker == told.decode_worker == "d0"
    assert told.scores == pytest.approx(mixed.scores, abs=1e-12)
    assert told.scores["d0"] > told.scores["d1"] and untold.scores["d0"] == untold.scores["d1"]
    assert told.reason == "decode_pool/cold"
    # a prefill pool's nodes mean nothing to a prefill or aggregated pool
    for role in ("prefill", "both"):
        ws = [WorkerState("w1", role, "n1"), WorkerState("w0", role, "n0")]
        assert route(ws, {"n0"}).scores == route(ws).scores
