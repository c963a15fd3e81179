from __future__ import annotations

import numpy as np
import pytest

from disagg.router.context import EffectiveLoad, RoutingContext
from disagg.router.decider import PDDecider
from disagg.router.filters.healthy import HealthyFilter
from disagg.router.filters.load_guard import LoadGuardFilter
from disagg.router.filters.role import RoleFilter
from disagg.router.index import MatchResult, PrefixMatch
from disagg.router.picker import MaxScorePicker
from disagg.router.profile import SchedulingProfile
from disagg.router.registry import build_profile, build_profiles
from disagg.router.scorers.affinity import AffinityScorer
from disagg.router.scorers.load import LoadScorer
from disagg.router.scorers.prefix import PrefixScorer
from disagg.router.scorers.wait import WaitScorer
from disagg.router.types import RouteRequest, WorkerState


def _ctx(matches=None, common=0, loads=None, session=None, node=None, phase="both", prompt_len=101):
    r = RouteRequest("r", "s", [], prompt_len, 4)
    return RoutingContext(r, MatchResult(matches or {}, common), loads or {}, phase, session, node)


W3 = [WorkerState("a", node_id="n0"), WorkerState("b", node_id="n0"), WorkerState("c", node_id="n1")]
PREFIX_CFG = dict(bytes_per_token=1e6, checkpoint_bytes=0.0, prefill_tokens_per_s=1000.0,
                  bandwidth_gbps={"host": 2.0, "disk": 1.0, "remote": 4.0},
                  latency_s={"host": 0.0, "disk": 0.0, "remote": 0.0})


@pytest.mark.parametrize(
    "matches, common, expect",
    [
        # device hit: 80 of 101 tokens
        ({"a": PrefixMatch(80, "device", 20)}, 0, {"a": 80 / 101, "b": 0.0, "c": 0.0}),
        # host: weight 0.85 * (1 - xfer/saved) = 0.85 * (1 - 0.5)
        ({"b": PrefixMatch(80, "host", 20)}, 0, {"a": 0.0, "b": 0.425 * 80 / 101, "c": 0.0}),
        # disk: transfer as slow as recompute -> no credit
        ({"c": PrefixMatch(80, "disk", 20)}, 0, {"a": 0.0, "b": 0.0, "c": 0.0}),
        # remote: 0.4 * (1 - 0.25)
        ({"c": PrefixMatch(40, "remote", 10)}, 0, {"a": 0.0, "b": 0.0, "c": 0.3 * 40 / 101}),
        # common prefix of 5 blocks (20 tokens) earns nothing
        ({"a": PrefixMatch(80, "device", 20), "b": PrefixMatch(20, "device", 5)}, 5,
         {"a": 60 / 81, "b": 0.0, "c": 0.0}),
    ],
)
def test_prefix_scorer(matches, common, expect):
    got = PrefixScorer(**PREFIX_CFG).score(_ctx(matches, common), W3)
    assert got == pytest.approx(expect)


def test_prefix_scorer_rejects_bad_weights():
    with pytest.raises(ValueError):
        PrefixScorer(tier_weights={"device": 1.5})


@pytest.mark.parametrize(
    "loads, expect",
    [
        ({"a": EffectiveLoad(32768, 0, 0, 0.0, 0), "b": EffectiveLoad(0, 262144, 3, 0.5, 4),
          "c": EffectiveLoad(0, 0, 0, 0.0, 0)}, {"a": 1 - 1 / 2.2, "b": 0.5, "c": 1.0}),
        # below the floors, small loads stay small
        ({"a": EffectiveLoad(1638.4, 0, 0, 0.0, 0), "b": EffectiveLoad(0, 0, 0, 0.0, 2),
          "c": EffectiveLoad(0, 0, 0, 1.0, 0)}, {"a": 1 - 0.1 / 2.2, "b": 1 - 0.25 / 2.2, "c": 1 - 0.2 / 2.2}),
    ],
)
def test_load_scorer(loads, expect):
    assert LoadScorer().score(_ctx(loads=loads), W3) == pytest.approx(expect)


@pytest.mark.parametrize(
    "session, node, expect",
    [(None, None, {"a": 0.0, "b": 0.0, "c": 0.0}), ("a", "n0", {"a": 1.0, "b": 0.5, "c": 0.0}),
     ("c", "n1", {"a": 0.0, "b": 0.0, "c": 1.0})],
)
def test_affinity_scorer(session, node, expect):
    assert AffinityScorer().score(_ctx(session=session, node=node), W3) == expect


