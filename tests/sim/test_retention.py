"""Capacity-aware retention: exact eviction order of demoted objects."""

from __future__ import annotations

import pytest

from disagg.reuse.retention import ResumeAges
from disagg.tools.sim.cache import LRUTier
from disagg.tools.sim.retention import SessionRetention


def _d(i: int) -> bytes:
    return bytes([i]) * 16  # a 16-byte "digest"


def _k(i: int) -> bytes:
    return b"K" + _d(i)


def _evicted(tier: LRUTier, n: int) -> list:
    out = []
    for i in range(n):
        out.extend(tier.put(("filler", i)) or [])
    return out


def test_demote_puts_keys_at_the_eviction_end_last_given_first():
    t = LRUTier("device", 4)
    for k in "abcd":
        t.put(k)
    t.demote(["c", "x", "d"])  # x is not resident: ignored
    assert t.keys() == ["d", "c", "a", "b"]
    assert _evicted(t, 2) == ["d", "c"]


def test_touch_present_refreshes_residents_only():
    t = LRUTier("device", 3)
    for k in "abc":
        t.put(k)
    t.touch_present(["a", "zz"])
    assert t.keys() == ["b", "c", "a"]


def test_lru_policy_changes_nothing():
    t = LRUTier("device", 8)
    for k in (_d(1), _k(1), _k(2)):
        t.put(k)
    r = SessionRetention("lru")
    r.on_prompt(("s", 0), [_d(1)], 1, 0, [t])
    r.on_store(("s", 0), [_k(1), _k(2)], [t])
    r.on_session_end(("s", 0), [t])
    assert t.keys() == [_d(1), _k(1), _k(2)]
    assert r.num_demoted == 0


def test_a_session_keeps_only_its_newest_checkpoints_ahead_of_eviction():
    t = LRUTier("device", 16)
    r = SessionRetention("session", keep_checkpoints=2)
    r.on_prompt(("s", 0), [_d(i) for i in range(4)], 4, 0, [t])
    for i in range(4):
        t.put(_k(i))
    t.put("other")
    r.on_store(("s", 0), [_k(0), _k(1)], [t])  # two stored: nothing to demote yet
    assert t.keys()[0] == _k(0)
    r.on_store(("s", 0), [_k(2), _k(3)], [t])  # K0, K1 are superseded
    assert t.keys()[:2] == [_k(1), _k(0)]
    assert t.keys()[2:] == [_k(2), _k(3), "other"]


def test_shared_prefix_is_never_demoted_and_refreshed_when_found():
    t = LRUTier("device", 32)
    r = SessionRetention("session", keep_checkpoints=1)
    a = [_d(0), _d(1), _d(2)]  # d0, d1: the shared prefix; d2: a's own
    r.on_prompt(("a", 0), a, 3, 0, [t])
    for k in (_d(0), _d(1), _k(1), _d(2), _k(2), "newer"):
        t.put(k)
    r.on_prompt(("b", 0), [_d(0), _d(1), _d(9)], 3, 2, [t])  # b finds d0, d1: shared now, refreshed
    assert t.keys()[-4:] == ["newer", _d(0), _d(1), _k(1)]
    r.on_store(("a", 0), [_k(1), _k(2)], [t])  # K1 is shared: only private ones count
    r.on_session_end(("a", 0), [t])  # a's private blocks go first, the end of its context first
    assert t.keys()[:2] == [_k(2), _d(2)]
    assert set(t.keys()[2:]) == {"newer", _d(0), _d(1), _k(1)}


@pytest.mark.parametrize("policy", ["checkpoints", "session", "lru"])
def test_speculative_points_go_first_unless_shared(policy):
    """A prefill's start-prior points (K1, K2) go first in the tiers named; K0 sits on a prefix
    another session started with (shared) and stays; policy "lru" tracks nothing and moves nothing."""
    host = LRUTier("host", 16)
    r = SessionRetention(policy)
    r.on_prompt(("a", 0), [_d(0), _d(1), _d(2)], 3, 0, [host])
    r.on_prompt(("b", 0), [_d(0), _d(7)], 2, 1, [host])  # b starts with a's d0: shared
    for k in (_k(0), _k(1), _k(2), "newer"):
        host.put(k)
    r.on_speculative([_k(0), _k(1), _k(2)], [host, None])
    if policy == "lru":
        assert host.keys() == [_k(0), _k(1), _k(2), "newer"]
    else:
        assert host.keys() == [_k(2), _k(1), _k(0), "newer"]
        assert _evicted(host, 14) == [_k(2), _k(1)], "kept while there is room, then first to go"


