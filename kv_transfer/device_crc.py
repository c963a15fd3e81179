"""CRC32C / CRC-32 of many equal-sized objects on a CUDA device (one Triton kernel).

The direct load path (``kv_transfer.direct``) copies a state's blocks to the
device by DMA. Checking them on the host as well reads every byte a second
time with the CPU, and on a busy host that pass, not the DMA, set the load's
time (a 32K-token state: ~30 ms of CRC32C on the host against ~3 ms of DMA). So
the device checks the copy it already holds.

A CRC register update is linear over GF(2) in (state, input) together, so an
object of E bytes cut into chunks M_0 .. M_{m-1} of C bytes has

    f(s, M)  = Z_E(s)  xor  XOR_i Z_{E-(i+1)C}( f(0, M_i) )
    crc(M)   = f(0xFFFFFFFF, M) xor 0xFFFFFFFF

where f(s, X) is the register after the bytes X from state s, and Z_k maps a
state through k zero bytes (a 32x32 bit matrix, given by its 32 columns). One
lane of the kernel computes f(0, M_i) for one chunk (slice-by-4 tables: one
32-bit word a step), moves it to the object's end with its chunk's columns,
and the lanes' results are XORed together. The columns depend only on (E, C,
polynomial) and are built once per object size on the host.

NOTES
1. The objects are rows of a [n, pitch] uint8 device tensor, the checksummed
   bytes ``[0, E)`` of each row, the stored u32 (little-endian) at ``[E, E+4)``
   (the codec's trailer). E must be a multiple of ``CHUNK`` bytes, and the
   pitch a multiple of 4.
2. ``available()`` is False without Triton or a CUDA device; callers then check
   on the host. With ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors
   (the tests check it against the host implementations that way).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from kv_transfer import checksum as _checksum

CHUNK = 64  # bytes per lane (16 words)
_WORDS = CHUNK // 4
_LANES = 256
POLYS = {_checksum.CRC32C: 0x82F63B78, _checksum.CRC32: 0xEDB88320}  # reflected polynomials



@functools.cache
def _kernel():
    """The Triton kernel, compiled lazily (importing Triton costs every process that imports the
    store, CPU-only ones too), or None without Triton."""
    try:
        from kv_transfer import _crc_kernel
    except Exception:  # noqa: BLE001 - any failure to import means "check on the host"
        return None
    return _crc_kernel.crc_kernel


def has_triton() -> bool:
    return _kernel() is not None


def available(device: torch.device | str) -> bool:
    """The device can check objects itself (NOTE 2)."""
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return has_triton()


@functools.cache
def _tables(poly: int) -> np.ndarray:
    """Slice-by-4 tables [4, 256] of a reflected polynomial (table k: a byte k places earlier)."""
    t0 = np.zeros(256, dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        t0[i] = c
    tables = [t0]
    for _ in range(3):
        prev = tables[-1]
        tables.append((prev >> np.uint32(8)) ^ t0[prev & 0xFF])
    return np.stack(tables)


def _apply(columns: np.ndarray, states: np.ndarray) -> np.ndarray:
    """The bit matrix with ``columns`` [32] applied to each of ``states`` [n]."""
    bits = (states[:, None] >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
    return np.bitwise_xor.reduce(np.where(bits.astype(bool), columns[None, :], np.uint32(0)), axis=1)


@functools.cache
def _shifts(nbytes: int, poly: int) -> tuple[np.ndarray, int]:
    """(columns [m, 32] of Z_{E-(i+1)C} for chunk i, Z_E(0xFFFFFFFF) xor 0xFFFFFFFF)."""
    assert nbytes % CHUNK == 0, f"{nbytes} bytes is not a multiple of {CHUNK}"
    t0 = _tables(poly)[0]
    zc = np.uint32(1) << np.arange(32, dtype=np.uint32)  # Z_C, column b = Z_C(1 << b)
    for _ in range(CHUNK):
        zc = t0[zc & 0xFF] ^ (zc >> np.uint32(8))
    m = nbytes // CHUNK
    cols = np.empty((m, 32), dtype=np.uint32)
    cols[m - 1] = np.uint32(1) << np.arange(32, dtype=np.uint32)  # the last chunk: no shift
    for i in range(m - 2, -1, -1):
        cols[i] = _apply(zc, cols[i + 1])
    head = _apply(zc, cols[0])  # Z_E
    init = int(_apply(head, np.array([0xFFFFFFFF], dtype=np.uint32))[0])
    return cols, init ^ 0xFFFFFFFF


@functools.cache
def _device_constants(nbytes: int, poly: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    cols, final = _shifts(nbytes, poly)
    as_i32 = lambda a: torch.from_numpy(a.view(np.int32).copy()).to(device)
    return as_i32(_tables(poly).reshape(-1)), as_i32(cols.reshape(-1)), final


def checksums(objects: torch.Tensor, nbytes: int, algo: int) -> torch.Tensor:
    """int32 [n]: the ``algo`` checksum of bytes ``[0, nbytes)`` of each row of ``objects``
    ([n, pitch] uint8 on the device), computed there (bit pattern of the u32)."""
    kernel = _kernel()
    assert kernel is not None, "device checksums need Triton"
    n, pitch = objects.shape
    assert objects.dtype == torch.uint8 and pitch % 4 == 0 and nbytes <= pitch, f"objects {objects.shape}"
    assert objects.is_contiguous(), "objects must be one contiguous [n, pitch] tensor"
    tables, cols, final = _device_constants(nbytes, POLYS[algo], objects.device)
    out = torch.empty(n, dtype=torch.int32, device=objects.device)
    if n:
        kernel[(n,)](objects.view(torch.int32), pitch // 4, tables, cols, out, nbytes // CHUNK,
                          WORDS=_WORDS, LANES=_LANES)
    return out ^ (final - (1 << 32) if final >= 1 << 31 else final)


def warm(nbytes: int, algo: int, device: torch.device | str) -> bool:
    """Build the constants for objects of ``nbytes`` checksummed bytes and compile the kernel
    (a first load pays both otherwise: ~70 ms of host work for a 295 KB block, plus the JIT).
    False where the device cannot check (NOTE 2) or the size does not fit NOTE 1."""
    if not available(device) or nbytes % CHUNK:
        return False
    pitch = -(-(nbytes + 4) // 64) * 64
    checksums(torch.zeros((1, pitch), dtype=torch.uint8, device=device), nbytes, algo)
    return True


def verify(objects: torch.Tensor, nbytes: int, algo: int) -> torch.Tensor:
    """bool [n]: each row's checksum of ``[0, nbytes)`` equals its stored trailer at ``nbytes``
    (NOTE 1). Runs on the current stream; nothing is read back."""
    stored = objects.view(torch.int32)[:, nbytes // 4]
    return checksums(objects, nbytes, algo) == stored
