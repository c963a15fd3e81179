"""The state-aware router's picks survive Ray Serve's own routing loop.

These tests run Serve's real ``RequestRouter`` machinery (its routing tasks, queue-length probes
with their deadlines, the fall down the ranks, the hand-over of a replica found to a pending
request) around ``StateAwareRequestRouter``. The replicas are in-memory stand-ins: a replica
actor is the system boundary here, and its queue-length answer is timed by the test, which
makes the races that a loaded machine produces by chance happen every time. The queue-length
cache is off, so every request probes: the path a session's turn takes once its replica's cache
entry is older than Serve's 10 s, i.e. after a think time (``deployments.request_router``
NOTE 1).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve._private.request_router.common import PendingRequest

import disagg.router.metrics as router_metrics
from deployments.request_router import (
    STATE_PROBE_ROUNDS,
    NodeEventFeed,
    StateAwareRequestRouter,
    report_finished,
)
from disagg.engine.protocol import SamplingParams
from disagg.messages import GenerateParams, ToReplica
from kv_transfer.keys import BlockHasher, KeyExtras

BS = 16
H = BlockHasher(BS, KeyExtras("m"))
RNG = random.Random(7)
SESSIONS = {s: [RNG.randrange(4, 1000) for _ in range(6 * BS)] for s in ("s1", "s2")}
DEPLOYMENT = DeploymentID(name="DecodeServer", app_name="ranks-test")
_IDS = itertools.count()


class _Replica:
    """A decode replica as Serve's router sees one: its id, its routing stats (the device-resident
    sessions, ``record_routing_stats``), and a queue-length answer that takes ``answer_s``."""

    def __init__(self, uid: str, node: str, resident: list[str], queue_len: int = 0, answer_s: float = 0.0):
        self._id = ReplicaID(unique_id=uid, deployment_id=DEPLOYMENT)
        self.node_id, self.answer_s, self.queue_len, self.probes = node, answer_s, queue_len, 0
        self.routing_stats = {
            "role": "both", "node_id": node, "time": time.time(), "model_id": "m", "block_size": BS,
            "load": {"device_tokens": 1 << 20}, "device_version": 1,
            "device_sessions": [[d.hex() for d in H.block_hashes(SESSIONS[s])] for s in resident]}

    replica_id = property(lambda self: self._id)
    availability_zone = None
    multiplexed_model_ids: set = set()
    max_ongoing_requests = 4
    is_cross_language = False

    async def get_queue_len(self, *, deadline_s: float) -> int:
        self.probes += 1
        await asyncio.sleep(self.answer_s)
        return self.queue_len


@pytest.fixture(autouse=True)
def _own_registries(monkeypatch):
    """The router registers its policy and pool in process-wide maps: these tests' own."""
    for registry in ("LIVE_POLICIES", "POOL_VIEWS", "POOL_POLICIES", "REPLICA_IDS", "REPLICA_NODES"):
        monkeypatch.setattr(router_metrics, registry, {})


def _router(replicas: list[_Replica]) -> StateAwareRequestRouter:
    rr = StateAwareRequestRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=False)
    rr.initialize_state()
    rr._node_events = NodeEventFeed(rr._index, lookup=lambda node: None)  # no node stores (actors) here
    rr.update_replicas(replicas)
    return rr


def _turn(session: str) -> PendingRequest:
    """A session's next turn: its resident context and 20 new tokens."""
    rid = f"req-{next(_IDS)}"
    params = GenerateParams(rid, SESSIONS[session] + [5] * 20, SamplingParams(max_tokens=8), session_id=session)
    return PendingRequest([params], {}, RequestMetadata(rid, f"internal-{rid}"))


async def _placed(rr: StateAwareRequestRouter, *turns: PendingRequest) -> list[str]:
    """Where Serve's routing loop sends ``turns``, submitted together in this order."""
    for t in turns:
        t.reset_future()  # on this test's event loop
    chosen = await asyncio.wait_for(asyncio.gather(*(rr._choose_replica_for_request(t) for t in turns)), 30)
    return [r.replica_id.unique_id for r in chosen]