def test_healthy_and_role_filters():
    ws = [WorkerState("p", "prefill"), WorkerState("d", "decode"), WorkerState("x", "both", healthy=False)]
    assert [w.worker_id for w in HealthyFilter().filter(_ctx(), ws)] == ["p", "d"]
    assert [w.worker_id for w in RoleFilter().filter(_ctx(phase="prefill"), ws)] == ["p", "x"]
    assert [w.worker_id for w in RoleFilter("decode").filter(_ctx(phase="prefill"), ws)] == ["d", "x"]


@pytest.mark.parametrize(
    "q, s, session, expect",
    [
        ([0, 10000, 30000], [0, 0, 0], "a", ["a", "b"]),  # cap = 1.25 * 13333 -> c out
        ([0, 0, 0], [5, 0, 0], None, ["b", "c"]),  # new session: a holds too many sessions
        ([0, 0, 0], [5, 0, 0], "a", ["a", "b", "c"]),  # live session: session guard off
        ([100000, 0, 0], [0, 0, 0], "a", ["b", "c"]),
    ],
)
def test_load_guard(q, s, session, expect):
    loads = {w.worker_id: EffectiveLoad(qq, 0, 0, 0.0, ss) for w, qq, ss in zip(W3, q, s, strict=True)}
    f = LoadGuardFilter(prefill_slack_tokens=0.0, first_turn_guard="sessions")
    assert [w.worker_id for w in f.filter(_ctx(loads=loads, session=session), W3)] == expect


@pytest.mark.parametrize(
    "booked, q, resumable, prompt_len, session, expect",
    [
        # every worker idle and empty: only those where the prompt's own area is least (cached prefix)
        ([0, 0, 0], [0, 0, 0], {"b": 40}, 100, None, ["b"]),
        # a small first turn fits under the largest booked area on a and c, not on b (the max)
        ([10000, 15000, 0], [0, 0, 0], {}, 100, None, ["a", "c"]),
        # a large one only where it raises the max least: c (post 12500) vs a (22500)
        ([10000, 15000, 0], [0, 0, 0], {}, 150, None, ["c"]),
        # the queue it would wait behind counts: n (n / 2 + q) = 100 * (50 + 100) on c
        ([9000, 15000, 0], [0, 0, 100], {}, 100, None, ["a", "c"]),
        ([5000, 20000, 0], [0, 0, 200], {}, 100, None, ["a"]),
        # a live session's turn is not judged by the first-turn guard
        ([10000, 15000, 0], [0, 0, 0], {}, 150, "a", ["a", "b", "c"]),
    ],
)
def test_load_guard_area(booked, q, resumable, prompt_len, session, expect):
    loads = {w.worker_id: EffectiveLoad(qq, booked_area=a) for w, qq, a in zip(W3, q, booked, strict=True)}
    matches = {w: PrefixMatch(c, "device", 0) for w, c in resumable.items()}
    f = LoadGuardFilter(prefill_slack_tokens=1e9)
    ctx = _ctx(matches=matches, loads=loads, session=session, prompt_len=prompt_len)
    assert [w.worker_id for w in f.filter(ctx, W3)] == expect


@pytest.mark.parametrize(
    "busy, expect",
    [
        # c raises the booked area least but decodes another session: a, the idle worker where the
        # turn raises the area least, stays beside it (b would raise it more)
        ({"c": {"decode_requests": 1}}, ["a", "c"]),
        # a prefill queued for c, or one on its way to c's batch from a P/D pool, is as busy
        ({"c": {"prefill_requests": 1}}, ["a", "c"]),
        ({"c": {"inbound_decodes": 1}}, ["a", "c"]),
        # a busy too: b is the idle one
        ({"a": {"inbound_decodes": 1}, "c": {"decode_requests": 2}}, ["b", "c"]),
        # nobody idle: the area rule alone
        ({"a": {"decode_requests": 1}, "b": {"decode_requests": 1}, "c": {"decode_requests": 1}}, ["c"]),
        # the kept worker is idle: nothing added
        ({"a": {"decode_requests": 1}}, ["c"]),
    ],
)
def test_load_guard_area_keeps_an_idle_worker(busy, expect):
    """The area is a long-run balance: it never leaves a first turn only busy workers while one idles."""
    loads = {w.worker_id: EffectiveLoad(0.0, booked_area=a, **busy.get(w.worker_id, {}))
             for w, a in zip(W3, [10000, 15000, 0], strict=True)}
    f = LoadGuardFilter(prefill_slack_tokens=1e9)
    assert [w.worker_id for w in f.filter(_ctx(loads=loads, prompt_len=150), W3)] == expect