def test_session_end_demotes_tail_first_and_forgets_the_session():
    t = LRUTier("device", 32)
    r = SessionRetention("session")
    ds = [_d(i) for i in range(3)]
    r.on_prompt(("s", 0), ds, 3, 0, [t])
    for d in ds:
        t.put(d)
    t.put("live")
    r.on_session_end(("s", 0), [t])
    assert t.keys() == [_d(2), _d(1), _d(0), "live"]
    r.on_session_end(("s", 0), [t])  # a second end is a no-op
    assert t.keys() == [_d(2), _d(1), _d(0), "live"]


def test_a_moved_session_leaves_its_old_device_copy_first_in_line():
    """A turn stored on other devices than the last: the session's private objects on the devices it
    left are stale duplicates (shared ones stay); the devices it is on now are untouched."""
    old, new, pool = LRUTier("device", 16), LRUTier("device", 16), LRUTier("device", 16)
    r = SessionRetention("session", keep_checkpoints=4)
    r.on_prompt(("a", 0), [_d(0)], 1, 0, [old, new, pool])
    r.on_prompt(("s", 0), [_d(0), _d(1), _d(2)], 3, 1, [old, new, pool])  # d0 is shared (a's)
    for t in (old, new, pool):
        for k in (_d(0), _d(1), _d(2), _k(2), "other"):
            t.put(k)
    r.on_store(("s", 0), [_k(2)], [old, new, pool])
    r.on_placed(("s", 0), [pool, old])  # prefilled on pool, decoded on old: nothing left yet
    assert old.keys() == new.keys() == pool.keys() == [_d(0), _d(1), _d(2), _k(2), "other"]
    r.on_placed(("s", 0), [pool, new])  # the next turn decodes on new: old's private copy goes first
    assert old.keys() == [_k(2), _d(2), _d(1), _d(0), "other"]  # the end of its context first
    assert new.keys() == pool.keys() == [_d(0), _d(1), _d(2), _k(2), "other"]
    r.on_session_end(("s", 0), [old, new, pool])
    before = [t.keys() for t in (old, new, pool)]
    r.on_placed(("s", 0), [old])  # a session that ended is not tracked any more
    assert [t.keys() for t in (old, new, pool)] == before


def test_checkpoints_policy_does_what_serving_does_and_no_more():
    """Policy "checkpoints" (the CLI's default, serving's behaviour): superseded checkpoints go first,
    and a hand-off to another node demotes the session's private objects in the prefill node's
    tiers, checkpoints and MLA blocks (the decode side demotes the blocks after its load,
    ``disagg.flow`` NOTE 12); a session's end and a move demote nothing (serving is not told of
    either)."""
    t, other = LRUTier("host", 16), LRUTier("device", 16)
    r = SessionRetention("checkpoints", keep_checkpoints=1)
    ds = [_d(i) for i in range(3)]
    r.on_prompt(("s", 0), ds, 3, 0, [t, other])
    for k in (*ds, _k(1), _k(2), "live"):
        t.put(k)
        other.put(k)
    r.on_store(("s", 0), [_k(1)], [t, other])
    r.on_store(("s", 0), [_k(2)], [t, other])  # the next turn's K2 supersedes K1
    assert t.keys() == [_k(1), *ds, _k(2), "live"]
    r.on_placed(("s", 0), [other])
    r.on_placed(("s", 0), [LRUTier("device", 4)])  # moved off `other`: nothing demoted there
    assert other.keys() == [_k(1), *ds, _k(2), "live"]
    r.on_handed_off(("s", 0), [t])  # its checkpoints and blocks, the end of its context first
    handed = [_k(2), _k(1), *ds[::-1], "live"]
    assert t.keys() == handed
    r.on_session_end(("s", 0), [t])  # forgotten, nothing demoted
    assert t.keys() == handed
    r.on_store(("s", 0), [_k(5), _k(6)], [t])  # a session that ended is not tracked any more
    assert t.keys() == handed


