from __future__ import annotations

import time

import pytest

from disagg.router.index import PrefixIndex
from disagg.router.registry import DEFAULT_PROFILES
from disagg.router.router import StateAwareRouter
from disagg.router.types import RouteRequest, WorkerState
from disagg.tools.sim.simulator import ClusterConfig, Simulator
from disagg.tools.sim.workload import SynthConfig, synth_sessions
from tests.router.helpers import chain, req, store, workers


def _clock():
    t = [0.0]
    return t, (lambda: t[0])


def test_routes_to_cached_worker_and_records_metrics():
    idx, h = PrefixIndex(), chain(8)
    ws = workers(4)
    for x in h:
        store(idx, "mla", x, "device", "w2")
    store(idx, "kda", h[7], "device", "w2")
    r = StateAwareRouter(idx)
    rr = req(h, 33)
    d = r.route(rr, ws)
    assert (d.decode_worker, d.prefill_worker, d.predicted_cached_tokens, d.source_tier) == ("w2", None, 32, "device")
    assert d.reason == "aggregated/cache_hit"
    assert "block_hashes" not in repr(rr) and "b'" not in repr(rr)
    r.on_routed(rr, d)
    r.on_finished(rr.request_id, 30)
    snap = r.metrics.snapshot()
    assert snap["decisions"] == {"aggregated/cache_hit": 1}
    assert (snap["predicted_cached_tokens"], snap["realized_cached_tokens"], snap["overpredicted"]) == (32, 30, 1)


def test_fallback_prefers_next_best_cached_worker():
    idx, h = PrefixIndex(), chain(8)
    ws = workers(4)
    for w, n in (("w1", 8), ("w3", 4)):
        for x in h[:n]:
            store(idx, "mla", x, "device", w)
        store(idx, "kda", h[n - 1], "device", w)
    ws[1].queued_prefill_tokens = 500_000  # best-cached worker overloaded -> guard drops it
    d = StateAwareRouter(idx).route(req(h, 33), ws)
    assert d.decode_worker == "w3" and d.reason == "aggregated/fallback"
    assert d.predicted_cached_tokens == 16


def test_a_document_every_node_reads_goes_where_it_resumes():
    """A shared document's blocks in both nodes' host tiers, its checkpoint on w2's device only: the
    document is no common prefix (index NOTE 8), so the one worker that resumes it wins over idle
    workers that would recompute it, though a short prefill is queued there."""
    idx, h = PrefixIndex(), chain(40)
    ws = workers(4, per_node=2)
    for w in ws:
        idx.add_worker(w.worker_id, w.node_id)
    for w in ("w0", "w2"):  # one reporter per node: each node's host tier holds every block
        for x in h[:32]:
            store(idx, "mla", x, "host", w)
    for x in h[:32]:
        store(idx, "mla", x, "device", "w2")
    store(idx, "kda", h[31], "device", "w2")
    ws[2].queued_prefill_tokens = 64
    m = idx.match(req(h, 40 * 4 + 1), [w.worker_id for w in ws], common_min=3)
    assert [m.matches[w.worker_id].mla_blocks for w in ws] == [32] * 4 and m.common_blocks == 0
    d = StateAwareRouter(idx).route(req(h, 40 * 4 + 1), ws)
    assert (d.decode_worker, d.predicted_cached_tokens, d.reason) == ("w2", 128, "aggregated/cache_hit")


def test_in_flight_predictions_spread_a_burst_then_decay_on_stats():
    t, clock = _clock()
    r = StateAwareRouter(PrefixIndex(), clock=clock)
    ws = workers(4)
    picked = []
    for i in range(4):
        rr = RouteRequest(f"r{i}", f"s{i}", [], 40_000, 256)
        d = r.route(rr, ws)
        r.on_routed(rr, d)
        picked.append(d.decode_worker)
    assert sorted(picked) == ["w0", "w1", "w2", "w3"]  # stats unchanged, predictions spread it
    t[0] = 1.0
    fresh = [WorkerState(w.worker_id, updated_at=1.0) for w in ws]
    loads = r.effective_loads(fresh, 1.0)
    assert all(x.prefill_tokens == 0 for x in loads.values())  # stats newer than the predictions


def test_pd_decider_local_vs_disagg():
    idx, h = PrefixIndex(), chain(64, "pd")
    ws = [WorkerState("p0", "prefill", "n0"), WorkerState("p1", "prefill", "n0"),
          WorkerState("d0", "decode", "n0"), WorkerState("d1", "decode", "n0")]
    for x in h:
        store(idx, "mla", x, "device", "d1")
    store(idx, "kda", h[63], "device", "d1")
    r = StateAwareRouter(idx)
    short = r.route(RouteRequest("a", "s", h, 64 * 256 + 100, 256), ws)
    assert (short.decode_worker, short.prefill_worker) == ("d1", None)
    assert short.reason.startswith("local_short_suffix")
    long = r.route(RouteRequest("b", "t", h[:1], 64 * 256 + 100, 256), ws)
    assert long.prefill_worker in ("p0", "p1") and long.reason.startswith("disagg")


