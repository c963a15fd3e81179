"""Checksums on the device (``kv_transfer.device_crc``) and the direct load that uses them
(direct NOTE 4). The kernel runs on CPU tensors in Triton's interpreter (a subprocess with
``TRITON_INTERPRET=1``), and on CUDA in the ``gpu`` test."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
import torch
from kvt_util import bit_equal, hasher, make_state, small_layout, tokens

from kv_transfer import checksum, device_crc

triton_missing = pytest.mark.skipif(not device_crc.has_triton(), reason="needs Triton")


@pytest.mark.parametrize("algo", [checksum.CRC32C, checksum.CRC32])
@pytest.mark.parametrize("nbytes", [64, 64 * 7, 64 * 300])
def test_chunk_combination_is_the_checksum(algo, nbytes) -> None:
    """The math the kernel runs, in numpy: per-chunk registers from zero, each moved to the end
    of the object by its chunk's columns, XORed, then the initial value's term."""
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    tables = device_crc._tables(device_crc.POLYS[algo])
    cols, final = device_crc._shifts(nbytes, device_crc.POLYS[algo])
    acc = 0
    for i, chunk in enumerate(data.reshape(-1, device_crc.CHUNK)):
        s = np.uint32(0)
        for w in chunk.view("<u4"):
            s ^= w
            s = tables[3][s & 0xFF] ^ tables[2][(s >> 8) & 0xFF] ^ tables[1][(s >> 16) & 0xFF] ^ tables[0][s >> 24]
        acc ^= int(device_crc._apply(cols[i], np.array([s], dtype=np.uint32))[0])
    expected = checksum.crc32c(data.tobytes()) if algo == checksum.CRC32C else zlib.crc32(data.tobytes())
    assert acc ^ final == expected


_INTERPRETED = textwrap.dedent('''
    import numpy as np, torch
    from kv_transfer import checksum, codec, device_crc, direct
    from kv_transfer.keys import ObjectKey
    from kv_transfer.store import StateStore
    from kv_transfer.tiers.host import HostTier
    from kvt_util import bit_equal, hasher, make_state, small_layout, tokens

    assert device_crc.available("cpu") and device_crc.warm(64 * 37, checksum.CRC32C, "cpu")
    assert not device_crc.warm(100, checksum.CRC32C, "cpu")  # not a whole number of chunks
    rng = np.random.default_rng(0)
    for algo in (checksum.CRC32C, checksum.CRC32):
        nbytes, pitch = 64 * 37, 64 * 38
        objs = rng.integers(0, 256, (6, pitch), dtype=np.uint8)
        want = [checksum.compute(algo, objs[j, :nbytes].tobytes()) for j in range(6)]
        for j, v in enumerate(want):
            objs[j, nbytes : nbytes + 4] = np.frombuffer(v.to_bytes(4, "little"), np.uint8)
        objs[4, 1000] ^= 0x10  # one flipped bit after sealing
        t = torch.from_numpy(objs)
        got = [x & 0xFFFFFFFF for x in device_crc.checksums(t, nbytes, algo).tolist()]
        assert got[:4] + got[5:] == want[:4] + want[5:] and got[4] != want[4], (got, want)
        assert device_crc.verify(t, nbytes, algo).tolist() == [True] * 4 + [False, True]

    # the direct load with its checks on the "device": a clean state loads bit for bit, and a
    # block damaged in the arena is caught, counted and deleted (no other copy: a miss)
    layout = small_layout()
    h = hasher(layout)
    toks = tokens(300, seed=7)
    state = make_state(layout, 256, seed=8)
    with HostTier(1 << 20, slab_bytes=64 << 10) as tier:
        store = StateStore([tier], layout)
        assert store.warm("cpu")
        store.put_state(toks, state, h)
        loaded = store.load_state(toks, 256, h, contiguous=True, device="cpu")
        assert loaded is not None and bit_equal(loaded.mla_rows, torch.cat([b.rows for b in state.mla_blocks], 1))
        key = str(ObjectKey("mla", h.block_hashes(toks[:256])[2]))
        lease_id, offset, nbytes = tier.acquire(key)
        tier.release(lease_id)
        tier.arena.view[offset + 300] ^= 0x01  # a payload byte: the header still matches
        assert codec.block_codec(layout).check_header(tier.arena.view[offset : offset + nbytes]) is not None
        assert store.load_state(toks, 256, h, contiguous=True, device="cpu") is None
        assert store.stats()["num_corrupt_pieces"] == 1 and tier.contains([key]) == [False]
    print("ok")
''')


@triton_missing
def test_kernel_and_direct_load_in_the_interpreter() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([root, here]))
    done = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and device_crc.has_triton()), reason="needs CUDA and Triton")
def test_device_checks_on_cuda_match_the_host() -> None:
    from kv_transfer.store import StateStore
    from kv_transfer.tiers.host import HostTier

    rng = np.random.default_rng(1)
    nbytes, pitch = 64 * 4610, 64 * 4611  # the small preset's block object
    objs = rng.integers(0, 256, (33, pitch), dtype=np.uint8)
    want = [checksum.crc32c(objs[j, :nbytes].tobytes()) for j in range(33)]
    got = [x & 0xFFFFFFFF for x in device_crc.checksums(torch.from_numpy(objs).cuda(), nbytes,
                                                         checksum.CRC32C).tolist()]
    assert got == want
    layout = small_layout()
    h = hasher(layout)
    toks = tokens(700, seed=11)
    state = make_state(layout, 650, seed=12)
    with HostTier(2 << 20, slab_bytes=128 << 10, pin_memory=True) as tier:
        store = StateStore([tier], layout, io_threads=2)
        store.put_state(toks, state, h)
        loaded = store.load_state(toks, 650, h, contiguous=True, device="cuda")
        assert loaded is not None and bit_equal(loaded.mla_rows.cpu(), torch.cat([b.rows for b in state.mla_blocks], 1))


def test_warm_is_a_no_op_where_the_host_checks() -> None:
    """Off CUDA (no interpreter) loads check on the host, and warming says so."""
    from kv_transfer.store import StateStore
    from kv_transfer.tiers.memory import DictByteStore

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter makes the CPU a checking device")
    store = StateStore([DictByteStore()], small_layout())
    assert not store.warm("cpu")
    store.device_checks = False
    assert not store.warm("cuda")
