"""The prefill pool's view for the decode side's P/D decision (``disagg.flow`` NOTE 5).

``StateAwareRequestRouter.pool_view`` runs on the adapter's pure part: a real router with its
real ``PrefixIndex``, fed by replicas' routing-stats reports (device snapshots as real
``BlockHasher`` digests, turn-end tails included), as ``choose_replicas`` is. Serve's replica
records are stand-ins (``SimpleNamespace``: the Serve controller is the system boundary).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from types import SimpleNamespace

import pytest
import torch

import disagg.router.metrics as router_metrics
from deployments.request_router import StateAwareRequestRouter, prefill_pool_view
from disagg.config import load_config
from disagg.engine.async_engine import AsyncEngine
from disagg.engine.factory import build_reference_engine
from disagg.engine.protocol import SamplingParams
from disagg.flow import FlowOptions
from disagg.messages import GenerateParams
from disagg.router.metrics import PoolQuery, PoolView
from kv_transfer.keys import BlockHasher, KeyExtras

BS = 16
H = BlockHasher(BS, KeyExtras("m"))  # what the replicas (model "m", block size BS) digest with
RNG = random.Random(0)
SESSION = [RNG.randrange(1000) for _ in range(4 * BS + 5)]  # a turn end inside block 5
PROMPT = SESSION + [RNG.randrange(1000) for _ in range(30)]  # its next turn: 99 tokens
SALT = "tenant-a"


def _stats(queued: float, sessions: list[list[int]] = (), salt: str = SALT, tails: bool = True,
           model: bool = True, node: str = "n0") -> dict:
    """A prefill replica's routing stats: its load and its device-resident sessions."""
    h = H.with_salt(salt)
    stats = {"role": "prefill", "node_id": node, "time": time.time(), "load": {"queued_prefill_tokens": queued},
             "device_version": 1, "device_sessions": [[d.hex() for d in h.block_hashes(s)] for s in sessions]}
    if tails:
        stats["device_tails"] = [[len(s), h.prefix_digest(s, len(s)).hex()] if len(s) % BS else None
                                 for s in sessions]
    if model:
        stats.update(model_id="m", block_size=BS)
    return stats


def _pending(arg) -> SimpleNamespace:
    """What ``choose_replicas`` reads of Serve's pending request: its argument, its own id, its context."""
    return SimpleNamespace(args=[arg], metadata=SimpleNamespace(internal_request_id=f"serve-{next(_SERVE_IDS)}"),
                           routing_context=SimpleNamespace(should_backoff=False))


_SERVE_IDS = itertools.count()


def _router(reports: list[dict], deployment: str | None = None) -> StateAwareRequestRouter:
    rr = object.__new__(StateAwareRequestRouter)  # its pure part: no Serve controller
    if deployment is not None:
        rr._deployment_id = SimpleNamespace(name=deployment)
    rr.initialize_state()
    rr._replicas = {f"p{i}": SimpleNamespace(replica_id=SimpleNamespace(unique_id=f"p{i}"), routing_stats=stats)
                    for i, stats in enumerate(reports)}
    return rr


def _params(prompt: list[int] = PROMPT, salt: str = SALT, request_id: str = "r") -> GenerateParams:
    return GenerateParams(request_id, prompt, SamplingParams(max_tokens=4), session_id="s", cache_salt=salt)


def _pool() -> StateAwareRequestRouter:
    """p0 holds the session to its turn end, p1 its first two blocks, p2 something else."""
    return _router([_stats(100.0, [SESSION]), _stats(0.0, [SESSION[:2 * BS]]), _stats(50.0, [PROMPT[5:40]])])


def test_the_view_gives_each_replica_its_uncached_tokens_aligned_with_its_load():
    view = _pool().pool_view(PoolQuery(_params()))
    # p0 resumes at the turn end (its tail probe), p1 at its second block, p2 nothing
    assert view == PoolView([100.0, 0.0, 50.0], [30.0, 99.0 - 2 * BS, 99.0])