def test_pd_prefills_on_the_decode_worker_that_holds_the_state():
    """The decode worker resumes 16K tokens the prefill pool (another node) lost: local prefill of the rest,
    unless the pool holds them too or the decodes running there would wait longer than the pool computes."""
    idx, h = PrefixIndex(), chain(64, "st")
    ws = [WorkerState("p0", "prefill", "n0"), WorkerState("p1", "prefill", "n0"),
          WorkerState("d0", "decode", "n1"), WorkerState("d1", "decode", "n1")]
    for x in h:
        store(idx, "mla", x, "device", "d1")
    store(idx, "kda", h[63], "device", "d1")
    plen = 64 * 256 + 1000  # suffix 1000 at d1: past the short-suffix limit
    r = StateAwareRouter(idx)
    d = r.route(RouteRequest("a", "s", h, plen, 256), ws)
    assert (d.decode_worker, d.prefill_worker, d.reason) == ("d1", None, "local_state/cache_hit")
    busy = [WorkerState(w.worker_id, w.role, w.node_id, running_decode_requests=20 if w.worker_id == "d1" else 0)
            for w in ws]  # 1000 * (1 + 20) > 17384: the batch would pay more than the pool's recompute
    d = StateAwareRouter(idx).route(RouteRequest("b", "s", h, plen, 256), busy)
    assert d.prefill_worker in ("p0", "p1") and d.reason.startswith("disagg/")
    for x in h:
        store(idx, "mla", x, "device", "p0")
    store(idx, "kda", h[63], "device", "p0")
    d = StateAwareRouter(idx).route(RouteRequest("c", "s", h, plen, 256), ws)
    assert (d.decode_worker, d.prefill_worker) == ("d1", "p0") and d.reason == "disagg/cache_hit"


def test_pd_idle_decode_worker_absorbs_a_queued_pool_until_a_decode_is_on_its_way():
    """d1 and p0 hold the same 16K tokens; p0 has 3,000 tokens queued (p1 more): the pool's path costs
    4,000 >= 4 x the 1,000-token suffix, so an idle d1 prefills locally ("local_idle"). A request routed
    to d1 and not finished makes it not idle (a local prefill would stall that decode) until it ends."""
    idx, h = PrefixIndex(), chain(64, "idle")
    for w in ("d1", "p0"):
        for x in h:
            store(idx, "mla", x, "device", w)
        store(idx, "kda", h[63], "device", w)
    ws = [WorkerState("p0", "prefill", "n0", queued_prefill_tokens=3000),
          WorkerState("p1", "prefill", "n0", queued_prefill_tokens=50_000),
          WorkerState("d0", "decode", "n1", running_decode_requests=2, running_decode_tokens=40_000),
          WorkerState("d1", "decode", "n1")]  # d0 decodes more than a's 17K: the session's turns stay on d1
    plen = 64 * 256 + 1000
    r = StateAwareRouter(idx)
    a = RouteRequest("a", "s", h, plen, 256)
    d = r.route(a, ws)
    assert (d.decode_worker, d.prefill_worker, d.reason) == ("d1", None, "local_idle/cache_hit")
    r.on_routed(a, d)
    d = r.route(RouteRequest("b", "s", h, plen, 256), ws)
    assert (d.decode_worker, d.prefill_worker, d.reason) == ("d1", "p0", "disagg/cache_hit")
    r.on_finished("a", 16384)
    d = r.route(RouteRequest("c", "s", h, plen, 256), ws)
    assert d.reason == "local_idle/cache_hit"
    r.on_routed(RouteRequest("c", "s", h, plen, 256), d)
    r.on_finished("c", None)  # ended without a result (abandoned): d1 is idle again, nothing recorded
    assert r.route(RouteRequest("c2", "s", h, plen, 256), ws).reason == "local_idle/cache_hit"
    assert r.metrics.snapshot()["realized_cached_tokens"] == 16384
    ws[0].queued_prefill_tokens = 2999  # 3,999 < 4,000: the queue does not pay for the local prefill
    assert StateAwareRouter(idx).route(RouteRequest("e", "s", h, plen, 256), ws).reason == "disagg/cache_hit"


def _hot_prompt_run(policy: str, workers_n: int = 8):
    cfg = SynthConfig(num_sessions=48, turns=6, system_tokens=8192, first_user_tokens=2048, think_s=2.0)
    reqs = synth_sessions(cfg, seed=3)
    cluster = ClusterConfig(num_workers=workers_n, workers_per_node=1, host_blocks=0, device_blocks=4096)
    return Simulator(reqs, policy, cluster, lanes=24, seed=3).run()


