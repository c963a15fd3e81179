from __future__ import annotations

import math

import pytest

from disagg.router.context import LOAD_ROW
from disagg.router.index import PrefixIndex
from disagg.router.loads import LoadTracker
from disagg.router.router import StateAwareRouter
from disagg.router.types import WorkerState
from tests.router.helpers import chain, req, store, workers

E1 = 1 - math.exp(-1.0)


def _ws(q: list[int], t: float) -> list[WorkerState]:
    return [WorkerState(f"w{i}", queued_prefill_tokens=x, updated_at=t) for i, x in enumerate(q)]


def _avg(tr: LoadTracker, q: list[int], t: float) -> list[float]:
    return tr.columns(_ws(q, t), t).data[6].tolist()


@pytest.mark.parametrize(
    "observations, expect",
    [
        # queue 100 held for one time constant, then 0 for another
        ([([100, 0], 0.0), ([0, 0], 10.0), ([0, 0], 20.0)], [100 * E1 * math.exp(-1.0), 0.0]),
        ([([100, 0], 0.0), ([0, 0], 10.0)], [100 * E1, 0.0]),
        # a worker first seen later starts from 0
        ([([100], 0.0), ([100, 50], 10.0), ([0, 0], 20.0)], [100 * (1 - math.exp(-2.0)), 50 * E1]),
    ],
)
def test_queue_avg_integrates_the_held_queue(observations, expect):
    tr = LoadTracker(queue_avg_tau_s=10.0)
    got = None
    for q, t in observations:
        got = _avg(tr, q, t)
    assert got == pytest.approx(expect)


def test_routing_adds_to_the_held_queue_and_pending_until_stats_catch_up():
    tr = LoadTracker(prediction_tau_s=5.0, queue_avg_tau_s=10.0)
    tr.columns(_ws([0, 0], 0.0), 0.0)
    tr.on_routed("s1", 80, 50, "w1", "w1", "n0", 0.0)
    cols = tr.columns(_ws([0, 0], 0.0), 0.0)  # stats taken at the same instant: prediction kept
    assert cols.data[0].tolist() == [0.0, 50.0] and cols.data[1].tolist() == [0.0, 80.0]
    cols = tr.columns(_ws([0, 50], 10.0), 10.0)  # fresh stats include it: prediction dropped
    assert cols.data[0].tolist() == [0.0, 50.0]
    assert cols.data[6].tolist() == pytest.approx([0.0, 50 * E1])


def test_queued_requests_are_live_plus_predictions_not_yet_reported():
    """The prefill_requests row: the replica's queued requests, plus each routed request its stats
    do not include yet, weighted as its tokens are (the decode scorer counts them as joiners)."""
    tr = LoadTracker(prediction_tau_s=5.0)
    row = LOAD_ROW["prefill_requests"]
    live = [WorkerState("w0", queued_prefill_requests=2, updated_at=0.0), WorkerState("w1", updated_at=0.0)]
    tr.on_routed("s1", 80, 50, "w1", "w1", "n0", 0.0)
    tr.on_routed("s2", 80, 50, "w1", "w1", "n0", 0.0)
    assert tr.columns(live, 0.0).data[row].tolist() == [2.0, 2.0]
    assert tr.columns(live, 5.0).data[row].tolist() == pytest.approx([2.0, 2 * math.exp(-1.0)])
    fresh = [WorkerState("w0", updated_at=6.0), WorkerState("w1", queued_prefill_requests=1, updated_at=6.0)]
    assert tr.columns(fresh, 6.0).data[row].tolist() == [0.0, 1.0]  # the report includes them: dropped