def test_without_the_reported_turn_end_the_last_full_block_counts():
    rr = _router([_stats(0.0, [SESSION], tails=False)])
    assert rr.pool_view(PoolQuery(_params())) == PoolView([0.0], [99.0 - 4 * BS])


def test_the_view_walks_under_the_requests_salt():
    rr = _pool()
    assert rr.pool_view(PoolQuery(_params(salt=""))).uncached == [99.0, 99.0, 99.0]  # another tenant resumes nothing
    assert rr.pool_view(PoolQuery(_params(salt=SALT))).uncached == [30.0, 67.0, 99.0]


def test_the_view_and_the_prefill_placement_read_the_same_walk():
    rr = _pool()
    params = _params(request_id="placed")
    view = rr.pool_view(PoolQuery(params))
    candidates = list(rr._replicas.values())
    tiers = asyncio.run(rr.choose_replicas(candidates, _pending(params)))
    pick = tiers[0][0].replica_id.unique_id
    rr._policy.on_finished("placed", 0)  # the prediction of the placed request, now counted
    assert rr._policy.metrics.predicted_cached_tokens == len(PROMPT) - view.uncached[int(pick[1:])]


def test_the_view_takes_the_callers_digests_only_in_its_own_key_space():
    rr = _pool()
    own = H.with_salt(SALT)  # the pool's key space for the request (the decode flow's, same model)
    elsewhere = [RNG.randrange(1000) for _ in range(len(PROMPT))]
    # digests of another prompt, passed as this one's: taken as they are (nobody holds them)
    assert rr.pool_view(PoolQuery(_params(list(PROMPT)), own, own.block_hashes(elsewhere))).uncached == [99.0, 99.0, 99.0]
    for other in (BlockHasher(BS, KeyExtras("other-model", cache_salt=SALT)), H.with_salt(""),
                  BlockHasher(2 * BS, KeyExtras("m", cache_salt=SALT))):  # not its key space: hashed again
        view = rr.pool_view(PoolQuery(_params(list(PROMPT)), other, other.block_hashes(elsewhere)))
        assert view.uncached == [30.0, 67.0, 99.0]
    too_few = own.block_hashes(PROMPT)[:-1]
    assert rr.pool_view(PoolQuery(_params(list(PROMPT)), own, too_few)).uncached == [30.0, 67.0, 99.0]


def test_the_placement_after_a_view_reads_the_digests_of_that_view():
    """The prefill placement that follows a "disagg" decision (the same prompt list) hashes nothing again."""
    own = H.with_salt(SALT)
    rr = _router([_stats(0.0, [SESSION]), _stats(0.0, [SESSION])])  # both resume 69 tokens

    def placed(params: GenerateParams, hashes: list[bytes] | None = None) -> int:
        if hashes is not None:
            rr.pool_view(PoolQuery(params, own, hashes))
        asyncio.run(rr.choose_replicas(list(rr._replicas.values()), _pending(params)))
        before = rr._policy.metrics.predicted_cached_tokens
        rr._policy.on_finished(params.request_id, 0)
        return rr._policy.metrics.predicted_cached_tokens - before

    elsewhere = own.block_hashes([RNG.randrange(1000) for _ in range(len(PROMPT))])
    assert placed(_params(request_id="a")) == 69
    assert placed(_params(request_id="b"), elsewhere) == 0  # the view's digests, taken as they are
    assert placed(_params(list(PROMPT), request_id="c")) == 69  # another prompt list: hashed