def test_load_guard_never_empties():
    loads = {"a": EffectiveLoad(10, 0, 0, 0, 9), "b": EffectiveLoad(5, 0, 0, 0, 9)}
    f = LoadGuardFilter(prefill_ratio=1.0, prefill_slack_tokens=0.0, session_ratio=1.0, session_slack=0.0)
    loads["b"].active_sessions = 100
    assert [w.worker_id for w in f.filter(_ctx(loads=loads), W3[:2])] == ["b"]  # all over a guard: least queued prefill stays


def test_picker_ties_and_epsilon():
    p = MaxScorePicker()
    assert p.pick({"a": 0.5, "b": 0.7, "c": 0.7}, ["a", "b", "c"]) == ["b", "c", "a"]
    picks = {MaxScorePicker(epsilon=0.05, seed=s).pick({"a": 0.70, "b": 0.68, "c": 0.1}, ["a", "b", "c"])[0]
             for s in range(20)}
    assert picks == {"a", "b"}


class _Bad:
    name = "bad"

    def score(self, ctx, workers):
        return {w.worker_id: 1.5 for w in workers}


def test_profile_enforces_range_and_weights():
    prof = SchedulingProfile("t", [], [(_Bad(), 1.0)])
    with pytest.raises(AssertionError, match="bad"):
        prof.run(_ctx(), W3)
    prof = build_profile("t", {"filters": ["healthy"], "scorers": {"affinity": 1, "load": 1}})
    res = prof.run(_ctx(session="c", node="n1"), W3)
    assert res.picked == "c" and res.totals["c"] == pytest.approx(1.0)
    assert res.totals["a"] == pytest.approx(0.5)


def test_registry_rejects_unknown_plugins():
    with pytest.raises(ValueError, match="unknown plugin"):
        build_profile("t", {"scorers": {"nope": 1}})
    with pytest.raises(ValueError, match="unknown keys"):
        build_profile("t", {"scorer": {}})
    assert set(build_profiles()) == {"both", "prefill", "decode"}


@pytest.mark.parametrize(
    "suffix, loads, disagg, reason",
    [
        (1000, [0.0], False, "local_short_suffix"),
        (5000, [0.0, 100.0], True, "disagg"),
        (5000, [70000.0, 80000.0], False, "local_prefill_busy"),
        (50000, [70000.0], True, "disagg"),
        (50000, [], False, "local_no_prefill_pool"),
    ],
)
def test_decider(suffix, loads, disagg, reason):
    d = PDDecider(local_prefill_max_tokens=2048, prefill_busy_tokens=65536, busy_local_max_tokens=8192).decide(
        suffix, loads)
    assert (d.disaggregate, d.reason) == (disagg, reason)


@pytest.mark.parametrize(
    "suffix, loads, uncached, batch, disagg, reason",
    [
        (1000, [0.0, 0.0], [9000.0, 20000.0], 0, False, "local_state"),  # 1000 <= 9000: the pool recomputes
        (1000, [0.0, 0.0], [9000.0, 20000.0], 8, False, "local_state"),  # 1000 * 9 <= 9000
        (1000, [0.0, 0.0], [9000.0, 20000.0], 9, True, "disagg"),  # 1000 * 10 > 9000: the batch pays more
        (1000, [4000.0, 0.0], [6000.0, 9000.0], 8, False, "local_state"),  # pool: min(4000 + 6000, 0 + 9000)
        (1000, [0.0], [1000.0], 0, True, "disagg"),  # the pool resumes as much: no state reason to stay
        (1000, [2000.0], [1000.0], 0, True, "disagg"),  # ... behind a queue that does not quadruple TTFT
        (1000, [3000.0], [1000.0], 0, False, "local_idle"),  # 1000 x 4 <= 3000 + 1000: an idle worker takes it
        (1000, [3000.0], [1000.0], 1, True, "disagg"),  # ... not one running a decode
        (1000, [0.0], None, 0, True, "disagg"),  # the pool's cache unknown (serving's flow): rule off
        (200, [0.0], None, 0, False, "local_short_suffix"),  # 200 <= 256 with nothing running
        (200, [0.0], None, 1, True, "disagg"),  # 200 * 2 > 256: the running decode would wait too
        (5000, [70000.0], None, 0, False, "local_prefill_busy"),  # a busy pool, nothing decoding here
        (4000, [70000.0], None, 1, False, "local_prefill_busy"),  # 4000 * 2 <= 8192 (the default limit)
        (5000, [70000.0], None, 1, True, "disagg"),  # 5000 * 2 > 8192: the running decode weighs in too
    ],
)
def test_decider_weighs_the_decodes_a_local_prefill_stalls(suffix, loads, uncached, batch, disagg, reason):
    d = PDDecider(local_prefill_max_tokens=256, local_harm_weight=1.0).decide(suffix, loads, uncached, batch)
    assert (d.disaggregate, d.reason) == (disagg, reason)
    with pytest.raises(ValueError):
        PDDecider(local_harm_weight=-1.0)