def test_a_session_its_client_ended_goes_first_under_serving_retention():
    """Policy "checkpoints" with ``client_ends`` (clients send ``session_end``, ``disagg.flow``
    NOTE 13): an ended session's private objects go first, the end of its context first, and
    what it shares stays; a second end is a no-op."""
    t = LRUTier("host", 32)
    r = SessionRetention("checkpoints", client_ends=True)
    r.on_prompt(("a", 0), [_d(0)], 1, 0, [t])
    ds = [_d(0), _d(1), _d(2)]
    r.on_prompt(("s", 0), ds, 3, 1, [t])  # d0 is a's: shared
    for k in (*ds, "live"):
        t.put(k)
    r.on_session_end(("s", 0), [t])
    assert t.keys() == [_d(2), _d(1), _d(0), "live"]
    r.on_session_end(("s", 0), [t])
    assert t.keys() == [_d(2), _d(1), _d(0), "live"]


def test_bad_configuration():
    with pytest.raises(ValueError):
        SessionRetention("mru")
    with pytest.raises(ValueError):
        SessionRetention("session", keep_checkpoints=0)
    with pytest.raises(ValueError):
        SessionRetention("lru", client_ends=True)  # nothing tracks sessions


def test_session_ends_raise_the_hit_under_serving_retention():
    """The run of the test below under policy "checkpoints": with clients that say when their
    sessions end, ended sessions stop crowding out live ones and the hit rises; an LRU retention
    cannot take the signal (nothing tracks sessions). Written through: victim host tiers (the
    default) keep the devices' sessions besides the host tier's, and on this run the signal
    then moves nothing (the same hit, 0.737, with and without it)."""
    from disagg.tools.bench.family import SUITE, member_trace
    from disagg.tools.sim.driver import ReplayConfig
    from disagg.tools.sim.simulator import ClusterConfig, Simulator
    from disagg.tools.sim.workload import from_trace_records

    reqs = from_trace_records(member_trace(SUITE["long_agentic"], 8, block_size=64, scale=0.25), 64)
    hits = {}
    for ends in (False, True):
        cluster = ClusterConfig(num_workers=2, device_blocks=256, host_blocks=2048, retention="checkpoints",
                                session_ends=ends, host_write="through")
        res = Simulator(reqs, "dynamo_cost", cluster, replay=ReplayConfig(concurrency=4, think_scale=0.25)).run()
        assert res.summary["requests"] == len(reqs)
        hits[ends] = res.summary["hit_rate"]
    assert hits[True] > hits[False], hits
    with pytest.raises(ValueError):
        ClusterConfig(num_workers=2, retention="lru", session_ends=True)
    with pytest.raises(ValueError):
        ClusterConfig(num_workers=2, retention="checkpoints", session_end_after=True)  # after what?


def test_session_retention_raises_the_hit_under_capacity_pressure():
    """Long sessions on two small workers: superseded checkpoints no longer crowd out live sessions.

    A baseline router places the requests, so the tiers' policy is what the test compares.
    Written through, as the test above.
    """
    from disagg.tools.bench.family import SUITE, member_trace
    from disagg.tools.sim.driver import ReplayConfig
    from disagg.tools.sim.simulator import ClusterConfig, Simulator
    from disagg.tools.sim.workload import from_trace_records

    reqs = from_trace_records(member_trace(SUITE["long_agentic"], 8, block_size=64, scale=0.25), 64)
    hits = {}
    for policy in ("lru", "checkpoints", "session"):
        cluster = ClusterConfig(num_workers=2, device_blocks=256, host_blocks=2048, retention=policy,
                                host_write="through")
        res = Simulator(reqs, "dynamo_cost", cluster, replay=ReplayConfig(concurrency=4, think_scale=0.25)).run()
        assert res.summary["requests"] == len(reqs)
        hits[policy] = res.summary["hit_rate"]
    assert hits["session"] > hits["lru"] + 0.1, hits
    assert hits["checkpoints"] > hits["lru"] + 0.1, hits  # most of it is the superseded checkpoints


def test_a_borrowed_turn_leaves_the_prefill_tiers_first_in_line():
    """A prefill that read the session from its decode worker's node (a peer read) stored the turn's
    checkpoints in its own tiers for the hand-off: the private ones go first there; a shared
    checkpoint (on another session's prefix) stays, and nothing happens for an unknown session."""
    dev, host = LRUTier("device", 16), LRUTier("host", 16)
    r = SessionRetention("session", keep_checkpoints=4)
    r.on_prompt(("a", 0), [_d(0)], 1, 0, [dev, host])
    r.on_prompt(("s", 0), [_d(0), _d(1), _d(2)], 3, 1, [dev, host])  # d0 is shared (a's)
    for t in (dev, host):
        for k in (_d(0), _k(0), _d(1), _d(2), _k(2), "other"):
            t.put(k)
    r.on_borrowed(("s", 0), [_k(0), _k(2)], [dev, host, None])
    assert dev.keys() == host.keys() == [_k(2), _d(0), _k(0), _d(1), _d(2), "other"]
    r.on_borrowed(("x", 0), [_k(1)], [dev, host])
    assert dev.keys() == [_k(2), _d(0), _k(0), _d(1), _d(2), "other"]


