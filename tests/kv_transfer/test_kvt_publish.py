"""Publishing a state with few GIL hand-offs: full blocks encoded in runs (``BlockCodec.encode_run``)
and, through a node store's client, sealed by the tier's owner (``seal_many``, op SEAL_MANY).
Every object must be byte-for-byte what the one-block encoder writes, and load back verified."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvt_util import hasher, host_pair, kda_shard, make_state, small_layout, states_equal, tokens

from kv_transfer import checksum, codec
from kv_transfer.keys import ObjectKey
from kv_transfer.objects import MLABlock, ResumeState
from kv_transfer.store import StateStore
from kv_transfer.tiers.host import HostTier
from kv_transfer.tiers.host_ipc import _U8, _U32, _U64, SEAL_MANY, HostTierClient, HostTierServer

KiB, MiB = 1 << 10, 1 << 20
LAYOUT = small_layout(latent_dim=512)  # 32 KiB blocks: one size class packs them evenly in a slab
H = hasher(LAYOUT)


def staged_state(position: int, seed: int = 0) -> ResumeState:
    """A state whose full blocks are views of one rows buffer, as an engine's export gives them."""
    bs = LAYOUT.block_size
    n = position // bs
    rows = torch.randn(LAYOUT.num_mla_layers, n * bs, LAYOUT.latent_dim,
                       generator=torch.Generator().manual_seed(seed)).to(getattr(torch, LAYOUT.cache_dtype))
    blocks = [MLABlock(rows[:, i * bs : (i + 1) * bs], i * bs, bs) for i in range(n)]
    return ResumeState(LAYOUT, position, blocks, 0, None, [kda_shard(LAYOUT, position, seed=seed)], mla_rows=rows)


@pytest.fixture(params=["in-process", "client"])
def host(request):
    with host_pair(request.param, 16 * MiB, 512 * KiB) as pair:
        yield pair


def test_encode_run_writes_what_encode_into_writes() -> None:
    bc = codec.block_codec(LAYOUT)
    state = staged_state(5 * LAYOUT.block_size, seed=1)
    src = codec._as_numpy(state.mla_rows)
    pitch = bc.total_len + 192  # objects further apart than their size, as slots of a size class
    arena = np.zeros(5 * pitch, dtype=np.uint8)
    dst = np.lib.stride_tricks.as_strided(arena, (5, bc.total_len), (pitch, 1))
    starts = np.arange(5, dtype=np.int64) * LAYOUT.block_size + 7 * LAYOUT.block_size
    bc.encode_run(dst, src, starts)
    for j, blk in enumerate(state.mla_blocks):
        one = bytearray(bc.total_len)
        bc.encode_into(memoryview(one), codec._as_numpy(blk.rows), int(starts[j]))
        assert dst[j].tobytes() == bytes(one), f"block {j}"
        assert not arena[j * pitch + bc.total_len : (j + 1) * pitch].any(), "bytes between slots untouched"
    unsealed = np.zeros_like(arena)
    bc.encode_run(np.lib.stride_tricks.as_strided(unsealed, (5, bc.total_len), (pitch, 1)), src, starts, seal=False)
    for j in range(5):
        checksum.seal(memoryview(unsealed[j * pitch : j * pitch + bc.total_len]), bc.algo)
    assert np.array_equal(unsealed, arena), "sealing afterwards gives the same objects"


def test_a_put_encodes_runs_and_every_object_is_the_one_block_encoding(host, monkeypatch) -> None:
    tier, owner = host
    runs = []
    original = codec.BlockCodec.encode_run
    monkeypatch.setattr(codec.BlockCodec, "encode_run",
                        lambda self, dst, *a, **kw: (runs.append(len(dst)), original(self, dst, *a, **kw))[1])
    sealed = []
    real_seal = HostTierClient.seal_many
    monkeypatch.setattr(HostTierClient, "seal_many",
                        lambda self, res, algo: (sealed.append(len(res)), real_seal(self, res, algo))[1])
    toks = tokens(700, seed=2)
    state = staged_state(640, seed=3)  # 40 full blocks
    store = StateStore([tier], LAYOUT, io_threads=4)
    result = store.put_state(toks, state, H)
    # slabs of 512 KiB hold 15 blocks each; parts of at most 40 / 4 = 10 blocks
    assert result.num_stored == 41 and sum(runs) == 40 and len(runs) <= 8 and max(runs) == 10, f"runs {runs}"
    bc = codec.block_codec(LAYOUT)
    for i, digest in enumerate(H.block_hashes(toks[:640])):
        got = owner.get_bytes(str(ObjectKey("mla", digest)))
        one = bytearray(bc.total_len)
        bc.encode_into(memoryview(one), codec._as_numpy(state.mla_blocks[i].rows), i * LAYOUT.block_size)
        assert got == bytes(one), f"block {i}"
    if isinstance(tier, HostTierClient):
        assert sealed == [40], "the 40 blocks were sealed by the tier's owner in one round trip"
    loaded = store.load_state(toks, 640, H, contiguous=True)
    assert loaded is not None and states_equal(loaded, state)


def test_a_state_without_one_rows_buffer_still_goes_block_by_block(host) -> None:
    tier, _ = host
    toks = tokens(700, seed=4)
    state = make_state(LAYOUT, 650, seed=5)  # blocks of their own, a tail
    store = StateStore([tier], LAYOUT, io_threads=2)
    assert store.put_state(toks, state, H).num_stored == 42  # 40 blocks, the tail, the KDA shard
    assert states_equal(store.load_state(toks, 650, H), state)


def test_damage_after_a_remote_seal_is_caught_on_load() -> None:
    with HostTier(16 * MiB, slab_bytes=512 * KiB) as owner:
        server = HostTierServer(owner)
        client = HostTierClient(server.socket_path)
        try:
            toks = tokens(700, seed=6)
            store = StateStore([client], LAYOUT)
            store.put_state(toks, staged_state(640, seed=7), H)
            key = str(ObjectKey("mla", H.block_hashes(toks[:640])[5]))
            lease_id, offset, _ = owner.acquire(key)
            owner.release(lease_id)
            owner.arena.view[offset + 300] ^= 0x10
            assert store.load_state(toks, 640, H) is None, "a corrupt block is a miss, not wrong rows"
            assert store.resumable_length(toks, H).position < 640 or not owner.contains([key])[0]
        finally:
            client.close()
            server.close()


def test_seal_many_refuses_foreign_reservations_and_unknown_algorithms() -> None:
    with HostTier(4 * MiB) as owner:
        server = HostTierServer(owner)
        a, b = HostTierClient(server.socket_path), HostTierClient(server.socket_path)
        try:
            (res,) = a.reserve_many([("x", 64)])
            assert b.seal_many([res], checksum.CRC32C) == [False], "another connection's reservation"
            assert not owner.contains(["x"])[0]
            r = a._call(_U8.pack(SEAL_MANY) + _U8.pack(99) + _U32.pack(1) + _U64.pack(res.reservation_id))
            assert r.buf[:1] == b"\x00" and not owner.contains(["x"])[0], "unknown algorithm: not stored"
            assert owner.stats()["pending_bytes"] == 0, "and its region freed"
            (res,) = a.reserve_many([("y", 64)])
            res.view[:60] = bytes(range(60))
            assert a.seal_many([res], checksum.CRC32C) == [True]
            data = owner.get_bytes("y")
            assert int.from_bytes(data[60:], "little") == checksum.compute(checksum.CRC32C, data[:60])
        finally:
            a.close()
            b.close()
            server.close()