@pytest.mark.parametrize(
    "suffix, loads, uncached, batch, coming, margin, disagg, reason",
    [
        (1000, [3000.0], [1000.0], 0, 0, 4.0, False, "local_idle"),  # idle, and the pool's queue x4 TTFT
        (1000, [3000.0], [1000.0], 0, 1, 4.0, True, "disagg"),  # a decode is on its way: it would stall
        (1000, [3000.0], [1000.0], 0, None, 4.0, False, "local_idle"),  # coming unknown: the running batch
        (1000, [3000.0], [1000.0], 0, 0, 0.0, True, "disagg"),  # margin 0: the rule is off
        (1000, [9000.0], [999.0], 0, 0, 4.0, True, "disagg"),  # the pool resumes more: stay with it
        (1000, [3000.0], None, 0, 0, 4.0, True, "disagg"),  # the pool's cache unknown (serving): off
    ],
)
def test_decider_idle_decode_worker_absorbs_a_queued_pool(suffix, loads, uncached, batch, coming, margin, disagg,
                                                         reason):
    d = PDDecider(local_prefill_max_tokens=256, local_idle_margin=margin).decide(suffix, loads, uncached, batch,
                                                                                   coming)
    assert (d.disaggregate, d.reason) == (disagg, reason)
    with pytest.raises(ValueError):
        PDDecider(local_idle_margin=-1.0)


@pytest.mark.parametrize(
    "first_turn, batch, coming, queued, loads, disagg, reason",
    [
        # a first turn, cold here (9000 > the pool's least uncached 1000), the pool busy (min queue 70000):
        # 9000 x 4 <= 70000 + 1000
        (True, 0, 0, 0.0, [70000.0, 90000.0], False, "local_burst"),
        (False, 0, 0, 0.0, [70000.0, 90000.0], True, "disagg"),  # a later turn: its session's state is in the pool
        (True, 1, 1, 0.0, [70000.0, 90000.0], True, "disagg"),  # a decode runs here
        (True, 0, 0, 4000.0, [70000.0, 90000.0], True, "disagg"),  # a local prefill is queued here already
        (True, 0, 0, 0.0, [60000.0, 90000.0], True, "disagg"),  # one prefill replica is not busy
        # each decode on its way may wait behind it: 9000 x (4 + 3) <= 71000, 9000 x (4 + 4) > 71000
        (True, 0, 3, 0.0, [70000.0, 90000.0], False, "local_burst"),
        (True, 0, 4, 0.0, [70000.0, 90000.0], True, "disagg"),
    ],
)
def test_decider_idle_decode_worker_takes_a_burst_of_first_turns(first_turn, batch, coming, queued, loads, disagg,
                                                                reason):
    """A saturated pool's new sessions go to a decode worker with nothing running or queued, though it
    must compute the prompt the pool would resume: a first turn has no state of its own there to lose."""
    d = PDDecider(local_prefill_max_tokens=256, prefill_busy_tokens=65536, local_idle_margin=4.0).decide(
        9000, loads, [1000.0, 1000.0], batch, coming, first_turn=first_turn, decode_queued=queued)
    assert (d.disaggregate, d.reason) == (disagg, reason)
    assert PDDecider(local_idle_margin=0.0).decide(9000, loads, [1000.0, 1000.0], 0, 0, first_turn=True).disaggregate


