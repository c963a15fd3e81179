"""Batch tier operations (one round trip per batch to a node's store process) and the
StateStore paths that use them: the same objects, misses, pins and counters as the
per-object path."""

from __future__ import annotations

import pytest
import torch
from kvt_util import hasher, make_state, small_layout, states_equal, tokens

from kv_transfer import codec
from kv_transfer.keys import ObjectKey
from kv_transfer.objects import ResumeState
from kv_transfer.store import StateStore
from kv_transfer.tiers.disk import DiskTier
from kv_transfer.tiers.host import HostTier
from kv_transfer.tiers.host_ipc import HostTierClient, HostTierServer

KiB, MiB = 1 << 10, 1 << 20
LAYOUT = small_layout()
H = hasher(LAYOUT)


class PerObject:
    """The tier without its batch operations (what a wrapper such as fault injection looks like)."""

    def __init__(self, tier):
        self._tier = tier

    def __getattr__(self, name: str):
        return getattr(self._tier, name)


@pytest.fixture(params=["in-process", "client"])
def tier(request):
    """A host tier, used directly or through a HostTierClient (the node store process's socket)."""
    owner = HostTier(1 * MiB, slab_bytes=64 * KiB)
    if request.param == "in-process":
        yield owner
    else:
        server = HostTierServer(owner)
        client = HostTierClient(server.socket_path)
        yield client
        client.close()
        server.close()
    owner.close()


def test_reserve_commit_get_release_many(tier) -> None:
    assert tier.put_bytes("dup", b"x" * 100)
    res = tier.reserve_many([("a", 3000), ("dup", 100), ("huge", 4 * MiB), ("b", 10)])
    assert [r is None for r in res] == [False, False, True, False]  # no room for "huge": None
    assert res[1].duplicate and not res[0].duplicate
    res[0].view[:] = b"A" * 3000
    res[3].view[:] = b"B" * 10
    assert tier.commit_many([res[0], res[3]]) == [True, True]
    leases = tier.get_views(["b", "missing", "a"])
    assert leases[1] is None
    assert bytes(leases[0].view) == b"B" * 10 and bytes(leases[2].view) == b"A" * 3000
    assert not tier.delete("a")  # pinned
    tier.release_many([leases[0], leases[2]])
    tier.release_many([leases[0]])  # released twice: a no-op
    assert tier.stats()["num_leases"] == 0 and tier.delete("a")
    aborted = tier.reserve_many([("c", 500)])
    tier.abort_many(aborted)
    assert tier.contains(["c", "b"]) == [False, True]
    assert tier.stats()["pending_bytes"] == 0


@pytest.mark.parametrize("position", [16 * 40, 16 * 40 + 7])
def test_batched_and_per_object_paths_store_the_same_bytes_and_load_the_same_state(tier, position) -> None:
    toks = tokens(position + 20, seed=9)
    state = make_state(LAYOUT, position, seed=3)
    batched = StateStore([tier], LAYOUT, io_threads=2)
    out = batched.put_state(toks, state, H)
    assert (out.num_stored, out.num_refused) == (40 + (position % 16 > 0) + 1, 0)
    stored = {k: tier.get_bytes(k) for k in out.keys_stored}
    for key in out.keys_stored:
        assert tier.delete(key)
    per_object = StateStore([PerObject(tier)], LAYOUT, io_threads=2)
    assert per_object.put_state(toks, state, H).keys_stored == out.keys_stored
    assert {k: tier.get_bytes(k) for k in out.keys_stored} == stored  # byte-identical objects
    for store in (batched, per_object):
        for contiguous in (True, False):
            loaded = store.load_state(toks, position, H, contiguous=contiguous)
            assert loaded is not None and states_equal(loaded, state)
            assert (loaded.mla_rows is not None) == contiguous
            if contiguous:  # blocks are views of the one buffer
                assert loaded.mla_blocks[1].rows.data_ptr() == loaded.mla_rows[:, 16].data_ptr()
    assert tier.stats()["num_leases"] == 0


