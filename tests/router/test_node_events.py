"""Host-tier events reach the Serve-side router index (``deployments.request_router.NodeEventFeed``).

A real ``NodeStoreActor`` on a local Ray cluster owns the node's host tier; a
replica-side ``StateStore`` (the one ``connect_node_store`` gives a replica)
publishes a session's state into it through shared memory; the feed drains the
actor's event log into the router's ``PrefixIndex``, which must then say that
every worker of that node resumes the session from the host tier.
"""

from __future__ import annotations

import asyncio

import pytest
import ray

from deployments.node_store import connect_node_store, node_store_actor, shutdown_node_stores
from deployments.request_router import NodeEventFeed
from disagg.config import load_config
from disagg.router.index import PrefixIndex
from disagg.router.types import RouteRequest, TailProbe
from tests.kv_transfer.kvt_util import hasher, make_state, small_layout, tokens

pytestmark = pytest.mark.ray
LAYOUT = small_layout()
H = hasher(LAYOUT)
BS = LAYOUT.block_size
TOKS = tokens(200)


@pytest.fixture(scope="module")
def node_id():
    started = not ray.is_initialized()
    if started:
        for attempt in range(2):  # a loaded machine can time the first start out
            try:
                ray.init(address="local", num_cpus=1, include_dashboard=False, namespace="disagg", log_to_driver=False)
                break
            except Exception:
                ray.shutdown()
                if attempt:
                    raise
    try:
        yield ray.get_runtime_context().get_node_id()
    finally:
        shutdown_node_stores()
        if started:
            ray.shutdown()


def _request(prompt_len: int, tail_at: int) -> RouteRequest:
    n_full = prompt_len // BS
    probe = TailProbe(tail_at, H.prefix_digest(TOKS, tail_at))
    return RouteRequest("r", "s", H.block_hashes(TOKS[: n_full * BS]), prompt_len, BS, [probe])


def test_node_store_events_feed_the_router_index(node_id):
    cfg = load_config("deployments/configs/local-cpu.yaml")
    cfg.transfer.host.capacity_mb = 16
    store = connect_node_store(cfg, node_id, LAYOUT)  # what a replica on this node writes through
    idx = PrefixIndex()
    for w, node in (("decode-a", node_id), ("decode-b", node_id), ("elsewhere", "another-node")):
        idx.add_worker(w, node)
    feed = NodeEventFeed(idx)
    feed.watch(node_id)
    asyncio.run(feed.drain())  # whatever earlier users of this node store left behind
    idx_before = idx.match(_request(50, 40), ["decode-a", "decode-b", "elsewhere"]).matches
    assert {w: m.resumable_tokens for w, m in idx_before.items()} == {"decode-a": 0, "decode-b": 0, "elsewhere": 0}

    store.put_state(TOKS, make_state(LAYOUT, 40), H)  # 2 full blocks + an 8-token tail + the checkpoint at 40
    assert asyncio.run(feed.drain()) > 0
    got = idx.match(_request(50, 40), ["decode-a", "decode-b", "elsewhere"]).matches
    assert {w: (m.resumable_tokens, m.tier) for w, m in got.items()} == {
        "decode-a": (40, "host"), "decode-b": (40, "host"), "elsewhere": (0, None)}
    point = store.resumable_length(TOKS[:49], H)  # the store agrees
    assert (point.position, point.slowest_tier) == (40, "host")
    assert asyncio.run(feed.drain()) == 0  # drained: nothing twice
    assert feed.num_events == idx.num_events


def test_feed_waits_for_a_node_store_and_survives_losing_it(node_id):
    idx = PrefixIndex()
    idx.add_worker("decode-a", "no-such-node")
    feed = NodeEventFeed(idx)
    feed.watch("no-such-node")
    assert asyncio.run(feed.drain()) == 0  # no actor for that node: nothing, no error

    cfg = load_config("deployments/configs/local-cpu.yaml")
    cfg.transfer.host.capacity_mb = 16
    actor = node_store_actor(cfg, node_id)
    idx.add_worker("decode-b", node_id)
    feed.watch(node_id)
    asyncio.run(feed.drain())
    ray.kill(actor)  # the node store dies: the feed logs it and looks it up again later
    assert asyncio.run(feed.drain()) == 0
    with pytest.raises(ValueError):
        NodeEventFeed(idx, period_s=0)