@pytest.mark.parametrize(
    "batch, coming, disagg, reason",
    [
        (0, 0, False, "local_state"),  # 1000 <= 9000: nothing to stall
        (0, 8, False, "local_state"),  # 1000 * 9 <= 9000
        (0, 9, True, "disagg"),  # nothing runs yet, but 9 decodes on their way would wait: 1000 * 10 > 9000
        (8, 8, False, "local_state"),  # the running ones are among those coming
        (9, None, True, "disagg"),  # coming unknown: the running batch
        (9, 0, True, "disagg"),  # never fewer than the running batch
    ],
)
def test_decider_local_state_counts_the_decodes_on_their_way(batch, coming, disagg, reason):
    """A local prefill stalls the decodes that join while it runs (routed to the decode worker,
    still in the pool) as much as the running ones."""
    d = PDDecider(local_prefill_max_tokens=256, local_harm_weight=1.0, local_idle_margin=0.0).decide(
        1000, [0.0, 0.0], [9000.0, 20000.0], batch, coming)
    assert (d.disaggregate, d.reason) == (disagg, reason)


def test_decider_defaults_are_the_app_configs():
    """One set of defaults: the decider's are ``disagg.config``'s router settings."""
    from disagg.config import RouterConfig
    from disagg.router.decider import DeciderConfig

    assert DeciderConfig() == DeciderConfig(**RouterConfig().decider_params())
    assert PDDecider().decide(RouterConfig().local_prefill_max_tokens + 1, [0.0]).disaggregate


# ---- wait scorer, new load terms, array fast paths ----------------------------------

WAIT_CFG = dict(prefill_tokens_per_s=100.0, floor_s=0.02)


@pytest.mark.parametrize(
    "matches, q, expect",
    [
        # own = (101 - 80) / 100 = 0.21 s; waits 0, 0.21, 0.42 s
        ({"a": PrefixMatch(80, "device", 20)}, [0, 21, 42], {"a": 1.0, "b": 0.5, "c": 1 / 3}),
        # nothing cached: own = 1.01 s, a waits as long
        ({}, [101, 0, 0], {"a": 0.5, "b": 1.0, "c": 1.0}),
        # own below the floor: 0.02 s
        ({"c": PrefixMatch(100, "host", 25)}, [0, 2, 0], {"a": 1.0, "b": 0.5, "c": 1.0}),
    ],
)
def test_wait_scorer(matches, q, expect):
    loads = {w.worker_id: EffectiveLoad(qq) for w, qq in zip(W3, q, strict=True)}
    got = WaitScorer(**WAIT_CFG).score(_ctx(matches, loads=loads), W3)
    assert got == pytest.approx(expect)


ONLY = dict(prefill_weight=0.0, decode_weight=0.0, cache_weight=0.0, session_weight=0.0)


@pytest.mark.parametrize(
    "params, loads, expect",
    [
        ({"queue_avg_weight": 1.0}, [EffectiveLoad(queue_avg=2048), EffectiveLoad(queue_avg=1024), EffectiveLoad()],
         {"a": 0.0, "b": 0.5, "c": 1.0}),
        ({"queue_avg_weight": 1.0}, [EffectiveLoad(queue_avg=512), EffectiveLoad(), EffectiveLoad()],  # floor 1024
         {"a": 0.5, "b": 1.0, "c": 1.0}),
        ({"session_tokens_weight": 1.0},
         [EffectiveLoad(session_tokens=131072), EffectiveLoad(session_tokens=65536), EffectiveLoad()],
         {"a": 0.0, "b": 0.5, "c": 1.0}),
        ({"queue_avg_weight": 1.0, "decode_weight": 1.0},
         [EffectiveLoad(queue_avg=2048), EffectiveLoad(decode_tokens=262144), EffectiveLoad()],
         {"a": 0.5, "b": 0.5, "c": 1.0}),
    ],
)
def test_load_scorer_session_tokens_and_queue_avg(params, loads, expect):
    ctx = _ctx(loads={w.worker_id: x for w, x in zip(W3, loads, strict=True)})
    assert LoadScorer(**{**ONLY, **params}).score(ctx, W3) == pytest.approx(expect)


