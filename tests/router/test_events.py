"""The index fed with real kv_transfer ``StoreEvent``s (StateStore + EventLog over tiers)."""

from __future__ import annotations

import pytest

from disagg.router.index import IndexUpdate, PrefixIndex, update_from_event
from disagg.router.types import RouteRequest, TailProbe
from kv_transfer.events import EventLog, StoreEvent
from kv_transfer.keys import ObjectKey, dcp_shard, kda_shard
from kv_transfer.store import StateStore
from kv_transfer.tiers.disk import DiskTier
from kv_transfer.tiers.host import HostTier
from tests.kv_transfer.kvt_util import hasher, make_state, small_layout, tokens

KiB, MiB = 1 << 10, 1 << 20
LAYOUT = small_layout()
H = hasher(LAYOUT)
BS = LAYOUT.block_size  # 16
TOKS = tokens(200)
D = b"\x0a" * 16


def _index() -> PrefixIndex:
    idx = PrefixIndex()
    for w, n in (("w0", "n0"), ("w1", "n0"), ("w2", "n1")):
        idx.add_worker(w, n)
    return idx


def _request(prompt_len: int, tail_at: int | None = None) -> RouteRequest:
    n_full = prompt_len // BS
    probes = [TailProbe(tail_at, H.prefix_digest(TOKS, tail_at))] if tail_at else []
    return RouteRequest("r", "s", H.block_hashes(TOKS[: n_full * BS]), prompt_len, BS, probes)


def _resumable(idx: PrefixIndex, r: RouteRequest) -> dict[str, tuple[int, str | None]]:
    m = idx.match(r, ["w0", "w1", "w2"]).matches
    return {w: (x.resumable_tokens, x.tier) for w, x in m.items()}


@pytest.mark.parametrize(
    "position, prompt_len, tail_at, expect",
    [
        # 2 full blocks + a 5-token tail: the tail probe names the resume point
        (37, 50, 37, {"w0": (37, "host"), "w1": (37, "host"), "w2": (0, None)}),
        # without the probe the index cannot see the unaligned point (no checkpoint at 16 or 32)
        (37, 50, None, {"w0": (0, None), "w1": (0, None), "w2": (0, None)}),
        # aligned checkpoint at 32: blocks h_1, h_2 and kda:h_2
        (32, 50, None, {"w0": (32, "host"), "w1": (32, "host"), "w2": (0, None)}),
        # the checkpoint at the prompt end is not a resume point (a token must be computed)
        (32, 32, None, {"w0": (0, None), "w1": (0, None), "w2": (0, None)}),
    ],
)
def test_store_events_feed_the_index(position, prompt_len, tail_at, expect):
    log = EventLog()
    with HostTier(4 * MiB, slab_bytes=256 * KiB) as host:
        store = StateStore([host], LAYOUT, event_log=log, worker_id="w1")
        store.put_state(TOKS, make_state(LAYOUT, position), H)
        events = log.take()
        assert all(isinstance(e, StoreEvent) and e.kind == "stored" and e.tier == "host" for e in events)
        idx = _index()
        idx.apply_many(events)
        assert (idx.num_events, idx.num_ignored) == (len(events), 0)
        got = _resumable(idx, _request(prompt_len, tail_at))
        assert got == expect
        if got["w1"][0]:  # the index agrees with the store's own answer
            point = store.resumable_length(TOKS[:prompt_len - 1], H)
            assert (point.position, point.slowest_tier) == got["w1"]