def test_a_finished_request_takes_its_predictions_with_it():
    """Before any report says so, the router knows a request ended: its predicted prefill and decode
    load go at once, the other requests' stay; a second finish of it changes nothing."""
    tr = LoadTracker(prediction_tau_s=1e9)  # no decay: only on_finished can remove a prediction
    tr.columns(_ws([0, 0], 0.0), 0.0)
    tr.on_routed("s1", 80, 50, "w0", "w1", "n0", 1.0)  # prefill on w0, decode on w1
    tr.on_routed("s2", 30, 20, "w1", "w1", "n0", 1.0)
    cols = tr.columns(_ws([0, 0], 0.0), 2.0)  # stats older than both routings
    assert cols.data[0].tolist() == pytest.approx([50.0, 20.0]) and cols.data[1].tolist() == pytest.approx([0, 110])
    tr.on_finished("w0", "w1", 1.0, 50, 80)
    cols = tr.columns(_ws([0, 0], 0.0), 3.0)
    assert cols.data[0].tolist() == pytest.approx([0, 20.0]) and cols.data[1].tolist() == pytest.approx([0, 30.0])
    tr.on_finished("w0", "w1", 1.0, 50, 80)  # already gone
    tr.on_finished("w1", "w1", 1.0, 20, 30)
    cols = tr.columns(_ws([0, 0], 0.0), 4.0)
    assert cols.data[0].tolist() == [0.0, 0.0] and cols.data[1].tolist() == [0.0, 0.0]


def test_the_router_drops_a_finished_requests_load_before_the_report():
    """``StateAwareRouter.on_finished`` (done or abandoned) drops what ``on_routed`` predicted for it."""
    idx = PrefixIndex()
    ws = [WorkerState("w0", updated_at=0.0), WorkerState("w1", updated_at=0.0)]
    t = [1.0]
    r = StateAwareRouter(idx, clock=lambda: t[0])
    for rid, fin in (("a", 0), ("b", None)):
        q = req(chain(4, rid), sid=rid, rid=rid)  # 17 tokens, none cached
        d = r.route(q, ws)
        r.on_routed(q, d)
        t[0] += 0.5
        loaded = r.effective_loads(ws, t[0])[d.decode_worker]
        assert loaded.prefill_tokens == pytest.approx(17 * math.exp(-0.1))  # decaying with tau 5 s
        assert loaded.decode_tokens == pytest.approx(17 * math.exp(-0.1))
        r.on_finished(rid, fin)
        assert r.effective_loads(ws, t[0])[d.decode_worker].decode_tokens == 0.0


def test_routing_books_the_prefill_area_it_adds():
    tr = LoadTracker()
    tr.columns(_ws([0, 30], 0.0), 0.0)
    tr.on_routed("s1", 120, 100, "w0", "w0", "n0", 0.0)  # 100 uncached tokens on an empty queue
    tr.on_routed("s2", 60, 50, "w1", "w1", "n0", 0.0)  # 50 behind 30 queued
    tr.on_routed("s3", 60, 20, "w1", "w1", "n0", 0.0)  # 20 behind 30 + 50
    cols = tr.columns(_ws([0, 0], 100.0), 100.0)
    assert cols.data[7].tolist() == [100 * 50, 50 * (25 + 30) + 20 * (10 + 80)]  # no decay by default
    tr = LoadTracker(area_tau_s=10.0)
    tr.columns(_ws([0], 0.0), 0.0)
    tr.on_routed("s1", 120, 100, "w0", "w0", "n0", 0.0)
    assert tr.columns(_ws([0], 10.0), 10.0).data[7].tolist() == pytest.approx([5000 * math.exp(-1.0)])


def test_sessions_move_with_their_turns_and_expire():
    tr = LoadTracker(session_ttl_s=10.0)
    tr.on_routed("s1", 1000, 1000, "w0", "w0", "n0", 0.0)
    tr.on_routed("s2", 300, 300, "w0", "w0", "n0", 1.0)
    tr.on_routed("s1", 1200, 200, "w1", "w1", "n0", 2.0)  # s1's next turn ran on w1
    cols = tr.columns(_ws([0, 0], 2.0), 2.0)
    assert cols.data[4].tolist() == [1.0, 1.0] and cols.data[5].tolist() == [300.0, 1200.0]
    assert tr.session("s1").worker_id == "w1"
    cols = tr.columns(_ws([0, 0], 11.5), 11.5)  # s2 (last turn at 1.0) expired, s1 not yet
    assert cols.data[4].tolist() == [0.0, 1.0] and tr.session("s2") is None


