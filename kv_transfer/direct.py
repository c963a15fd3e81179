"""Full MLA blocks straight from a pinned host tier into device memory: no host staging copy.

The host path (``StateStore._load_blocks_into``) verifies each block and copies its rows into
a host staging buffer, which the engine then copies to its device: two passes over the bytes
on the host and a page-locked staging allocation per load. Here the objects' bytes go from the
tier's arena (page-locked with ``cudaHostRegister``) to the device by DMA while the I/O
threads verify the same bytes in place; the rows are then unpacked on the device:

    arena   | hdr rows crc | hdr rows crc |  ...  | hdr rows crc |    objects 0, 1, ... n-1
              \\_____ one copy per run of evenly spaced objects _/     (H2D, side stream)
                                    ||  verify(j) on the I/O threads, at the same time
    raw     [n, pitch] uint8 on the device (pitch: the slots' spacing in the arena)
    rows    [layers, n * bs, D] = raw[:, 128 : 128 + nbytes] seen as [n, layers, bs, D], permuted

NOTES
1. ``rows`` of block j may be used only where ``verified[j]``: a block that failed its
   checksum, is not a template block of the layout, is missing or sits at another position is
   reported, and the caller loads it on the general path into its slice of ``rows``.
2. Every copy has completed when ``load_blocks`` returns (or raises): only then may the caller
   release the leases, since the DMA reads the arena.
3. On a CPU device the same steps run synchronously, so the tests cover the logic there.
4. Where the device can checksum (``device_crc``: CUDA and Triton), it checks the bytes it
   received, one kernel over ``raw`` after the copies on the same stream, and the host only
   compares each block's header with the layout's template: the host never reads the rows.
   That also covers the copy itself. A block that fails either check takes the general path
   (NOTE 1), whose host check then counts and deletes it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kv_transfer import device_crc
from kv_transfer.codec import HEADER_BYTES, BlockCodec
from kv_transfer.errors import CorruptObjectError

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bit-exact views


@dataclass(slots=True)
class DirectLoad:
    """Result of ``load_blocks``."""

    rows: torch.Tensor  # [num_mla_layers, n * block_size, latent_dim] on the device
    verified: list[bool]  # block j's rows in ``rows`` passed their checks (NOTE 1)
    num_copies: int  # host-to-device copies issued (runs of adjacent objects)


def load_blocks(leases: Sequence, codec: BlockCodec, first_block: int, device: torch.device,
                parallel: Callable[[Callable, list], list], device_checks: bool = True) -> DirectLoad:
    """Copy the objects under ``leases`` (``HostLease`` or None per block) to ``device`` and
    verify them there and then; block j is expected at position ``(first_block + j) * bs``.

    Args:
        parallel: ``parallel(fn, items) -> [fn(x) for x in items]``, on I/O threads.
        device_checks: compute the checksums on the device where it can (NOTE 4).
    """
    n = len(leases)
    layers, bs, dim = codec.shape
    size = codec.total_len
    dtype = getattr(torch, codec.layout.cache_dtype)
    cuda = device.type == "cuda"
    stream = _copy_stream(device) if cuda else None
    pitch, runs = _runs(leases, size)
    on_device = device_checks and device_crc.available(device) and codec.end % device_crc.CHUNK == 0
    raw = torch.empty((n, pitch), dtype=torch.uint8, device=device)
    sources = []  # host tensors over arena bytes, alive until the copies complete (NOTE 2)
    try:
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            for j0, j1, address in runs:
                nbytes = (j1 - j0 - 1) * pitch + size
                src = _host_bytes(address, nbytes)
                raw[j0:j1].view(-1)[:nbytes].copy_(src, non_blocking=True)
                sources.append(src)

        sums = None
        if on_device:  # NOTE 4: the device checks the bytes it received, after the copies
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                sums = device_crc.verify(raw, codec.end, codec.algo)

        def check(j: int) -> bool:
            lease = leases[j]
            if lease is None:
                return False
            try:
                if on_device:
                    return codec.check_header(lease.view) == (first_block + j) * bs
                return codec.verify(lease.view) == (first_block + j) * bs
            except CorruptObjectError:
                return False  # the general path counts it, deletes it and tries the next tier

        # while the copies run: headers only (fast, inline) or whole checks on the I/O threads
        verified = [check(j) for j in range(n)] if on_device else parallel(check, list(range(n)))
        rows = torch.empty((layers, n * bs, dim), dtype=dtype, device=device)
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            ints = _INT[dtype.itemsize]
            payload = raw[:, HEADER_BYTES : HEADER_BYTES + codec.nbytes].view(ints).view(n, layers, bs, dim)
            rows.view(ints).view(layers, n, bs, dim).copy_(payload.permute(1, 0, 2, 3))
    finally:
        if stream is not None:
            stream.synchronize()
    if sums is not None:
        verified = [v and ok for v, ok in zip(verified, sums.tolist(), strict=True)]
    return DirectLoad(rows, verified, len(sources))


def _runs(leases: Sequence, size: int) -> tuple[int, list[tuple[int, int, int]]]:
    """(pitch, runs): each run is (first, end, address) of consecutive leases whose objects of
    ``size`` bytes lie ``pitch`` bytes apart in one mapping (slots of one size class in a slab),
    so one copy of ``(end - first - 1) * pitch + size`` bytes from ``address`` moves them all.
    A missing or odd-sized object ends a run and is left out. The pitch is the smallest gap
    between consecutive objects, up to twice ``size``; with wider (or unaligned) slots each
    object is its own run and the pitch is ``size`` rounded up to 64 bytes."""
    addresses = [_address(x.view) if x is not None and x.nbytes == size else None for x in leases]
    pairs = zip(addresses[:-1], addresses[1:], strict=True)
    gaps = [b - a for a, b in pairs if a is not None and b is not None and b - a >= size]
    pitch = min(gaps, default=size)
    if pitch > 2 * size or pitch % 8:  # slots too wide to copy whole, or rows unaligned in ``raw``
        return -(-size // 64) * 64, [(j, j + 1, a) for j, a in enumerate(addresses) if a is not None]
    runs: list[tuple[int, int, int]] = []
    first = None
    for j, a in enumerate(addresses):
        if first is not None and a is not None and a == addresses[j - 1] + pitch:
            continue
        if first is not None:
            runs.append((first, j, addresses[first]))
        first = j if a is not None else None
    if first is not None:
        runs.append((first, len(addresses), addresses[first]))
    return pitch, runs


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def _host_bytes(address: int, nbytes: int) -> torch.Tensor:
    """A CPU uint8 tensor over ``nbytes`` at ``address`` (bytes the caller keeps alive)."""
    return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address)))


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)