def test_each_request_gets_the_replica_found_for_it():
    """Two turns routed at once, each to the replica holding its session: the one found first
    (b answers at once, a after 50 ms, both within Serve's deadline) goes to the turn it was
    found for. With Serve's FIFO hand-over it went to the older turn, s1, whose state is on a."""
    a, b = _Replica("a", "n0", ["s1"], answer_s=0.05), _Replica("b", "n1", ["s2"])

    async def run():
        rr = _router([a, b])
        return await _placed(rr, _turn("s1"), _turn("s2"))

    assert asyncio.run(run()) == ["a", "b"]


def test_calls_that_share_a_request_id_each_reach_their_replica():
    """The calls a request makes inherit its internal request id, and the ingress's per-replica
    calls (its stats, a session's end) go out together: each reaches the replica it names. By
    internal id alone (Serve's matching without FIFOMixin) one waited forever; with FIFO, a
    answering late, both went to b."""
    a, b = _Replica("a", "n0", [], answer_s=0.05), _Replica("b", "n1", [])

    async def run():
        rr = _router([a, b])
        calls = [PendingRequest([ToReplica(r)], {}, RequestMetadata("scrape", "internal-scrape")) for r in "ab"]
        return await _placed(rr, *calls)

    assert asyncio.run(run()) == ["a", "b"]


def test_a_late_answer_from_the_state_holder_does_not_send_its_turn_away():
    """The replica holding the session answers after 0.15 s, past Serve's first 0.1 s deadline:
    it gets more rounds (0.2 s the second) before the others, where the turn would recompute its
    context. A turn with no state anywhere is not held for its pick: it goes down the ranks."""
    a, b = _Replica("a", "n0", ["s1"], answer_s=0.15), _Replica("b", "n1", [])

    async def run():
        rr = _router([a, b])
        held = await _placed(rr, _turn("s1"))
        a.routing_stats = {**a.routing_stats, "device_version": 2, "device_sessions": []}  # nothing resident
        b.routing_stats = {**b.routing_stats, "load": {"device_tokens": 1 << 20, "running_decode_requests": 3,
                                                       "running_decode_tokens": 3000}}  # a is the pick by load
        free = await _placed(rr, _turn("s2"))
        return held, free, rr

    held, free, rr = asyncio.run(run())
    assert held == ["a"], "the turn went to a replica without its state"
    assert free == ["b"], "a turn without state waited for a late pick"
    assert rr._policy.metrics.decisions["no_stats"] == 0  # both placed by the policy


def test_a_request_no_rank_took_is_booked_once():
    """Both replicas answer "full" for a while: Serve asks the router again and again, and backs
    off between asks. The policy books the request once (one decision, one predicted load), and
    it lands on its state's replica once that has room."""
    a, b = _Replica("a", "n0", ["s1"], queue_len=4), _Replica("b", "n1", [], queue_len=4)

    async def run():
        rr = _router([a, b])
        turn = _turn("s1")
        routing = asyncio.ensure_future(_placed(rr, turn))
        await asyncio.sleep(0.3)
        asks = a.probes
        a.queue_len = b.queue_len = 0
        return await routing, asks, rr

    placed, asks, rr = asyncio.run(run())
    assert placed == ["a"]
    assert asks >= 2 * STATE_PROBE_ROUNDS, "Serve asked again"
    snap = rr._policy.metrics.snapshot()
    assert snap["num_decisions"] == 1
    assert len(rr._policy._inflight) == 1


def test_a_request_run_elsewhere_than_routed_is_counted():
    """The ingress reports which replica ran a request: one that is not the router's pick (Serve
    went down the ranks) counts in ``overridden``; one that is does not."""
    a, b = _Replica("a", "n0", ["s1"]), _Replica("b", "n1", [])

    async def run():
        rr = _router([a, b])
        t1, t2 = _turn("s1"), _turn("s1")
        assert await _placed(rr, t1) == ["a"]
        assert await _placed(rr, t2) == ["a"]
        return rr, t1.args[0].request_id, t2.args[0].request_id

    rr, r1, r2 = asyncio.run(run())
    report_finished(r1, 96, 8, None, "a")
    report_finished(r2, 0, 8, None, "b")
    snap = rr._policy.metrics.snapshot()
    assert (snap["num_finished"], snap["overridden"]) == (2, 1)