@pytest.mark.parametrize("device", [None, "cpu"], ids=["host-rows", "direct"])
def test_contiguous_load_falls_back_per_block_to_a_lower_tier(tmp_path, device) -> None:
    """A corrupt block and a block only on disk inside a batched load (into host rows, or the
    direct path of ``kv_transfer.direct``): both come from the disk, the corrupt one is dropped
    from the host, the missing one is promoted."""
    toks = tokens(700, seed=1)
    state = make_state(LAYOUT, 640, seed=2)
    with HostTier(2 * MiB, slab_bytes=128 * KiB) as host:
        disk = DiskTier(str(tmp_path), 8 * MiB)
        store = StateStore([host, disk], LAYOUT, io_threads=2)
        store.put_state(toks, state, H)
        for key in host.keys():
            assert disk.put_bytes(key, host.get_bytes(key))
        disk.flush()
        digests = H.block_hashes(toks[:640])
        corrupt, gone = str(ObjectKey("mla", digests[7])), str(ObjectKey("mla", digests[20]))
        lease_id, offset, nbytes = host.acquire(corrupt)
        host.release(lease_id)
        host.arena.view[offset + nbytes // 2] ^= 0x40
        assert host.delete(gone)
        loaded = store.load_state(toks, 640, H, contiguous=True, device=device)
        assert loaded is not None and states_equal(loaded, state)
        assert host.stats()["num_leases"] == 0
        stats = store.stats()
        assert stats["num_corrupt_pieces"] == 1 and stats["num_promoted"] >= 1
        assert host.contains([gone]) == [True]
        disk.close()


@pytest.mark.parametrize("device", [None, "cpu"], ids=["host-rows", "direct"])
def test_a_block_under_another_blocks_key_is_a_miss_not_wrong_data(device) -> None:
    toks = tokens(300, seed=4)
    state = make_state(LAYOUT, 256, seed=5)
    with HostTier(1 * MiB, slab_bytes=64 * KiB) as host:
        store = StateStore([host], LAYOUT)
        store.put_state(toks, state, H)
        digests = H.block_hashes(toks[:256])
        k3, k4 = str(ObjectKey("mla", digests[3])), str(ObjectKey("mla", digests[4]))
        data4 = host.get_bytes(k4)
        assert host.delete(k3) and host.put_bytes(k3, data4)  # block 4's (valid) bytes as block 3
        assert store.load_state(toks, 256, H, contiguous=True, device=device) is None
        assert store.stats()["num_corrupt_pieces"] == 1


def test_loaded_rows_are_numpy_backed_on_cpu_and_writable() -> None:
    toks = tokens(200, seed=6)
    state = make_state(LAYOUT, 160, seed=7)
    with HostTier(1 * MiB, slab_bytes=64 * KiB) as host:
        store = StateStore([host], LAYOUT)
        store.put_state(toks, state, H)
        loaded = store.load_state(toks, 160, H, contiguous=True)
        assert loaded.mla_rows.dtype == torch.bfloat16 and loaded.mla_rows.shape == (2, 160, 8)
        loaded.mla_rows.zero_()  # owned memory, not a view of the arena
        again = store.load_state(toks, 160, H, contiguous=True)
        assert states_equal(again, state)
        assert codec.block_codec(LAYOUT).nbytes == LAYOUT.mla_block_bytes()


def test_a_state_carrying_one_staging_buffer_encodes_from_it_and_only_when_blocks_are_its_views() -> None:
    toks = tokens(400, seed=8)
    plain = make_state(LAYOUT, 320, seed=9)
    rows = torch.cat([b.rows for b in plain.mla_blocks], dim=1)  # [layers, 320, D], as an export gives
    views = [codec.MLABlock(rows[:, i * 16 : (i + 1) * 16], i * 16, 16) for i in range(20)]
    staged = ResumeState(LAYOUT, 320, views, 0, None, plain.kda, mla_rows=rows)
    stray = ResumeState(LAYOUT, 320, plain.mla_blocks, 0, None, plain.kda, mla_rows=torch.zeros_like(rows))
    stored = []
    for state in (plain, staged, stray):  # stray: its buffer is not its blocks' memory, so it is not used
        with HostTier(1 * MiB, slab_bytes=64 * KiB) as host:
            out = StateStore([host], LAYOUT).put_state(toks, state, H)
            stored.append({k: host.get_bytes(k) for k in out.keys_stored})
    assert stored[0] == stored[1] == stored[2]