def test_a_turn_handed_to_another_node_leaves_the_prefill_node_tiers_first_in_line():
    """A turn went to a decode worker on another node, which stored it: the session's private
    objects in the prefill node's shared tiers go first (its shared prefix stays), end first;
    an unknown session, or the "lru" policy, changes nothing."""
    host, disk = LRUTier("host", 16), LRUTier("disk", 16)
    r = SessionRetention("session")
    r.on_prompt(("a", 0), [_d(0)], 1, 0, [host])
    r.on_prompt(("s", 0), [_d(0), _d(1), _d(2)], 3, 1, [host])  # d0 is shared (a's)
    for t in (host, disk):
        for k in (_d(0), _k(0), _d(1), _k(1), _d(2), "other"):
            t.put(k)
    r.on_handed_off(("x", 0), [host, disk])
    assert host.keys()[0] == _d(0)
    r.on_handed_off(("s", 0), [host, None, disk])
    assert host.keys() == disk.keys() == [_d(2), _k(1), _d(1), _d(0), _k(0), "other"]
    for policy, order in (("lru", [_d(1), _d(2)]), ("session", [_d(2), _d(1)])):
        t = LRUTier("host", 8)
        t.put(_d(1))
        t.put(_d(2))
        other = SessionRetention(policy)
        other.on_prompt(("s", 0), [_d(1), _d(2)], 2, 0, [t])
        other.on_handed_off(("s", 0), [t])
        assert t.keys() == order, policy


