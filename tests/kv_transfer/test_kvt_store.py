from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvt_util import hasher, make_state, small_layout, states_equal, tokens

from kv_transfer.dcp import split_dcp
from kv_transfer.events import EventLog
from kv_transfer.keys import ObjectKey, kda_shard
from kv_transfer.objects import ResumeState
from kv_transfer.store import StateStore
from kv_transfer.tiers.disk import DiskTier
from kv_transfer.tiers.host import HostTier

KiB, MiB = 1 << 10, 1 << 20
LAYOUT = small_layout()
H = hasher(LAYOUT)
TOKS = tokens(200)


@pytest.fixture
def host():
    tier = HostTier(4 * MiB, slab_bytes=256 * KiB)
    yield tier
    tier.close()


def test_put_resume_load_round_trip_with_tail(host) -> None:
    log = EventLog()
    store = StateStore([host], LAYOUT, event_log=log, worker_id="w1")
    state = make_state(LAYOUT, 37)  # 2 full blocks + a 5-token tail
    res = store.put_state(TOKS, state, H)
    assert (res.num_stored, res.num_skipped, res.num_refused) == (4, 0, 0)
    assert store.put_state(TOKS, state, H).num_skipped == 4  # everything present
    h = H.block_hashes(TOKS[:48])
    assert store.contains_keys([ObjectKey("mla", d) for d in h]) == [True, True, False]
    point = store.resumable_length(TOKS, H)
    assert (point.position, point.num_blocks, point.has_tail, point.slowest_tier) == (37, 2, True, "host")
    loaded = store.load_state(TOKS, 37, H, LAYOUT)
    assert loaded is not None and states_equal(loaded, state)
    tail_events = [e for e in log.take() if e.object_kind == "tail"]
    assert tail_events[0].position == 37 and tail_events[0].parent == H.block_hashes(TOKS[:32])[-1]
    # another prompt sharing only the first block resumes nowhere: no checkpoint at 16
    other = TOKS[:20] + tokens(30, seed=9)
    assert store.resumable_length(other, H).position == 0


def test_resumable_length_picks_the_furthest_complete_checkpoint(host) -> None:
    store = StateStore([host], LAYOUT)
    for p in (16, 48, 53, 70):
        store.put_state(TOKS, make_state(LAYOUT, p), H)
    assert store.resumable_length(TOKS, H).position == 70
    assert store.resumable_length(TOKS, H, max_position=69).position == 53
    assert store.resumable_length(TOKS, H, max_position=52).position == 48
    # the KDA checkpoint at 53 goes missing: fall back to 48
    digest_53 = H.prefix_digest(TOKS, 53)
    assert host.delete(str(ObjectKey("kda", digest_53, kda_shard(0, 1))))
    assert store.resumable_length(TOKS, H, max_position=69).position == 48
    # a missing MLA block cuts every later point
    assert host.delete(str(ObjectKey("mla", H.block_hashes(TOKS[:48])[1])))
    assert store.resumable_length(TOKS, H).position == 16
    assert store.load_state(TOKS, 70, H) is None
    assert store.stats()["num_missing_pieces"] == 1


def test_a_put_refreshes_the_prefix_it_skipped() -> None:
    """A turn's put of state whose leading blocks the store holds (``first_block``: the writer
    skipped them) refreshes those blocks, so a session that resumed them from elsewhere (its
    device) is not the first to go from the host tier while another, idle session is kept
    (``StateStore`` NOTE 4)."""
    host = HostTier(64 * KiB, slab_bytes=64 * KiB)  # 16 one-page slots, LRU
    store = StateStore([host], LAYOUT)
    a, b, c = TOKS, tokens(200, seed=5), tokens(200, seed=6)
    first = store.put_state(a, make_state(LAYOUT, 32), H)  # session a: 2 blocks + a checkpoint
    assert first.num_refreshed == 0
    store.put_state(b, make_state(LAYOUT, 32, seed=2), H)  # session b, idle from here on
    again = store.put_state(a, make_state(LAYOUT, 48, first_block=2), H)  # a's next turn
    assert again.num_stored == 2 and again.num_refreshed == 2
    assert store.stats()["num_put_refreshed"] == 2
    a_blocks = [str(ObjectKey("mla", h)) for h in H.block_hashes(a[:32])]
    b_blocks = [str(ObjectKey("mla", h)) for h in H.block_hashes(b[:32])]
    store.put_state(c, make_state(LAYOUT, 144, seed=3), H)  # 10 more objects: 2 must go
    assert host.contains(a_blocks) == [True, True]
    assert not all(host.contains(b_blocks))
    assert store.resumable_length(a, H).position == 48