def test_a_replica_on_the_askers_node_resumes_what_that_nodes_tiers_hold():
    """The decode replica's lookup of its node's shared tiers (host, disk) counts for the prefill
    replicas of that node: they read the same tiers, whose events this router does not drain."""
    rr = _router([_stats(0.0, [SESSION]), _stats(0.0, node="n1"), _stats(0.0, [SESSION[:2 * BS]])])
    assert rr.pool_view(PoolQuery(_params())).uncached == [30.0, 99.0, 67.0]
    assert rr.pool_view(PoolQuery(_params(), node_id="n0", node_resumable=48)).uncached == [30.0, 99.0, 51.0]
    assert rr.pool_view(PoolQuery(_params(), node_id="n0", node_resumable=80)).uncached == [19.0, 99.0, 19.0]
    assert rr.pool_view(PoolQuery(_params(), node_id="n2", node_resumable=80)).uncached == [30.0, 99.0, 67.0]


def test_unknown_cache_and_unknown_pool():
    assert _router([]).pool_view(PoolQuery(_params())) is None  # no replica known
    no_model = _router([_stats(10.0, [SESSION], model=False), _stats(20.0, model=False)])
    assert no_model.pool_view(PoolQuery(_params())) == PoolView([10.0, 20.0], None)  # loads, but no digests yet


def test_the_view_is_registered_for_the_decode_side(monkeypatch):
    monkeypatch.setattr(router_metrics, "POOL_VIEWS", {})
    assert prefill_pool_view("Prefill", PoolQuery(_params())) is None  # before the prefill router exists
    rr = _router([_stats(100.0, [SESSION]), _stats(0.0)], deployment="Prefill")
    assert prefill_pool_view("Prefill", PoolQuery(_params())) == rr.pool_view(PoolQuery(_params())) == PoolView([100.0, 0.0],
                                                                                          [30.0, 99.0])
    assert prefill_pool_view("Decode", PoolQuery(_params())) is None


def test_a_failing_view_leaves_the_decision_without_it():
    """The decode flow decides as with an unknown pool (one idle replica) and serves the request."""
    from disagg.workers.tiered import StatefulWorker

    cfg = load_config({"model": {"name": "tiny"}, "router": {"local_prefill_max_tokens": 64},
                       "engine": {"cache_budget_mb": 64, "num_threads": 1}})
    threads = torch.get_num_threads()
    engine = AsyncEngine(build_reference_engine(cfg))
    try:
        def broken(query):
            raise RuntimeError("index out of step")

        asked = []

        async def refuse(params):  # the remote prefill: recorded, then failed (prefill here)
            asked.append(params.request_id)
            raise ConnectionError("no prefill replica in this test")

        worker = StatefulWorker(engine, None, "decode-0",
                                options=FlowOptions.from_config(cfg, prefill_retries=0), prefill_pool=broken)

        async def run():
            return [c async for c in worker.generate(GenerateParams("r", [5] * 100, SamplingParams(max_tokens=2)),
                                                     refuse)]

        t0 = time.time()
        chunks = asyncio.run(run())
        assert chunks[-1].finished and worker.flow.decisions == {"disagg": 1} and asked == ["r"]
        # the last chunk stamps the decode's start and its end on the replica's clock (routers.loads NOTE 6)
        assert chunks[-1].served is not None and t0 < chunks[-1].served[0] <= chunks[-1].served[1] <= time.time()
        assert all(c.served is None for c in chunks[:-1])
    finally:
        engine.shutdown()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("uncached", [[1.0], [1.0, 2.0, 3.0]])
def test_a_view_whose_rows_do_not_align_is_refused(uncached):
    with pytest.raises(AssertionError, match="aligned"):
        PoolView([0.0, 0.0], uncached)