def test_the_cli_takes_session_ends_and_refuses_it_without_sessions_tracked(capsys):
    """``disagg sim run --session-ends`` runs under the default retention; with ``--retention lru``
    it is a one-line error, not a traceback."""
    import json

    from disagg.tools.sim.cli import main

    for how in ([], ["turn"], ["after"]):
        assert main(["sim", "run", "--sessions", "4", "--turns", "3", "--workers", "2", "--session-ends", *how,
                     "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert (rows if isinstance(rows, list) else [rows])[0]["requests"] == 12
    with pytest.raises(SystemExit):  # argparse: not one of turn, after
        main(["sim", "run", "--sessions", "4", "--session-ends", "later"])
    with pytest.raises(SystemExit, match="--session-ends needs --retention"):
        main(["sim", "run", "--sessions", "4", "--turns", "3", "--retention", "lru", "--session-ends"])


@pytest.mark.parametrize("pd", [False, True])
def test_a_last_turn_its_client_marked_writes_nothing_through_to_the_host(pd):
    """Serving's flow publishes no turn end for a turn marked ``session_end`` (Simulator NOTE 7):
    the last turn's new blocks never reach the host tier of the node that serves it (the decode
    node, in P/D), while every earlier turn's do; a P/D hand-off still publishes on the prefill
    node. Without the signal, or when clients end the session only after the last turn's answer
    (``session_end_after``: DELETE /v1/sessions/{id}), the last turn is written through like the
    others."""
    from disagg.tools.sim.driver import ReplayConfig
    from disagg.tools.sim.simulator import ClusterConfig, Simulator
    from disagg.tools.sim.workload import SimRequest

    bs = 64
    turns = [SimRequest("s", 0, 0.0, 0.0, 4 * bs, 8, list(range(1, 5)), bs),
             SimRequest("s", 1, 10.0, 0.0, 8 * bs, 8, list(range(1, 9)), bs)]
    for ends, after in ((False, False), (True, False), (True, True)):
        shape = dict(num_prefill=1, num_decode=1, workers_per_node=1) if pd else dict(num_workers=1)
        cluster = ClusterConfig(**shape, device_blocks=64, host_blocks=256, retention="checkpoints",
                                session_ends=ends, session_end_after=after)
        sim = Simulator(turns, "round_robin", cluster, replay=ReplayConfig(concurrency=1))
        res = sim.run()
        assert res.summary["requests"] == 2
        rec = sim.records[-1]
        assert rec.last_turn and not sim.records[0].last_turn
        digests = sim.digests.digests("s", rec.salt, list(range(1, 9)), 8)
        serving = sim.host[sim.workers[rec.decode_worker].node_id]
        held = serving.present(digests)
        assert held[:3] == [True] * 3, held  # the first turn's full blocks: its turn end was written
        assert held[4:] == [not ends or after] * 4, (ends, after, held)  # the last turn's own blocks
        if pd:  # the hand-off published on the prefill node, demoted there but still readable
            assert sim.host[sim.workers[rec.prefill_worker].node_id].present(digests[4:]) == [True] * 4


def test_speculative_first_demotes_a_local_prefills_start_points_in_the_simulator():
    """``ClusterConfig.speculative_first`` (serving's ``transfer.host.speculative_first``): the same
    run demotes more (its prefills' start-prior points), places the same first turns, and by
    default demotes none of them."""
    from dataclasses import replace

    from disagg.tools.sim.simulator import ClusterConfig, Simulator
    from disagg.tools.sim.workload import SynthConfig, synth_sessions

    reqs = synth_sessions(SynthConfig(num_sessions=24, turns=3), seed=2)
    base = ClusterConfig(num_workers=4, workers_per_node=2, learned_checkpoints=True, checkpoint_every_blocks=0,
                         retention="checkpoints")
    off = Simulator(reqs, "state_aware", base, lanes=8, seed=1)
    a = off.run()
    on = Simulator(reqs, "state_aware", replace(base, speculative_first=True), lanes=8, seed=1)
    b = on.run()
    assert on.retention.num_demoted > off.retention.num_demoted
    firsts = lambda res: [(r.session_id, r.decode_worker) for r in res.records if r.turn == 0]  # noqa: E731
    assert firsts(a) == firsts(b)


def test_a_turn_never_supersedes_its_own_points_under_serving_retention():
    """As serving's (``disagg.reuse.retention`` NOTE 4): a turn that stores more private points than
    keep_checkpoints keeps them all; the next turn's store demotes them. Policy "session" (rounds
    1-13) lets the newest points of one store supersede the others, as it always did."""
    for policy, first in (("checkpoints", []), ("session", [_k(0), _k(1)])):
        t = LRUTier("host", 16)
        r = SessionRetention(policy, keep_checkpoints=1)
        r.on_prompt(("s", 0), [_d(i) for i in range(4)], 4, 0, [t])
        for i in range(4):
            t.put(_k(i))
        r.on_store(("s", 0), [_k(0), _k(1), _k(2)], [t])
        assert t.keys()[: len(first)] == first[::-1] and r.num_demoted == len(first), policy
        r.on_store(("s", 0), [_k(3)], [t])
        assert set(t.keys()[:3]) == {_k(0), _k(1), _k(2)} and t.keys()[3] == _k(3), policy


@pytest.mark.parametrize("keep_turns", [1, 2, "auto"])
def test_turns_older_than_the_newest_few_go_first(keep_turns):
    """``keep_turns`` (serving's ``transfer.host.keep_turns``): four turns of one point each under
    keep_checkpoints 8; a limit of N turns demotes every turn but the newest N. "auto" learns the
    limit from how far back the session's prompts reach: each prompt extends the last one, so it
    reaches its latest turn only, and after the learner's warm-up the limit is one turn."""
    t = LRUTier("host", 32)
    r = SessionRetention("checkpoints", keep_checkpoints=8, keep_turns=keep_turns)
    if keep_turns == "auto":  # a limit of one turn once one prompt of a session with two turns was seen
        r.ages = ResumeAges(min_resumes=1)
    ds = [_d(i) for i in range(5)]
    for turn in range(4):
        r.on_prompt(("s", 0), ds[: turn + 2], turn + 2, 0, [t])
        t.put(_k(turn))
        r.on_store(("s", 0), [_k(turn)], [t])
    keep = 1 if keep_turns == "auto" else keep_turns
    assert r.turns() == keep
    # each demoted at the store it fell out at: the last demoted is the first evicted
    assert t.keys() == [_k(i) for i in range(4 - keep)][::-1] + [_k(i) for i in range(4 - keep, 4)]
    assert SessionRetention("checkpoints").turns() == 0  # the default: no limit
    with pytest.raises(ValueError):
        SessionRetention("checkpoints", keep_turns=-2)