@pytest.mark.parametrize("owner_queue, expect", [(0, ("w0", "device")), (12000, ("w1", "host"))])
def test_busy_worker_hands_a_turn_to_its_node_mate(owner_queue, expect):
    """The session's state is on w0's device and on node n0's host tier (shared with w1)."""
    idx, h = PrefixIndex(), chain(8)
    ws = workers(3, per_node=2)  # w0, w1 on n0; w2 on n1
    for w in ws:
        idx.add_worker(w.worker_id, w.node_id)
    for x in h:
        store(idx, "mla", x, "device", "w0")
        store(idx, "mla", x, "host", "w0")
    store(idx, "kda", h[7], "device", "w0")
    store(idx, "kda", h[7], "host", "w0")
    r = StateAwareRouter(idx, clock=lambda: 0.0)
    first = req(h, 33, sid="s", rid="r0")
    r.on_routed(first, r.route(first, ws))  # the session's previous turn: on w0, and done
    r.on_finished("r0", 32)
    ws[0].queued_prefill_tokens = owner_queue
    d = r.route(req(h, 33, sid="s", rid="r1"), ws)
    assert (d.decode_worker, d.source_tier) == expect
    assert d.predicted_cached_tokens == 32 and d.reason == "aggregated/cache_hit"


def test_inbound_decodes_are_live_plus_pool_prefilled_predictions():
    """The inbound_decodes row: what a decode worker reports as on its way to its batch, plus each
    request routed to it with its prefill in the pool that no report includes yet (NOTE 5). A
    request prefilled on its decode worker counts in the prefill rows, not here; inbound tokens
    count in the decode_tokens row."""
    tr = LoadTracker(prediction_tau_s=1e9)
    row, dec = LOAD_ROW["inbound_decodes"], LOAD_ROW["decode_tokens"]
    live = [WorkerState("p0", "prefill", updated_at=0.0),
            WorkerState("d0", "decode", running_decode_tokens=100, inbound_decode_requests=1,
                        inbound_decode_tokens=40, updated_at=0.0),
            WorkerState("d1", "decode", updated_at=0.0)]
    tr.on_routed("s1", 80, 50, "p0", "d1", "n0", 0.0)  # prefilled in the pool: inbound on d1
    tr.on_routed("s2", 30, 30, "d1", "d1", "n0", 0.0)  # prefilled on d1: its queue, not inbound
    cols = tr.columns(live, 0.0)
    assert cols.data[row].tolist() == [0.0, 1.0, 1.0]
    assert cols.data[dec].tolist() == [0.0, 140.0, 110.0]
    assert cols.data[LOAD_ROW["prefill_requests"]].tolist() == [1.0, 0.0, 1.0]
    # d1's next report shows s1 inbound: the prediction goes, the report's count stays
    fresh = [live[0], live[1], WorkerState("d1", "decode", inbound_decode_requests=1, inbound_decode_tokens=80,
                                           updated_at=1.0)]
    cols = tr.columns(fresh, 1.0)
    assert cols.data[row].tolist() == [0.0, 1.0, 1.0] and cols.data[dec].tolist() == [0.0, 140.0, 80.0]
    tr.on_finished("p0", "d1", 0.0, 50, 80)  # gone before a report: nothing left of it
    tr.on_routed("s3", 60, 60, "p0", "d1", "n0", 2.0)
    tr.on_finished("p0", "d1", 2.0, 60, 60)
    assert tr.columns(live, 3.0).data[row].tolist() == [0.0, 1.0, 0.0]


# a request routed at 0.0 to d0, a decode from 2.0, ended at 4.0 (NOTE 6)
_SERVED = (2.0, 4.0)