def test_the_decode_flow_asks_with_its_digests_and_its_nodes_tiers():
    """In process (tiny model, disaggregated, one node's host tier): the decode flow's query for a
    session's next turn carries the prompt's digests in its key space and the turn end its lookup
    found in the node's host tier, published by the first turn."""
    from disagg.launch.inprocess import InProcessBackend

    cfg = load_config({"model": {"name": "tiny"}, "router": {"local_prefill_max_tokens": 64},
                       "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 256, "num_threads": 1},
                       "transfer": {"host": {"capacity_mb": 256, "pin_memory": False}},
                       "deployment": {"mode": "disaggregated"}})
    threads = torch.get_num_threads()
    b = InProcessBackend(cfg)
    asked: list[PoolQuery] = []
    b.decode.flow.prefill_pool = asked.append  # the pool's view: None (one idle replica, cache unknown)
    rng = random.Random(3)
    first = [rng.randrange(4, 260) for _ in range(300)]

    async def send(rid: str, prompt: list[int]):
        return await b.complete(GenerateParams(rid, prompt, SamplingParams(max_tokens=3, ignore_eos=True),
                                               session_id="s", cache_salt=SALT))

    try:
        async def go():
            tokens, _ = await send("t1", first)
            return await send("t2", first + tokens + [rng.randrange(4, 260) for _ in range(100)])

        _, last = asyncio.run(go())
    finally:
        b.shutdown()
        torch.set_num_threads(threads)
    query = asked[-1]
    prompt = query.params.prompt_token_ids
    assert query.params.request_id == "t2" and query.node_id == b.decode.node_id
    assert query.hasher.root == b.decode.hasher.with_salt(SALT).root
    assert query.hashes == query.hasher.block_hashes(prompt)
    # the first turn's end (prompt + outputs but the last), in the host tier; the prefill resumed there
    assert query.node_resumable == len(first) + 2 == last.num_cached_tokens


def test_the_routers_named_node_goes_on_the_request_when_it_names_more():
    """A decision that names another node's state (a moved session's last node, router step 4)
    goes on the request the chosen replica receives; one naming less than the request already
    does (a decode replica's own name, on its way to the prefill pool) leaves it as it was."""
    from disagg.router.types import RouteDecision

    rr = _pool()
    route = rr._policy.route

    def naming(position):
        def decide(req, workers, **kw):
            d = route(req, workers, **kw)
            return RouteDecision(d.request_id, d.decode_worker, d.prefill_worker, d.reason, d.predicted_cached_tokens,
                                 d.source_tier, d.scores, state_node="n7", state_position=position)
        return decide

    for position, have, want in ((64, ("", 0), ("n7", 64)), (32, ("n1", 48), ("n1", 48))):
        rr._policy.route = naming(position)
        params = _params(request_id=f"named-{position}")
        params.state_node, params.state_position = have
        asyncio.run(rr.choose_replicas(list(rr._replicas.values()), _pending(params)))
        assert (params.state_node, params.state_position) == want


def test_the_routers_learned_divergences_go_on_the_request():
    """The Serve router learns where a session's follow-ups diverge (router step 5) from the requests
    it routes and names the distances on each request it places (``GenerateParams.checkpoint_back``);
    before any follow-up it names none and the replica's own placement decides. It also marks a
    session's first turn (``GenerateParams.first_turn``)."""
    rr = _pool()
    replicas = list(rr._replicas.values())
    rng = random.Random(5)
    turn0 = [rng.randrange(1000) for _ in range(20 * BS + 5)]
    turn1 = turn0[: 17 * BS] + [rng.randrange(1000) for _ in range(6 * BS)]  # drops a 3-block tail
    sent = []
    for rid, prompt, session in (("t0", turn0, "s"), ("t1", turn1, "s"), ("o", turn0[:40], "other")):
        params = _params(prompt, request_id=rid)
        params.session_id = session
        asyncio.run(rr.choose_replicas(replicas, _pending(params)))
        sent.append(params)
    assert sent[0].checkpoint_back is None and sent[1].checkpoint_back is None  # nothing learned yet
    assert sent[2].checkpoint_back is not None and sent[2].checkpoint_back[0] == 3 * BS
    # and whether the session is new to the router, which the replica's P/D decider reads ("local_burst")
    assert [p.first_turn for p in sent] == [True, False, True]