def test_evicted_checkpoints_and_only_on_disk(tmp_path) -> None:
    state = make_state(LAYOUT, 40)
    small_host = HostTier(64 * KiB, slab_bytes=64 * KiB)  # 1 slab: a few objects at most
    disk = DiskTier(str(tmp_path), 8 * MiB, segment_bytes=256 * KiB)
    store = StateStore([small_host, disk], LAYOUT)
    try:
        store.put_state(TOKS, state, H)
        other = tokens(200, seed=9)  # another prompt: a put of TOKS's own prefix would refresh it
        for p in range(100, 130):  # 16 one-page slots: push the state at 40 out of host memory
            store.put_state(other, make_state(LAYOUT, p, seed=1), H)
        disk.flush()
        assert store.stats()["num_demoted"] > 0
        assert not any(small_host.contains([str(ObjectKey("mla", H.block_hashes(TOKS[:16])[0]))]))
        point = store.resumable_length(TOKS, H, max_position=50)
        assert point.position == 40 and point.slowest_tier == "disk"
        loaded = store.load_state(TOKS, 40, H)
        assert loaded is not None and states_equal(loaded, state)
        assert store.stats()["num_promoted"] > 0
    finally:
        disk.close()
        small_host.close()


def test_checkpoint_evicted_without_a_lower_tier_is_gone() -> None:
    tiny = HostTier(64 * KiB, slab_bytes=64 * KiB)
    store = StateStore([tiny], LAYOUT)
    store.put_state(TOKS, make_state(LAYOUT, 24), H)
    for p in range(100, 130):  # far more objects than the 16 one-page slots
        store.put_state(TOKS, make_state(LAYOUT, p, seed=2), H)
    assert store.resumable_length(TOKS, H, max_position=30).position == 0
    assert store.load_state(TOKS, 24, H) is None
    tiny.close()


def test_tp8_stores_the_mla_latent_once_and_eight_kda_shards(host) -> None:
    store = StateStore([host], LAYOUT, tp_size=8)
    results = []
    for rank in range(8):
        state = make_state(LAYOUT, 48, tp_size=8, tp_ranks=[rank])
        results.append(store.put_state(TOKS, state, H, tp_rank=rank))
    assert results[0].num_stored == 4 and all(r.num_stored == 1 and r.num_skipped == 3 for r in results[1:])
    kinds = [k.split(":")[0] for k in host.keys()]
    assert kinds.count("mla") == 3 and kinds.count("kda") == 8
    assert store.resumable_length(TOKS, H).position == 48
    full = store.load_state(TOKS, 48, H)
    assert full is not None and sorted(k.tp_rank for k in full.kda) == list(range(8))
    one = store.load_state(TOKS, 48, H, tp_ranks=[5])
    assert [k.tp_rank for k in one.kda] == [5]
    host.delete(str(ObjectKey("kda", H.prefix_digest(TOKS, 48), kda_shard(3, 8))))
    assert store.resumable_length(TOKS, H).position == 0  # one missing TP shard: no resume


def test_dcp_sharded_blocks_are_stored_under_shard_names_and_resharded(host) -> None:
    store = StateStore([host], LAYOUT, dcp_size=2)
    ref = make_state(LAYOUT, 37)
    for r in range(2):
        blocks = [split_dcp(b, 2)[r] for b in ref.mla_blocks]
        tail = split_dcp(ref.tail, 2)[r]
        store.put_state(TOKS, ResumeState(LAYOUT, 37, blocks, 0, tail, ref.kda if r == 0 else []), H, tp_rank=None)
    assert any(k.endswith(":dcp1of2") for k in host.keys())
    assert store.resumable_length(TOKS, H).position == 37
    merged = store.load_state(TOKS, 37, H)
    assert merged is not None and states_equal(merged, ref)
    rank3 = store.load_state(TOKS, 37, H, dcp_size=4, dcp_rank=3)
    want = ResumeState(LAYOUT, 37, [split_dcp(b, 4)[3] for b in ref.mla_blocks], 0,
                       split_dcp(ref.tail, 4)[3], ref.kda)
    assert states_equal(rank3, want)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_flipped_byte_anywhere_gives_a_miss_never_bad_data(data) -> None:
    with HostTier(1 * MiB, slab_bytes=128 * KiB) as tier:
        store = StateStore([tier], LAYOUT)
        store.put_state(TOKS, make_state(LAYOUT, 37), H)
        key = data.draw(st.sampled_from(sorted(tier.keys())))
        lease_id, offset, nbytes = tier.acquire(key)
        tier.release(lease_id)
        pos = data.draw(st.integers(0, nbytes - 1))
        tier.arena.view[offset + pos] ^= data.draw(st.integers(1, 255))
        assert store.load_state(TOKS, 37, H) is None
        st_ = store.stats()
        assert st_["num_corrupt_pieces"] == 1 and st_["num_load_misses"] == 1
        assert not tier.contains([key])[0]  # the corrupt object was dropped
        assert store.resumable_length(TOKS, H).position != 37