def test_hot_shared_prompt_stays_balanced_with_high_hit_rate():
    ours = _hot_prompt_run("state_aware")
    pinned = _hot_prompt_run("prefix_affinity")
    assert pinned.summary["max_mean_prefill_work"] > 4.0  # the failure mode: all on one worker
    assert pinned.summary["max_mean_queue"] > 4.0
    # the first-turn area guard balances queued prefill: 1.29 here, where the router learns what sessions
    # generate (1.11 when the simulator tells it each output, Simulator NOTE 9: the decode scorer's share
    # of a first turn's placement follows its expected output); prefill work 1.24 (1.20)
    assert ours.summary["max_mean_queue"] <= 1.35
    assert ours.summary["max_mean_prefill_work"] <= 1.6
    assert ours.summary["hit_vs_theory"] >= 0.9


def test_fallback_keeps_hit_rate_under_stale_stats():
    cfg = SynthConfig(num_sessions=32, turns=6, system_tokens=4096, first_user_tokens=4096, think_s=1.0)
    reqs = synth_sessions(cfg, seed=5)
    cluster = ClusterConfig(num_workers=8, workers_per_node=4, stats_period_s=0.5)
    res = Simulator(reqs, "state_aware", cluster, lanes=32, seed=5).run()
    p2c = Simulator(reqs, "power_of_two", cluster, lanes=32, seed=5).run()
    assert res.summary["hit_vs_theory"] >= 0.95
    assert res.summary["hit_vs_theory"] > p2c.summary["hit_vs_theory"]


def test_decision_latency_with_64_workers():
    idx = PrefixIndex()
    ws = workers(64, per_node=8)
    for w in ws:
        idx.add_worker(w.worker_id, w.node_id)
    for s in range(64):
        h = chain(200, f"sess{s}")
        for x in h:
            store(idx, "mla", x, "device", f"w{s}")
        store(idx, "kda", h[-1], "device", f"w{s}")
    r = StateAwareRouter(idx)
    rr = RouteRequest("q", "sess7", chain(200, "sess7") + chain(300, "x"), 500 * 256, 256)
    r.route(rr, ws)
    t0 = time.thread_time()  # CPU time: a busy machine makes the wall clock, not this, longer
    for _ in range(20):
        d = r.route(rr, ws)
    assert (time.thread_time() - t0) / 20 < 0.02  # ~2-4 ms of CPU per decision here
    assert d.decode_worker == "w7"


class _SeesSession(StateAwareRouter):
    """Records the session worker each decision was given (the affinity scorer's input)."""

    def _run(self, profile, ctx, ws):
        self.session_worker = ctx.session_worker
        return super()._run(profile, ctx, ws)


def _turn(rid: str, session: str, salt: str, seed: str) -> RouteRequest:
    return RouteRequest(rid, session, chain(4, seed), 17, 4, cache_salt=salt)


def test_one_session_id_under_two_tenants_is_two_sessions():
    r = _SeesSession(clock=lambda: 0.0)
    ws = workers(3)
    a = _turn("a1", "chat-1", "tenant-a", "A")
    r.on_routed(a, r.route(a, ws))
    r.route(_turn("b1", "chat-1", "tenant-b", "B"), ws)  # tenant b's first turn
    assert r.session_worker is None
    r.route(_turn("a2", "chat-1", "tenant-a", "A"), ws)
    assert r.session_worker is not None  # tenant a's session is still its own


def test_an_expired_session_gives_no_affinity():
    t = [0.0]
    r = _SeesSession(clock=lambda: t[0])
    ws = workers(3)
    a = _turn("a1", "s1", "", "A")
    r.on_routed(a, r.route(a, ws))
    t[0] = r.loads.session_ttl_s / 2
    r.route(_turn("a2", "s1", "", "A"), ws)
    assert r.session_worker is not None
    t[0] = 5 * r.loads.session_ttl_s  # long past the TTL, with no request routed in between
    r.route(_turn("a3", "s1", "", "A"), ws)
    assert r.session_worker is None