def test_a_session_end_goes_to_the_replica_it_names_and_the_router_forgets_the_session(monkeypatch):
    """``SessionEnd`` (``disagg.flow`` NOTE 14): the router publishes its replicas' ids under its
    deployment (the ingress tells each), sends a named end to that replica alone (one not among
    the candidates: any), and stops counting the session on its worker. A ``ToReplica`` call (the
    ingress's stats) goes to its replica the same way."""
    from deployments.request_router import replica_ids
    from disagg.messages import SessionEnd, ToReplica
    from disagg.session import session_key

    monkeypatch.setattr(router_metrics, "REPLICA_IDS", {})
    assert replica_ids("Decode") == []
    rr = _router([_stats(0.0), _stats(0.0), _stats(0.0)], deployment="Decode")
    assert replica_ids("Decode") == ["p0", "p1", "p2"]
    reps = list(rr._replicas.values())
    asyncio.run(rr.choose_replicas(reps, _pending(_params())))  # a turn of session "s"
    key = session_key(SALT, "s")
    assert rr._policy.loads.session(key) is not None
    ranks = asyncio.run(rr.choose_replicas(reps, _pending(SessionEnd("s", SALT, "p1"))))
    assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["p1"]]
    assert rr._policy.loads.session(key) is None
    ranks = asyncio.run(rr.choose_replicas(reps, _pending(SessionEnd("s", SALT, "gone"))))
    assert [len(rank) for rank in ranks] == [3]
    for to, want in ((ToReplica("p2"), [["p2"]]), (ToReplica("gone"), [["p0", "p1", "p2"]]),
                     (ToReplica(), [["p0", "p1", "p2"]])):  # the ingress's stats, one call a replica
        ranks = asyncio.run(rr.choose_replicas(reps, _pending(to)))
        assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == want, to


def test_decode_replicas_tell_the_decode_router_their_prefill_pools_nodes(monkeypatch):
    """A router publishes the nodes its replicas report (``replica_nodes``: what a decode replica
    reports of its prefill pool as ``prefill_nodes``); the decode deployment's router, told them,
    costs a hand-off to a decode replica on a pool node over the host link (``test_pools``: as the
    simulator's router does), so the tie between two idle replicas goes to the one beside the pool.
    The node stores whose events a decode router drains are absent (a system boundary: Ray actors)."""
    from deployments.request_router import NodeEventFeed, replica_nodes

    for registry in ("REPLICA_NODES", "REPLICA_IDS", "POOL_VIEWS"):  # what the named router below publishes
        monkeypatch.setattr(router_metrics, registry, {})
    assert replica_nodes("Prefill") == []
    pool = _router([_stats(0.0, node="n2"), _stats(0.0, node="n0"), _stats(0.0, node="n2"), {"role": "prefill"}],
                   deployment="Prefill")
    assert replica_nodes("Prefill") == ["n0", "n2"]  # one that has not reported a node: not yet
    del pool._replicas["p1"]
    assert replica_nodes("Prefill") == ["n2"]  # read when asked: the router's replicas now

    def decode(node: str, told: list[str] | None) -> dict:
        stats = {"role": "decode", "node_id": node, "time": time.time(), "load": {}, "model_id": "m",
                 "block_size": BS}
        return stats if told is None else {**stats, "prefill_nodes": told}

    def pick(told: list[str] | None) -> str:
        rr = _router([decode("n1", told), decode("n0", told)])  # p0 on n1, p1 beside the pool
        rr._node_events = NodeEventFeed(rr._index, lookup=lambda node: None)  # no node stores (no Ray here)
        tiers = asyncio.run(rr.choose_replicas(list(rr._replicas.values()), _pending(_params())))
        return tiers[0][0].replica_id.unique_id

    assert pick(["n0"]) == "p1"
    assert pick(None) == pick([]) == "p0"  # untold (an older replica, or no prefill sent yet): a tie, the first