def test_corrupt_host_copy_falls_back_to_a_good_disk_copy(tmp_path) -> None:
    with HostTier(1 * MiB, slab_bytes=128 * KiB) as tier:
        disk = DiskTier(str(tmp_path), 8 * MiB)
        store = StateStore([tier, disk], LAYOUT)
        state = make_state(LAYOUT, 32)
        store.put_state(TOKS, state, H)
        for key in tier.keys():  # write-through by hand: the disk holds good copies
            disk.put_bytes(key, tier.get_bytes(key))
        disk.flush()
        _, offset, _ = tier.acquire(tier.keys()[0])
        tier.arena.view[offset + 300] ^= 1
        tier.release(tier._next_id - 1)
        loaded = store.load_state(TOKS, 32, H)
        assert loaded is not None and states_equal(loaded, state)
        assert store.stats()["num_corrupt_pieces"] == 1
        disk.close()


def test_io_threads_put_and_load_like_one_thread(host) -> None:
    """Many blocks encode and verify on several threads: same bytes, same misses, same counts."""
    toks = tokens(900, seed=3)
    state = make_state(LAYOUT, 805, seed=4)  # 50 blocks + a tail
    serial = StateStore([host], LAYOUT, io_threads=1)
    res = StateStore([HostTier(16 * MiB, slab_bytes=256 * KiB)], LAYOUT, io_threads=4)
    try:
        for store in (serial, res):
            out = store.put_state(toks, state, H)
            assert (out.num_stored, out.num_refused) == (52, 0)
            loaded = store.load_state(toks, 805, H, LAYOUT)
            assert loaded is not None and states_equal(loaded, state)
        # a corrupt block in the middle of a threaded load: the whole load misses, the block is dropped
        key = ObjectKey("mla", H.block_hashes(toks[:800])[30])
        tier = res.tiers[0]
        lease_id, offset, nbytes = tier.acquire(str(key))
        tier.release(lease_id)
        tier.arena.view[offset + nbytes // 2] ^= 0xFF
        assert res.load_state(toks, 805, H, LAYOUT) is None
        assert res.stats()["num_corrupt_pieces"] == 1 and not res.contains_keys([key])[0]
    finally:
        res.tiers[0].close()


def test_demoted_checkpoints_are_evicted_first_and_stay_readable_until_then() -> None:
    """Retention (``StateStore.demote``): superseded checkpoints go before anything else under
    pressure; one read again after its demote is refreshed and kept."""
    log = EventLog()
    tier = HostTier(64 * KiB, slab_bytes=64 * KiB, eviction="lru", event_log=log)  # 16 one-page slots
    store = StateStore([tier], LAYOUT)
    try:
        for p in (16, 32, 37, 48):  # 3 blocks, a tail at 37, 4 KDA checkpoints: 8 objects
            store.put_state(TOKS, make_state(LAYOUT, p), H)
        old = [store.checkpoint_keys(H.prefix_digest(TOKS, p)) for p in (16, 32, 37)]
        assert [len(k) for k in old] == [1, 1, 2]  # the unaligned point names its tail too
        peer = StateStore([tier], LAYOUT)  # another process's store over the same tier: it put no tail
        assert peer.checkpoint_keys(H.prefix_digest(TOKS, 37)) == old[2][:1]
        assert peer.checkpoint_keys(H.prefix_digest(TOKS, 37), unaligned=True) == old[2]
        assert peer.checkpoint_keys(H.prefix_digest(TOKS, 16), unaligned=False) == old[0]
        assert store.demote([k for keys in old for k in keys] + ["kda:absent"]) == 4
        assert store.stats()["num_retention_demoted"] == 4
        assert store.load_state(TOKS, 32, H) is not None  # demoted, still there; the read refreshes it
        log.take()
        other = tokens(200, seed=9)
        for p in (16, 32, 48, 64, 80, 96):  # 12 objects more than the 8 held: 4 evictions
            store.put_state(other, make_state(LAYOUT, p, seed=3), H)
        evicted = [e.key for e in log.take() if e.kind == "evicted"]
        # the demoted first (in the order given), not kda at 32 (read since), then plain LRU:
        # block 2, the one object of TOKS neither demoted nor read since its put
        assert evicted == old[0] + old[2] + [str(ObjectKey("mla", H.block_hashes(TOKS[:48])[2]))]
        assert store.resumable_length(TOKS, H).position == 32
    finally:
        tier.close()