@pytest.mark.parametrize(
    "report, local, expect",
    [
        # taken while it decoded: one running decode of its 300 prompt tokens (310 with its output)
        (dict(running_decode_requests=2, running_decode_tokens=710, updated_at=3.0), True,
         dict(decode_requests=1.0, decode_tokens=410.0, prefill_requests=0.0, prefill_tokens=0.0)),
        # taken while it queued for its prefill on d0: its uncached tokens and one request
        (dict(queued_prefill_tokens=250, queued_prefill_requests=1, updated_at=1.0), True,
         dict(decode_requests=0.0, decode_tokens=0.0, prefill_requests=0.0, prefill_tokens=0.0)),
        # prefilled in the pool: before its decode it was an inbound decode of its prompt
        (dict(inbound_decode_requests=1, inbound_decode_tokens=300, running_decode_tokens=50,
              running_decode_requests=1, updated_at=1.0), False,
         dict(inbound_decodes=0.0, decode_tokens=50.0, decode_requests=1.0)),
        # a report older than its routing never counted it, one newer than its end no longer does
        (dict(running_decode_requests=1, running_decode_tokens=400, updated_at=-1.0), True,
         dict(decode_requests=1.0, decode_tokens=400.0)),
        (dict(running_decode_requests=1, running_decode_tokens=400, updated_at=4.0), True,
         dict(decode_requests=1.0, decode_tokens=400.0)),
        # the report counted it, but what it shows is less than its rows: each row stops at 0
        (dict(running_decode_requests=1, running_decode_tokens=100, updated_at=3.0), True,
         dict(decode_requests=0.0, decode_tokens=0.0)),
    ],
)
def test_a_report_taken_before_a_request_ended_stops_counting_it(report, local, expect):
    """NOTE 6: a request the router saw end is taken off its decode worker's reports stamped between
    its routing and its end, in the rows the report held it in (prefill queue or inbound before its
    engine counted it as a decode, running decode after); the other worker's figures are untouched."""
    tr = LoadTracker(prediction_tau_s=1e9)
    tr.on_routed("s", 300, 250, "d0" if local else "p0", "d0", "n0", 0.0)
    tr.on_finished("d0" if local else "p0", "d0", 0.0, 250, 300, _SERVED)
    other = WorkerState("d1", running_decode_requests=1, running_decode_tokens=400, updated_at=3.0)
    cols = tr.columns([WorkerState("d0", **report), other], 5.0)
    for name, want in expect.items():
        assert cols.data[LOAD_ROW[name]].tolist() == [want, float(getattr(other, {
            "decode_requests": "running_decode_requests", "decode_tokens": "running_decode_tokens",
            "prefill_requests": "queued_prefill_requests", "prefill_tokens": "queued_prefill_tokens",
            "inbound_decodes": "inbound_decode_requests"}[name]))], name


def test_an_ended_request_is_forgotten_once_a_newer_report_lands():
    """Once d0 reports from after the request's end, an older report can no longer be the one in
    hand, and the request is dropped: a later report that shows a decode counts it in full."""
    tr = LoadTracker(prediction_tau_s=1e9)
    tr.on_routed("s", 300, 300, "d0", "d0", "n0", 0.0)
    tr.on_finished("d0", "d0", 0.0, 300, 300, _SERVED)
    busy = dict(running_decode_requests=1, running_decode_tokens=300)
    assert tr.columns([WorkerState("d0", **busy, updated_at=3.0)], 5.0).data[LOAD_ROW["decode_requests"]][0] == 0
    tr.columns([WorkerState("d0", updated_at=4.5)], 5.0)  # newer than its end: it is forgotten
    assert tr.columns([WorkerState("d0", **busy, updated_at=3.0)], 6.0).data[LOAD_ROW["decode_requests"]][0] == 1
    # and a request that ended without ``served`` (no stamps) is never taken off a report
    tr.on_routed("t", 300, 300, "d0", "d0", "n0", 6.0)
    tr.on_finished("d0", "d0", 6.0, 300, 300)
    assert tr.columns([WorkerState("d0", **busy, updated_at=7.0)], 8.0).data[LOAD_ROW["decode_requests"]][0] == 1