def test_max_tokens_is_a_cap_and_a_finished_requests_output_teaches_the_router():
    """The adapter tells the router the API's ``max_tokens`` as a cap, not as the expected output,
    and ``report_finished`` (the ingress, once a request's last chunk arrives) passes the tokens the
    request generated: the session's next turn is expected to answer as this one did."""
    from deployments.request_router import report_finished
    from disagg.session import session_key

    rr = _pool()
    params = GenerateParams("t1", PROMPT, SamplingParams(max_tokens=4096), session_id="s", cache_salt=SALT)
    asyncio.run(rr.choose_replicas(list(rr._replicas.values()), _pending(params)))
    req = rr._route_request(params)
    assert (req.output_len_hint, req.max_output_tokens) == (0, 4096)
    key = session_key(SALT, "s")
    assert rr._policy.outputs.expect(key, cap=4096) == 0.0  # nothing finished: unknown
    live = dict(router_metrics.LIVE_POLICIES)
    router_metrics.LIVE_POLICIES.clear()
    router_metrics.LIVE_POLICIES["pool"] = rr._policy
    try:
        report_finished("t1", 30, 250)
    finally:
        router_metrics.LIVE_POLICIES.clear()
        router_metrics.LIVE_POLICIES.update(live)
    assert rr._policy.outputs.expect(key, cap=4096) == 250.0
    assert rr._policy.outputs.expect(key, cap=100) == 100.0


def test_a_report_taken_before_a_request_ended_stops_counting_it_once_the_ingress_reports_the_end():
    """``report_finished`` puts the replica's wall stamps of the request's decode and end
    (``StreamChunk.served``) on the policy's clock as ``_sync`` puts the replica's report stamp: the
    report taken while the request decoded, before its end, stops counting it (router.loads NOTE 6);
    without the stamps it counts until a newer report lands."""
    from deployments.request_router import report_finished

    for served in (True, False):
        rr = _router([_stats(0.0), _stats(0.0)])
        params = GenerateParams("d1", PROMPT, SamplingParams(max_tokens=4), session_id="s", cache_salt=SALT)
        asyncio.run(rr.choose_replicas(list(rr._replicas.values()), _pending(params)))
        picked = rr._policy._inflight["d1"][2]
        time.sleep(0.01)
        began = time.time()
        time.sleep(0.01)
        stats = rr._replicas[picked].routing_stats
        stats["time"] = time.time()  # taken while it decoded
        stats["load"] = {"running_decode_requests": 1, "running_decode_tokens": len(PROMPT) + 2,
                         "device_tokens": 4096}
        time.sleep(0.01)
        live = dict(router_metrics.LIVE_POLICIES)
        router_metrics.LIVE_POLICIES.clear()
        router_metrics.LIVE_POLICIES["pool"] = rr._policy
        try:
            report_finished("d1", 30, 4, (began, time.time()) if served else None)
        finally:
            router_metrics.LIVE_POLICIES.clear()
            router_metrics.LIVE_POLICIES.update(live)
        workers = [rr._sync(r) for r in rr._replicas.values()]
        assert {w.worker_id: w.device_tokens for w in workers}[picked] == 4096  # what the replica reported
        load = rr._policy.effective_loads(workers, rr._policy.clock())[picked]
        assert (load.decode_requests, load.decode_tokens) == ((0.0, 2.0) if served else (1.0, len(PROMPT) + 2.0))


