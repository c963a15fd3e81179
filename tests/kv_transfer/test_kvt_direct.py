"""Direct loads (``kv_transfer.direct``): full blocks from the host tier's arena into rows on a
device, verified in place. On CPU the same steps run synchronously (direct NOTE 3). The
fallbacks shared with the host-rows path (a corrupt block read from a lower tier, a block under
another block's key) are parametrized over both paths in test_kvt_batch_ops.py."""

from __future__ import annotations

import pytest
import torch
from kvt_util import bit_equal, hasher, host_pair, make_state, small_layout, states_equal, tokens

from kv_transfer import codec, direct
from kv_transfer.keys import ObjectKey
from kv_transfer.store import StateStore
from kv_transfer.tiers.host import HostTier

KiB, MiB = 1 << 10, 1 << 20
LAYOUT = small_layout()
H = hasher(LAYOUT)


@pytest.fixture(params=["in-process", "client"])
def host(request):
    """A host tier, used directly or through a HostTierClient (the node store process's socket)."""
    with host_pair(request.param, 2 * MiB, 128 * KiB) as pair:
        yield pair


def test_direct_load_equals_the_staged_load_bit_for_bit(host) -> None:
    tier, _ = host
    toks = tokens(700, seed=1)
    state = make_state(LAYOUT, 650, seed=2)  # 40 full blocks and a tail
    store = StateStore([tier], LAYOUT, io_threads=2)
    store.put_state(toks, state, H)
    staged = store.load_state(toks, 650, H, contiguous=True)
    loaded = store.load_state(toks, 650, H, contiguous=True, device="cpu")
    assert loaded is not None and states_equal(loaded, state) and states_equal(loaded, staged)
    assert bit_equal(loaded.mla_rows, staged.mla_rows)
    assert loaded.mla_blocks[0].rows.data_ptr() == loaded.mla_rows.data_ptr(), "blocks are views of the rows"
    assert tier.stats()["num_leases"] == 0, "every lease was released"


def test_objects_of_one_slab_are_copied_together() -> None:
    layout = small_layout(latent_dim=512)  # 32 KiB blocks: slots of one class hold them closely
    h = hasher(layout)
    toks = tokens(700, seed=3)
    state = make_state(layout, 640, seed=4)
    with HostTier(8 * MiB, slab_bytes=512 * KiB) as tier:
        StateStore([tier], layout).put_state(toks, state, h)
        keys = [str(ObjectKey("mla", d)) for d in h.block_hashes(toks[:640])]
        bc = codec.block_codec(layout)
        leases = tier.get_views(keys)
        try:
            got = direct.load_blocks(leases, bc, 0, torch.device("cpu"), lambda fn, xs: [fn(x) for x in xs])
        finally:
            tier.release_many(leases)
        assert got.verified == [True] * 40
        assert got.num_copies < 10, f"{got.num_copies} copies for 40 blocks in slabs of 15"
        assert bit_equal(got.rows, torch.cat([b.rows for b in state.mla_blocks], dim=1))


class _View:
    def __init__(self, buf: memoryview):
        self.view = buf
        self.nbytes = len(buf)


def test_runs_break_at_gaps_missing_and_odd_sized_objects() -> None:
    arena = memoryview(bytearray(2048))
    base = direct._address(arena)
    leases = [_View(arena[0:128]), _View(arena[128:256]), None, _View(arena[256:384]),
              _View(arena[512:640]), _View(arena[640:704]), _View(arena[768:896]), _View(arena[896:1024])]
    assert direct._runs(leases, 128) == (128, [(0, 2, base), (3, 4, base + 256), (4, 5, base + 512),
                                               (6, 8, base + 768)])
    slots = [_View(arena[0:120]), _View(arena[128:248]), _View(arena[256:376])]  # 120-byte objects, 128 apart
    assert direct._runs(slots, 120) == (128, [(0, 3, base)])
    spread = [_View(arena[0:100]), _View(arena[500:600])]  # slots over twice the object apart
    assert direct._runs(spread, 100) == (128, [(0, 1, base), (1, 2, base + 500)])


def test_a_corrupt_block_with_no_other_copy_is_a_miss() -> None:
    toks = tokens(300, seed=7)
    state = make_state(LAYOUT, 256, seed=8)
    with HostTier(1 * MiB, slab_bytes=64 * KiB) as tier:
        store = StateStore([tier], LAYOUT)
        store.put_state(toks, state, H)
        key = str(ObjectKey("mla", H.block_hashes(toks[:256])[3]))
        lease_id, offset, nbytes = tier.acquire(key)
        tier.release(lease_id)
        tier.arena.view[offset + 200] ^= 0x01
        assert store.load_state(toks, 256, H, contiguous=True, device="cpu") is None
        assert store.stats()["num_corrupt_pieces"] == 1 and tier.contains([key]) == [False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_direct_load_to_cuda_from_a_pinned_arena() -> None:
    toks = tokens(700, seed=11)
    state = make_state(LAYOUT, 650, seed=12)
    with HostTier(2 * MiB, slab_bytes=128 * KiB, pin_memory=True) as tier:
        store = StateStore([tier], LAYOUT, io_threads=2)
        store.put_state(toks, state, H)
        loaded = store.load_state(toks, 650, H, contiguous=True, device="cuda")
        assert loaded is not None and loaded.mla_rows.is_cuda
        assert bit_equal(loaded.mla_rows.cpu(), torch.cat([b.rows for b in state.mla_blocks], dim=1))