@pytest.mark.parametrize("role", ["both", "decode"])
def test_a_turn_sent_as_its_last_one_answered_stays_with_its_state(role):
    """The serving race NOTE 6 closes: sessions s (on w0) and u (on w1) each ran a turn; the report
    in hand from w0 was taken while s's turn still decoded, and s's next turn is routed right after
    that turn answered. Counted as running, the ended turn priced w0 as a busy batch and the turn
    went to its node mate (a host-tier resume instead of the device), under both the aggregated and
    the P/D decode profile. With the end's stamps it stays on w0."""
    idx = PrefixIndex()
    ws = workers(2, per_node=2, role=role)
    for w in ws:
        idx.add_worker(w.worker_id, w.node_id)
    t = [0.0]
    r = StateAwareRouter(idx, clock=lambda: t[0])
    prompts = {}
    for s, home in (("s", "w0"), ("u", "w1")):
        h = prompts[s] = chain(13, s)
        d = r.route(req(h[:12], 12 * 64 + 1, bs=64, sid=s, rid=f"{s}0"), ws)
        r.on_routed(req(h[:12], 12 * 64 + 1, bs=64, sid=s, rid=f"{s}0"), d)
        assert d.decode_worker == home
        for kind, tier in (("mla", "device"), ("mla", "host"), ("kda", "device"), ("kda", "host")):
            for x in (h[:12] if kind == "mla" else h[11:12]):
                store(idx, kind, x, tier, home)
    r.on_finished("u0", 0, 8, (0.5, 1.0))
    ws[0].running_decode_requests, ws[0].running_decode_tokens = 1, 12 * 64 + 5  # s's turn, at 2.0
    ws[0].updated_at = ws[1].updated_at = 2.0
    t[0] = 3.2
    r.on_finished("s0", 0, 8, (1.5, 3.0))  # decoded from 1.5, answered at 3.0
    assert r.effective_loads(ws, t[0])["w0"].decode_requests == 0
    d = r.route(req(prompts["s"], 13 * 64 + 1, bs=64, sid="s", rid="s1"), ws)
    assert (d.decode_worker, d.source_tier) == ("w0", "device")


@pytest.mark.parametrize("local, report, expect", [
    # stamped a hop before its decode began, the report already counted it as a decode: taken from there
    (True, dict(running_decode_requests=1, running_decode_tokens=300, queued_prefill_tokens=40,
                queued_prefill_requests=0), (0.0, 0.0, 0.0, 40.0)),
    (False, dict(running_decode_requests=1, running_decode_tokens=300), (0.0, 0.0, 0.0, 0.0)),
    # ... or, past its decode's start, still as queued: taken from the queue
    (True, dict(queued_prefill_tokens=250, queued_prefill_requests=1), (0.0, 0.0, 0.0, 0.0)),
])
def test_an_ended_request_is_taken_from_the_state_the_report_holds_it_in(local, report, expect):
    """NOTE 6: the stamps say which state the report held the request in; where the report holds no
    request in that state, it is the other one (a report and a stamp an event-loop hop apart)."""
    tr = LoadTracker(prediction_tau_s=1e9)
    p = "d0" if local else "p0"
    tr.on_routed("s", 300, 250, p, "d0", "n0", 0.0)
    t_report = 1.99 if "queued_prefill_requests" not in report or report["queued_prefill_requests"] == 0 else 2.01
    tr.on_finished(p, "d0", 0.0, 250, 300, _SERVED)
    cols = tr.columns([WorkerState("d0", **report, updated_at=t_report)], 5.0)
    got = tuple(cols.data[LOAD_ROW[f]][0] for f in ("decode_requests", "decode_tokens", "prefill_requests"))
    assert got + (cols.data[LOAD_ROW["prefill_tokens"]][0],) == expect


def test_a_pool_prefilled_request_is_taken_off_the_inbound_row_its_decode_router_did_not_book():
    """Serving's decode-pool router routes a request as if prefilled on its decode worker (its flow
    sends it to the prefill pool); a report taken while it prefilled there held it as an inbound
    decode, and that is where it comes off once it ended (NOTE 6)."""
    tr = LoadTracker(prediction_tau_s=1e9)
    tr.on_routed("s", 300, 300, "d0", "d0", "n0", 0.0)
    tr.on_finished("d0", "d0", 0.0, 300, 300, _SERVED)
    report = WorkerState("d0", inbound_decode_requests=1, inbound_decode_tokens=300, running_decode_requests=1,
                         running_decode_tokens=500, updated_at=1.0)
    cols = tr.columns([report], 5.0)
    assert [cols.data[LOAD_ROW[f]][0] for f in ("inbound_decodes", "decode_tokens", "decode_requests")] == [
        0.0, 500.0, 1.0]