def test_a_remote_prefills_end_reaches_the_pool_router_of_the_process_that_sent_it():
    """A decode replica tells its process's prefill-pool router each remote prefill's end
    (``prefill_finished``): the router forgets the request (before, every prefill routed from a
    decode replica stayed in its books for the replica's life) and, from the prefill replica's
    stamp (``PrefillHandle.computed_at``), stops counting it in that replica's reports taken
    before its prompt was computed; a failed call (None) is forgotten too."""
    from deployments.request_router import prefill_finished
    from disagg.messages import PrefillHandle

    rr = _router([_stats(0.0), _stats(0.0)], deployment="Prefill")
    sent = []
    for rid in ("a", "b"):
        params = GenerateParams(rid, PROMPT, SamplingParams(max_tokens=4), session_id=rid, cache_salt=SALT)
        asyncio.run(rr.choose_replicas(list(rr._replicas.values()), _pending(params)))
        sent.append(rr._policy._inflight[rid][2])
    time.sleep(0.01)
    for rid in set(sent):  # reports taken while both prefills queued
        stats = rr._replicas[rid].routing_stats
        stats["time"] = time.time()
        stats["load"] = {"queued_prefill_tokens": len(PROMPT) * sent.count(rid),
                         "queued_prefill_requests": sent.count(rid)}
    time.sleep(0.01)
    prefill_finished("Prefill", "a", PrefillHandle(len(PROMPT), 7, 0, "computed", sent[0], "n0",
                                                   computed_at=time.time()))
    prefill_finished("Prefill", "b", None)
    prefill_finished("Decode", "b", None)  # no router of that pool here: nothing to tell
    assert rr._policy._inflight == {}
    loads = rr._policy.effective_loads([rr._sync(r) for r in rr._replicas.values()], rr._policy.clock())
    assert loads[sent[0]].prefill_requests == sent.count(sent[0]) - 1  # "a" is off, "b" failed: counted
    assert loads[sent[0]].prefill_tokens == len(PROMPT) * (sent.count(sent[0]) - 1)


@pytest.mark.parametrize("reads", [True, False])
def test_the_decode_router_places_with_the_prefill_pools_view_of_its_process(monkeypatch, reads):
    """``deployments.request_router`` NOTE 2: a decode pool's router told its prefill deployment
    (``prefill_pool``) asks this process's router of that deployment for the pool's view of the
    request, under the request's digests, before it places, and places with it (the policy's
    ``harm_pool_view``; off: it asks nothing). Serve's replica records are stand-ins."""
    from deployments.request_router import NodeEventFeed

    for registry in ("REPLICA_NODES", "REPLICA_IDS", "POOL_VIEWS"):
        monkeypatch.setattr(router_metrics, registry, {})
    _router([_stats(100.0, [SESSION]), _stats(0.0)], deployment="Prefill")
    asked: list[PoolQuery] = []
    real = router_metrics.POOL_VIEWS["Prefill"]
    router_metrics.POOL_VIEWS["Prefill"] = lambda q: asked.append(q) or real(q)

    decode = {"role": "decode", "node_id": "n1", "time": time.time(), "load": {}, "model_id": "m", "block_size": BS,
              "prefill_nodes": ["n0"]}
    rr = object.__new__(StateAwareRequestRouter)
    rr.initialize_state(policy={"harm_pool_view": reads}, prefill_pool="Prefill")
    rr._replicas = {f"d{i}": SimpleNamespace(replica_id=SimpleNamespace(unique_id=f"d{i}"), routing_stats=decode)
                    for i in range(2)}
    rr._node_events = NodeEventFeed(rr._index, lookup=lambda node: None)  # no node stores (no Ray here)
    seen = []
    route = rr._policy.route
    rr._policy.route = lambda *a, **k: seen.append(k.get("pool_view")) or route(*a, **k)
    asyncio.run(rr.choose_replicas(list(rr._replicas.values()), _pending(_params())))
    if not reads:
        assert asked == [] and seen == [None]
        return
    assert len(asked) == 1 and asked[0].params.prompt_token_ids == PROMPT
    assert asked[0].hashes == H.with_salt(SALT).block_hashes(PROMPT)  # the decode router's digests, not hashed again
    assert seen == [PoolView([100.0, 0.0], [30.0, 99.0])]  # p0 resumes the session to its turn end
