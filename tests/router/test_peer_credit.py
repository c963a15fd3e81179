"""Crediting the prefill pool with what a decode worker's node holds (``credit_node_state``,
``PrefixIndex.node_holds_point``) and the P/D router that uses them (``disagg.flow`` NOTE 10)."""

from __future__ import annotations

from disagg.router.index import PrefixIndex
from disagg.router.match import MatchResult, credit_node_state
from disagg.router.router import StateAwareRouter
from disagg.router.types import TIER_INDEX, TailProbe, WorkerState
from tests.router.helpers import chain, req, store

BS = 4
NODES = {"p0": "n0", "p1": "n1", "d0": "n1", "d1": "n2"}.get


def _match() -> MatchResult:
    return MatchResult(common_blocks=1, worker_ids=["p0", "p1", "d0"], resumable=[8, 4, 24],
                       tiers=[0, 1, 0], mla_blocks=[2, 1, 6])


def test_credit_same_node_as_host_other_nodes_as_remote_only_with_peer_reads():
    m = _match()
    same_only = credit_node_state(m, {"p0", "p1"}, NODES, "n1", 20, peer_reads=False)
    assert same_only.resumable == [8, 20, 24] and same_only.tiers == [0, TIER_INDEX["host"], 0]
    both = credit_node_state(m, {"p0", "p1"}, NODES, "n1", 20, peer_reads=True)
    assert both.resumable == [20, 20, 24] and both.tiers == [TIER_INDEX["remote"], TIER_INDEX["host"], 0]
    assert m.resumable == [8, 4, 24] and m.tiers == [0, 1, 0]  # the walk's result is left as it was


def test_credit_leaves_longer_own_resumes_and_non_candidates_and_is_identity_when_nothing_changes():
    m = _match()
    assert credit_node_state(m, {"p0"}, NODES, "n1", 8, peer_reads=True) is m  # p0 resumes as much itself
    assert credit_node_state(m, {"p0", "p1"}, NODES, "n1", 0, peer_reads=True) is m  # nothing held
    assert credit_node_state(m, {"p0", "p1"}, NODES, "", 20, peer_reads=True) is m  # no node named
    out = credit_node_state(m, {"p1"}, NODES, "n2", 20, peer_reads=True)
    assert out.resumable == [8, 20, 24]  # p0 is not a candidate; d0 is never one


def _index() -> PrefixIndex:
    idx = PrefixIndex()
    for w, n in (("p0", "n0"), ("d0", "n1"), ("d1", "n1")):
        idx.add_worker(w, n)
    return idx


def test_node_holds_point_needs_the_checkpoint_and_the_last_block_in_the_node_tiers():
    idx, h = _index(), chain(8)
    r = req(h, 8 * BS + 1)
    for x in h:
        store(idx, "mla", x, "device", "d0")
    store(idx, "kda", h[7], "device", "d0")
    assert not idx.node_holds_point(r, 8 * BS, "n1")  # only d0's device holds it: peers cannot read that
    for x in h:
        store(idx, "mla", x, "host", "d1")  # n1's host tier (reported by any worker of the node)
    assert not idx.node_holds_point(r, 8 * BS, "n1")  # the blocks, not the checkpoint
    store(idx, "kda", h[7], "host", "d1")
    assert idx.node_holds_point(r, 8 * BS, "n1")
    assert not idx.node_holds_point(r, 8 * BS, "n0")
    store(idx, "mla", h[7], "host", "d1", op="evicted")  # the context's end went first
    assert not idx.node_holds_point(r, 8 * BS, "n1")
    assert not idx.node_holds_point(r, 0, "n1") and not idx.node_holds_point(r, 12 * BS, "n1")


def test_node_holds_an_unaligned_point_by_its_tail_probe():
    idx, h = _index(), chain(4)
    tail = b"t" * 16
    r = req(h, 4 * BS + 3)
    r.tail_probes.append(TailProbe(3 * BS + 2, tail))
    for x in h:
        store(idx, "mla", x, "disk", "d0")
    assert not idx.node_holds_point(r, 3 * BS + 2, "n1")
    store(idx, "tail", tail, "disk", "d0")
    assert idx.node_holds_point(r, 3 * BS + 2, "n1")


def test_pd_router_sends_a_decode_nodes_session_to_the_pool_with_peer_reads():
    """The decode worker's node holds a session the pool (another node) lost: without peer reads
    the decode worker prefills the suffix itself (``local_state``); with them the pool does,
    predicted to resume the whole held prefix from the remote tier."""
    h = chain(16)
    out = {}
    for peer in (False, True):
        idx = PrefixIndex()
        ws = [WorkerState("p0", "prefill", "n0"), WorkerState("d0", "decode", "n1")]
        for w in ws:
            idx.add_worker(w.worker_id, w.node_id)
        for tier in ("device", "host"):
            for x in h:
                store(idx, "mla", x, tier, "d0")
            store(idx, "kda", h[15], tier, "d0")
        router = StateAwareRouter(idx, {"peer_reads": peer, "decider": {"local_prefill_max_tokens": 0}})
        out[peer] = router.route(req(h, 16 * BS + 30), ws)
    assert out[False].reason.startswith("local_state") and out[False].prefill_worker is None
    assert out[True].reason.startswith("disagg") and out[True].prefill_worker == "p0"
    assert (out[True].predicted_cached_tokens, out[True].source_tier) == (16 * BS, "remote")


def _moved_session(held_on_n1: bool, history: bool):
    """A session whose last turn decoded on d0 (node n1) comes back while d0 is down: the router
    places it on d1 (node n2) and, when n1's host tier holds the prompt, names n1 (router step 4)."""
    h = chain(16)
    idx = PrefixIndex()
    ws = [WorkerState("p0", "prefill", "n0"), WorkerState("d0", "decode", "n1"), WorkerState("d1", "decode", "n2")]
    for w in ws:
        idx.add_worker(w.worker_id, w.node_id)
    router = StateAwareRouter(idx, {"decider": {"local_prefill_max_tokens": 0}})
    if history:
        first = req(h[:8], 8 * BS + 2, rid="r1")
        router.on_routed(first, router.route(first, [ws[0], ws[1]]))
        router.on_finished("r1", 0)
    if held_on_n1:
        for x in h:
            store(idx, "mla", x, "host", "d0")
        store(idx, "kda", h[15], "host", "d0")
    ws[1].healthy = False
    return router.route(req(h, 16 * BS + 30, rid="r2"), ws)


def test_router_names_a_moved_sessions_last_node_when_it_holds_more():
    d = _moved_session(held_on_n1=True, history=True)
    assert d.decode_worker == "d1"
    assert (d.state_node, d.state_position) == ("n1", 16 * BS)
    assert d.predicted_cached_tokens == 0  # the target's own row: the named node is read on top of it


def test_router_names_no_node_without_a_move_or_without_the_state_there():
    assert (_moved_session(held_on_n1=False, history=True).state_node,
            _moved_session(held_on_n1=True, history=False).state_node) == ("", "")