@pytest.mark.parametrize(
    "params, loads, expect",
    [
        # running and inbound decodes count alike, as sequences, whatever their context
        ({"requests_weight": 1.0},
         [EffectiveLoad(decode_requests=2), EffectiveLoad(decode_requests=1, inbound_decodes=1), EffectiveLoad()],
         {"a": 0.0, "b": 0.0, "c": 1.0}),
        # one long context against three short ones: the tokens tie, the requests do not
        ({"requests_weight": 1.0, "decode_weight": 1.0},
         [EffectiveLoad(decode_tokens=120000, decode_requests=1),
          EffectiveLoad(decode_tokens=120000, decode_requests=1, inbound_decodes=2), EffectiveLoad()],
         {"a": 1 - (120000 / 262144 + 1 / 3) / 2, "b": 1 - (120000 / 262144 + 1) / 2, "c": 1.0}),
        # below the floor, one decode is not the whole scale
        ({"requests_weight": 1.0, "requests_floor": 4.0},
         [EffectiveLoad(inbound_decodes=1), EffectiveLoad(decode_requests=2), EffectiveLoad()],
         {"a": 0.75, "b": 0.5, "c": 1.0}),
    ],
)
def test_load_scorer_counts_decode_requests(params, loads, expect):
    ctx = _ctx(loads={w.worker_id: x for w, x in zip(W3, loads, strict=True)})
    assert LoadScorer(**{**ONLY, **params}).score(ctx, W3) == pytest.approx(expect)


@pytest.mark.parametrize("prompt_len, expect", [
    (8192, {"a": 0.25, "b": 0.5, "c": 1.0}),  # at the bound: both terms, weighed 1:1
    (8193, {"a": 0.5, "b": 0.0, "c": 1.0}),  # past it: the scorer without the requests term
])
def test_load_scorer_requests_term_applies_up_to_its_prompt_length(prompt_len, expect):
    """Past ``requests_max_prompt_tokens`` the load scorer is the one without the requests term,
    its other weights as they would be without it: a long context is not moved off its state
    for a count of co-runners."""
    loads = {"a": EffectiveLoad(queue_avg=2048, decode_requests=2), "b": EffectiveLoad(queue_avg=4096),
             "c": EffectiveLoad()}
    gated = LoadScorer(**{**ONLY, "queue_avg_weight": 1.0, "requests_weight": 1.0,
                          "requests_max_prompt_tokens": 8192})
    ctx = _ctx(loads=loads, prompt_len=prompt_len)
    assert gated.score(ctx, W3) == pytest.approx(expect)
    if prompt_len > 8192:
        assert gated.score(ctx, W3) == LoadScorer(**{**ONLY, "queue_avg_weight": 1.0}).score(ctx, W3)


@pytest.mark.parametrize("devices, prompt_len, gated", [
    ((65536, 65536, 65536), 8192, False),  # an eighth of the device: the term counts
    ((65536, 65536, 65536), 8193, True),
    ((65536, 32768, 0), 4097, True),  # the smallest reported device bounds it; 0 is unreported
    ((0, 0, 0), 1, True),  # no candidate reports its device: the term stays out
])
def test_load_scorer_requests_term_applies_up_to_a_share_of_the_device(devices, prompt_len, gated):
    """``requests_max_prompt_share`` bounds the term by a share of the smallest device among the
    candidates: what a moved context's second copy takes of a device, not a token count, decides
    (docs/router.md, "Round 29")."""
    workers = [WorkerState(w.worker_id, node_id=w.node_id, device_tokens=d) for w, d in zip(W3, devices, strict=True)]
    loads = {"a": EffectiveLoad(queue_avg=2048, decode_requests=2), "b": EffectiveLoad(queue_avg=4096),
             "c": EffectiveLoad()}
    params = {**ONLY, "queue_avg_weight": 1.0, "requests_weight": 1.0}
    ctx = _ctx(loads=loads, prompt_len=prompt_len)
    got = LoadScorer(**params, requests_max_prompt_share=0.125).score(ctx, workers)
    want = LoadScorer(**{**params, "requests_weight": 0.0} if gated else params).score(ctx, workers)
    assert got == pytest.approx(want)


def test_default_aggregated_profile_counts_decodes_for_prompts_up_to_an_eighth_of_the_device():
    """Aggregated placement's default: two workers carry the same decode tokens, one as three decodes,
    the other as one. A short prompt's load score prefers the single decode; a prompt past an eighth
    of the device (16K of 128K tokens) is scored without the count ("Round 29")."""
    both = [WorkerState("a", node_id="n1", device_tokens=131072), WorkerState("b", node_id="n1", device_tokens=131072)]
    loads = {"a": EffectiveLoad(decode_tokens=60000, decode_requests=3),
             "b": EffectiveLoad(decode_tokens=60000, decode_requests=1)}
    profile = build_profiles()["both"]
    short = profile.run(_ctx(loads=loads, prompt_len=4096), both).per_scorer["load"]
    assert short[1] > short[0]
    long = profile.run(_ctx(loads=loads, prompt_len=16385), both).per_scorer["load"]
    assert long[0] == long[1]


