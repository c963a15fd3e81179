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