def test_a_session_its_client_ended_stops_counting_once_answered():
    """``RouteRequest.session_end`` (the API's session_end): the session counts on its worker until
    that turn is answered, then not at all; an abandoned last turn (no result) keeps it, as the
    client may send it again; ``end_session`` (a DELETE) forgets at once; a turn without the flag
    changes nothing."""
    from dataclasses import replace

    r = StateAwareRouter(clock=lambda: 0.0)
    ws = workers(3)
    for rid, session, realized, kept in (("e1", "s-end", 5, False), ("e2", "s-gone", None, True),
                                         ("e3", "s-on", 5, True)):
        turn = replace(_turn(rid, session, "t", rid), session_end=session != "s-on")
        r.on_routed(turn, r.route(turn, ws))
        key = f"t\x00{session}"
        assert r.loads.session(key) is not None
        r.on_finished(rid, realized)
        assert (r.loads.session(key) is not None) == kept, session
    r.end_session("t\x00s-on")
    assert r.loads.session("t\x00s-on") is None
    assert sum(r.effective_loads(ws, 0.0)[w.worker_id].active_sessions for w in ws) == 1  # "s-gone" only


def test_pd_decode_placement_charges_a_local_prefill_only_where_the_decider_takes_one():
    """A question on a document the pool's node holds in its host tier (held-out ``rag/pd``): d0, on
    that node, resumes the document and runs 3 decodes; d1, on another node, holds nothing and runs 2.
    Neither would prefill the question locally (its suffix, 1000 tokens at d0, is past the short-suffix
    rule), so the pool prefills it and d1's smaller batch decodes it. Charged on every candidate
    (``harm_everywhere``, rounds 7-44), d1's 17K uncached tokens were priced as a stall of its 2
    decodes that no rule would cause, and d0 took it."""
    idx, h = PrefixIndex(), chain(64, "doc")
    ws = [WorkerState("p0", "prefill", "n0"), WorkerState("d0", "decode", "n0", running_decode_requests=3),
          WorkerState("d1", "decode", "n1", running_decode_requests=2)]
    for w in ws:
        idx.add_worker(w.worker_id, w.node_id)
    for x in h:  # the pool's node host tier (reported by p0: every worker of n0 reads it)
        store(idx, "mla", x, "host", "p0")
    store(idx, "kda", h[63], "host", "p0")
    q = RouteRequest("q", "s", h, 64 * 256 + 1000, 256)
    d = StateAwareRouter(idx).route(q, ws)
    assert (d.decode_worker, d.prefill_worker) == ("d1", "p0") and d.reason.startswith("disagg/")
    everywhere = {"profiles": {"decode": {**DEFAULT_PROFILES["decode"], "scorers": {
        **DEFAULT_PROFILES["decode"]["scorers"], "decode": {"weight": 3.0, "params": {"harm_everywhere": True}}}}}}
    d = StateAwareRouter(idx, config=everywhere).route(q, ws)
    assert (d.decode_worker, d.prefill_worker) == ("d0", "p0")


def test_pd_decode_placement_reads_the_pools_view_the_same_in_both_flows():
    """``harm_pool_view``: a decode candidate is charged a local prefill's stall where any of the
    decider's rules would take the request local there, given the prefill pool's view. d0 resumes
    the session's 16K tokens on its device and runs a decode; the idle pool holds nothing, so the
    1,000-token suffix goes local on d0 by "local_state" (not by the short-suffix rule), and d0 is
    charged; d1 (2 decodes) resumes nothing and is charged nothing. The decode pool's router of
    serving, given the pool's view (step 3c), scores the candidates as the router that sees both
    pools (3b); without a view it charges by the short-suffix rule alone, as with the option off."""
    from disagg.router.metrics import PoolView

    idx, h = PrefixIndex(), chain(64, "sess")
    pool = WorkerState("p0", "prefill", "n0")
    dec = [WorkerState("d0", "decode", "n1", running_decode_requests=1),
           WorkerState("d1", "decode", "n1", running_decode_requests=2)]
    for w in [pool, *dec]:
        idx.add_worker(w.worker_id, w.node_id)
    for x in h:
        store(idx, "mla", x, "device", "d0")
    store(idx, "kda", h[63], "device", "d0")
    q = RouteRequest("q", "s", h, 64 * 256 + 1000, 256)
    view = PoolView([0.0], [float(q.prompt_len)])
    on, off = {"harm_pool_view": True}, {"harm_pool_view": False}
    both = StateAwareRouter(idx, config=on).route(q, [pool, *dec])
    assert both.decode_worker == "d0" and both.prefill_worker is None and both.reason.startswith("local_state/")
    served = StateAwareRouter(idx, config=on).route(q, dec, prefill_nodes={"n0"}, pool_view=view)
    assert served.scores == pytest.approx(both.scores, rel=1e-12)
    blind = StateAwareRouter(idx, config=on).route(q, dec, prefill_nodes={"n0"})  # no view: short suffix only
    assert blind.scores == StateAwareRouter(idx, config=off).route(q, dec, prefill_nodes={"n0"}, pool_view=view).scores
    margin = served.scores["d0"] - served.scores["d1"]  # the scores are relative to the cheapest candidate
    assert margin < blind.scores["d0"] - blind.scores["d1"] - 1e-3