def test_demotion_and_promotion_move_the_object_between_tiers(tmp_path):
    log = EventLog()
    host = HostTier(64 * KiB, slab_bytes=64 * KiB, event_log=log, worker_id="n0")  # the node reports its tier
    disk = DiskTier(str(tmp_path), 8 * MiB, segment_bytes=256 * KiB)
    store = StateStore([host, disk], LAYOUT, event_log=log, worker_id="w1")
    idx = _index()
    try:
        store.put_state(TOKS, make_state(LAYOUT, 40), H)
        for p in range(100, 130):  # push the state at 40 out of host memory into the disk tier
            store.put_state(TOKS, make_state(LAYOUT, p, seed=1), H)
        disk.flush()
        events = log.take()
        assert {e.kind for e in events} == {"stored", "evicted", "moved"}
        assert {e.tier for e in events if e.kind == "moved"} == {"disk"}
        idx.apply_many(events)
        r = _request(50, tail_at=40)  # 2 full blocks + an 8-token tail
        point = store.resumable_length(TOKS[:49], H)
        assert (point.position, point.slowest_tier) == (40, "disk")
        assert _resumable(idx, r) == {"w0": (40, "disk"), "w1": (40, "disk"), "w2": (0, None)}
        # loading promotes the pieces back into host ("moved" to host, a copy: disk keeps its own);
        # the one-slab host evicts others meanwhile (demotions): the index follows every move
        assert store.load_state(TOKS, 40, H) is not None
        promoted = log.take()
        assert any(e.kind == "moved" and e.tier == "host" for e in promoted)
        idx.apply_many(promoted)
        point = store.resumable_length(TOKS[:49], H)
        assert _resumable(idx, r)["w1"] == (point.position, point.slowest_tier)
        for h in H.block_hashes(TOKS[:32]):
            key = [str(ObjectKey("mla", h))]
            in_host, in_disk = host.contains(key)[0], disk.contains(key)[0]
            assert idx.tier_masks("mla", h)[1:3] == (0b011 if in_host else 0, 0b011 if in_disk else 0)  # n0's two workers
    finally:
        disk.close()
        host.close()


def _ev(key: str, tier: str = "host", worker: str = "w1", kind: str = "stored", object_kind: str | None = None):
    return StoreEvent(kind, key, key.split(":", 1)[0] if object_kind is None else object_kind, tier, worker)


@pytest.mark.parametrize(
    "event, expect",
    [
        (_ev(str(ObjectKey("mla", D))), IndexUpdate("stored", "mla", D, "host", "w1")),
        (_ev(str(ObjectKey("kda", D, kda_shard(0, 4))), "disk"), IndexUpdate("stored", "kda", D, "disk", "w1")),
        (_ev(str(ObjectKey("kda", D, kda_shard(2, 4)))), None),  # only the first head shard is indexed
        (_ev(str(ObjectKey("tail", D, dcp_shard(0, 2)))), IndexUpdate("stored", "tail", D, "host", "w1")),
        (_ev(str(ObjectKey("mla", D, dcp_shard(1, 2)))), None),
        (_ev(str(ObjectKey("mla", D)), "remote:peer7", kind="moved"), IndexUpdate("moved", "mla", D, "remote", "w1")),
        (_ev("k0", object_kind=""), None),  # not an object key (a raw tier test key)
        (_ev(str(ObjectKey("mla", D)), "gpu-cache"), None),  # a tier the index does not know
        (_ev(str(ObjectKey("mla", D)), worker=""), None),  # no reporter: cannot be attributed
    ],
)
def test_adapter_reads_store_event_fields(event, expect):
    assert update_from_event(event) == expect


@pytest.mark.parametrize(
    "tier, src_holds, expect_raw",
    [  # a "moved" without a source tier: down = demotion out of faster node tiers, up = a copy
        ("disk", ("host",), (0, 0, 0b011, 0)),
        ("remote", ("host", "disk"), (0, 0, 0, -1)),
        ("host", ("disk",), (0, 0b011, 0b011, 0)),
    ],
)
def test_moved_without_source_tier(tier, src_holds, expect_raw):
    idx = _index()
    for t in src_holds:
        idx.apply(_ev(str(ObjectKey("mla", D)), t))
    idx.apply(_ev(str(ObjectKey("mla", D)), tier, kind="moved"))
    assert idx.tier_masks("mla", D) == expect_raw