def test_a_bounded_requests_term_alone_puts_no_pressure_past_its_bound():
    ctx = _ctx(loads={"a": EffectiveLoad(decode_requests=2)}, prompt_len=9000)
    only = LoadScorer(**ONLY, requests_weight=1.0, requests_max_prompt_tokens=8192)
    assert only.score(ctx, W3) == {"a": 1.0, "b": 1.0, "c": 1.0}


def test_load_scorer_rejects_a_negative_prompt_bound():
    with pytest.raises(ValueError):
        LoadScorer(requests_weight=1.0, requests_max_prompt_tokens=-1)
    with pytest.raises(ValueError):
        LoadScorer(requests_weight=1.0, requests_max_prompt_share=-0.5)


def test_default_decode_profile_spreads_decodes_by_count_where_tokens_tie():
    """The P/D decode profile's default: two decode workers carry the same decode tokens, one as a
    single long context, the other as three decodes (one running, two on their way from the pool).
    The request joins the single decode: every sequence slows each step ("Round 28")."""
    dec = [WorkerState("a", role="decode", node_id="n1"), WorkerState("b", role="decode", node_id="n1")]
    loads = {"a": EffectiveLoad(decode_tokens=120000, decode_requests=1, inbound_decodes=2),
             "b": EffectiveLoad(decode_tokens=120000, decode_requests=1)}
    res = build_profiles()["decode"].run(_ctx(loads=loads, phase="decode", prompt_len=4096), dec)
    assert res.picked == "b"
    assert res.per_scorer["load"][1] > res.per_scorer["load"][0]


def test_load_scorer_rejects_all_zero_weights():
    with pytest.raises(ValueError):
        LoadScorer(**ONLY)


def test_view_columns_follow_the_candidate_order():
    loads = {"a": EffectiveLoad(1, 2, 3, 0.5, 4, 5, 6), "c": EffectiveLoad(7)}
    ctx = _ctx({"c": PrefixMatch(40, "disk", 10)}, loads=loads)
    v = ctx.view([W3[2], W3[0], W3[1]])
    assert v.worker_ids == ["c", "a", "b"]
    assert v.prefill.tolist() == [7, 1, 0] and v.queue_avg.tolist() == [0, 6, 0]
    assert v.resumable.tolist() == [40, 0, 0] and v.tier.tolist() == [2, -1, -1]
    assert ctx.view([W3[2], W3[0], W3[1]]) is v  # built once per candidate list


class _BadArray:
    name = "bad_array"

    def score_array(self, ctx, workers):
        return np.array([0.5, -0.1, 0.2])

    def score(self, ctx, workers):
        raise AssertionError("the runner uses score_array")


def test_profile_checks_array_scorers_and_ranks_ties_in_order():
    with pytest.raises(AssertionError, match="bad_array"):
        SchedulingProfile("t", [], [(_BadArray(), 1.0)]).run(_ctx(), W3)
    p = MaxScorePicker()
    assert p.rank_array(np.array([0.5, 0.7, 0.7]), ["a", "b", "c"]) == ["b", "c", "a"]


def test_prefix_scorer_few_and_many_earners_score_alike():
    """Up to 4 earning workers are scored in Python floats, more with numpy: the same values, bit for bit."""
    tiers = ["device", "host", "disk", "remote", "host", "device"]
    ws = [WorkerState(f"w{i}", node_id=f"n{i}") for i in range(6)]
    matches = {f"w{i}": PrefixMatch(40 + 7 * i, t, 12) for i, t in enumerate(tiers)}
    scorer = PrefixScorer(bytes_per_token=4608.0, checkpoint_bytes=16e6)
    many = scorer.score_array(_ctx(matches, 2), ws)  # 6 earners: the numpy path
    for i in range(6):  # one earner each: the Python path
        one = scorer.score_array(_ctx({f"w{i}": matches[f"w{i}"]}, 2), ws)
        assert one[i] == many[i] and one.sum() == one[i]
    assert many.tolist() == pytest.approx([scorer.credit(_ctx(matches, 2), w.worker_id) / (101 - 8) for w in ws])


def test_view_is_reused_for_the_same_list_only():
    ctx = _ctx({"c": PrefixMatch(40, "disk", 10)})
    cands = [W3[0], W3[2]]
    v = ctx.view(cands)
    assert ctx.view(cands) is v
    other = [W3[0], W3[1]]  # same length, another last element: another view
    assert ctx.view(other).worker_ids == ["a", "b"]
    assert ctx.view(list(cands)) is v  # an equal list: the per-id cache


@pytest.mark.parametrize("epsilon", [0.0, 0.05])
def test_profile_result_ranking_on_demand_matches_the_picker(epsilon):
    """With a deterministic picker the runner ranks on first access (``picked`` is the first maximum):
    the lazy ranking, the pick and the filtered-out list equal what the picker and filters give eagerly."""
    ws = [WorkerState(f"w{i}", node_id=f"n{i % 3}", healthy=i != 4) for i in range(8)]
    loads = {w.worker_id: EffectiveLoad(queue_avg=1000.0 * ((i + 1) % 3)) for i, w in enumerate(ws)}  # ties
    matches = {"w5": PrefixMatch(60, "device", 15), "w2": PrefixMatch(60, "device", 15)}  # tie between w2, w5
    prof = build_profile("t", {"filters": ["healthy"], "scorers": {"prefix": 1, "load": {
        "weight": 1, "params": {"prefill_weight": 0, "decode_weight": 0, "cache_weight": 0, "session_weight": 0,
                               "queue_avg_weight": 1}}}, "picker": {"max_score": {"epsilon": epsilon}}})
    res = prof.run(_ctx(matches, loads=loads), ws)
    kept = [w.worker_id for w in ws if w.healthy]
    eager = MaxScorePicker().rank({k: res.totals[k] for k in kept}, kept)
    assert res.filtered_out == ["w4"]
    if epsilon == 0:
        assert res.ranked == eager and res.picked == eager[0] == "w2"  # w2 and w5 tie: the earlier one
    else:
        assert sorted(res.ranked) == sorted(eager) and res.picked == res.ranked[0]


def test_decider_short_suffix_rule_over_candidates_matches_decide():
    """``short_suffix`` on arrays (the decode scorer's per-candidate harm) gives what ``decide`` gives
    one candidate at a time (a pool that is idle and whose cache is unknown: only that rule can fire)."""
    import numpy as np

    d = PDDecider(local_prefill_max_tokens=256, local_harm_weight=2.0)
    suffix = np.array([0.0, 50.0, 52.0, 256.0, 257.0, 80.0])
    batch = np.array([5.0, 2.0, 2.0, 0.0, 0.0, 1.0])
    mask = d.short_suffix(suffix, batch)
    one = [not d.decide(int(s), [0.0], None, float(b)).disaggregate for s, b in zip(suffix, batch, strict=True)]
    assert mask.tolist() == one == [True, True, False, True, False, True]


@pytest.mark.parametrize("first_turn", [False, True])
@pytest.mark.parametrize("loads,uncached", [
    ([0.0, 0.0], [4000.0, 6000.0]),  # an idle pool: local_state and local_idle decide
    ([70000.0, 90000.0], [4000.0, 500.0]),  # a busy pool: local_prefill_busy and local_burst too
    ([1000.0, 70000.0], [100.0, 3000.0]),  # a pool that resumes more than any candidate
    ([20000.0, 20000.0], [3000.0, 5000.0]),  # local_idle at a suffix the pool's best equals
])
def test_decider_every_local_rule_over_candidates_matches_decide(first_turn, loads, uncached):
    """``local_mask`` (the decode scorer's harm where the prefill pool's view is known) gives, per
    candidate, what ``decide`` gives one candidate at a time with C_d = B_d, on a grid that makes
    every local rule fire somewhere and somewhere not."""
    import numpy as np

    d = PDDecider(local_prefill_max_tokens=256, local_harm_weight=2.0, busy_local_max_tokens=8192,
                  prefill_busy_tokens=65536, local_idle_margin=4.0)
    grid = [(s, b, q) for s in (0, 90, 300, 999, 2000, 3000, 3999, 4000, 7000, 12000)
            for b in (0, 1, 3) for q in (0, 500)]
    suffix, batch, queued = (np.array(col, dtype=float) for col in zip(*grid, strict=True))
    mask = d.local_mask(suffix, batch, queued, loads, uncached, first_turn)
    one = [d.decide(s, loads, uncached, float(b), first_turn=first_turn, decode_queued=q) for s, b, q in grid]
    assert mask.tolist() == [not p.disaggregate for p in one]
    fired = {p.reason for p in one}
    assert "disagg" in fired and len(fired) >= 3, fired
    if uncached == [3000.0, 5000.0]:
        assert "local_idle" in fired
    if loads[0] > 65536:
        assert "local_prefill_busy" in fired and ("local_burst" in fired) == first_turn
