"""Device-to-device state hand-off between processes of one host.

A prefill process gathers a request's state into buffers on its own GPU
(``export_state(on_device=True)``) and shares them; the decode process, on
another GPU of the same host, maps them (CUDA IPC) and copies them into its
own memory: one peer copy per buffer, over NVLink or PCIe. Bulk bytes never
touch host memory; what travels between the processes is a descriptor of a
few hundred bytes (``SharedState``).

    prefill process (cuda:0)                 decode process (cuda:1)
    export_state(on_device) -> buffers
    DeviceShares.share(state) -> SharedState ----->  open_shared(desc, cuda:1)
                                                     map (IPC), peer copy, verify
    DeviceShares.release(share_id)      <-----  ack (the decode's RPC back)

On CPU the same code shares through shared memory, so the protocol is tested
on machines without GPUs.

NOTES
1. Lifetime: the producer holds every shared buffer until the consumer acks
   (``release``) or the share expires (``reap``: a consumer that died or gave
   up never pins device memory for long). The consumer drops its mapping
   before it acks.
2. Verification: each buffer carries a fingerprint taken by the producer, the
   sum of its 32-bit words (64-bit accumulator, computed on the device at
   memory bandwidth), checked again on the copy. It catches a lost, torn or
   misdirected copy; it is not a cryptographic check (both ends are processes
   of one host and one trust domain). A mismatch raises ``CorruptObjectError`` and
   the caller recomputes, as for a failed host-tier load.
3. Ordering: the producer synchronizes its stream before the descriptor
   leaves (taking the fingerprint does), so the consumer never maps
   half-written buffers.
4. Staging pool: mapping an IPC allocation costs far more than copying a few
   hundred MB over NVLink, so with ``pool_bytes`` the producer shares one
   device buffer once and each hand-off is a range of it (first fit, 256-B
   aligned); the consumer maps the pool on first use and keeps the mapping.
   A state that does not fit the free space is shared buffer by buffer.
"""

from __future__ import annotations

import io
import pickle
import threading
import time
import uuid
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions with ForkingPickler)

from kv_transfer.errors import CorruptObjectError
from kv_transfer.objects import KDACheckpoint, MLABlock, ResumeState, StateLayout


def fingerprint(t: torch.Tensor) -> int:
    """Sum of the tensor's 32-bit words (bytes when its size is not a multiple of 4), as a Python int."""
    flat = t.detach().contiguous().view(-1).view(torch.uint8)
    if flat.numel() % 4 == 0:
        flat = flat.view(torch.int32)
    return int(flat.sum(dtype=torch.int64).item())


@dataclass(slots=True)
class SharedState:
    """A descriptor of a ``ResumeState`` whose buffers stay on the producer's device."""

    share_id: str  # the producer's key for ``release``
    layout: StateLayout
    position: int
    first_block: int
    num_blocks: int  # full blocks in ``mla_rows``
    tail_start: int  # first position of the tail rows (-1: no tail)
    kda_meta: list[tuple[int, int, int]]  # (position, tp_rank, tp_size) per KDA shard
    handles: bytes  # the buffers, pickled for IPC: [mla_rows | None, tail | None, conv..., recurrent...]
    fingerprints: list[int]  # one per non-None buffer, in ``handles`` order
    nbytes: int  # bytes the consumer copies
    device: str  # where the buffers live (e.g. "cuda:0")
    pool: tuple[str, bytes] | None = None  # (pool id, pickled pool buffer) when ``handles`` holds pool ranges


_ALIGN = 256


class _Pool:
    """One shared device buffer and a first-fit allocator over it (NOTE 4)."""

    def __init__(self, nbytes: int, device: torch.device):
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.pool_id = uuid.uuid4().hex
        out = io.BytesIO()
        ForkingPickler(out, pickle.HIGHEST_PROTOCOL).dump(self.buf)
        self.handle = out.getvalue()
        self._free = [(0, nbytes)]  # sorted (offset, size) holes

    def alloc(self, nbytes: int) -> int | None:
        need = -(-nbytes // _ALIGN) * _ALIGN
        for i, (off, size) in enumerate(self._free):
            if size >= need:
                self._free[i:i + 1] = [(off + need, size - need)] if size > need else []
                return off
        return None

    def free(self, off: int, nbytes: int) -> None:
        need = -(-nbytes // _ALIGN) * _ALIGN
        holes = sorted([*self._free, (off, need)])
        merged = [holes[0]]
        for o, n in holes[1:]:
            po, pn = merged[-1]
            if po + pn == o:
                merged[-1] = (po, pn + n)
            else:
                merged.append((o, n))
        self._free = merged


class DeviceShares:
    """The producer's registry of shared state buffers (NOTE 1)."""

    def __init__(self, ttl_s: float = 120.0, pool_bytes: int = 0):
        self.ttl_s = ttl_s
        self.pool_bytes = pool_bytes  # NOTE 4 (0: share each buffer by itself)
        self._pool: _Pool | None = None
        self._live: dict[str, tuple[float, list[torch.Tensor]]] = {}
        self._ranges: dict[str, tuple[int, int]] = {}  # share id -> its pool range
        self._lock = threading.Lock()
        self.counters = {"shared": 0, "released": 0, "expired": 0, "shared_bytes": 0, "pooled": 0}

    def _pooled(self, tensors: list[torch.Tensor | None]) -> tuple[list, list[torch.Tensor], tuple[int, int]] | None:
        """Copy ``tensors`` into one range of the pool: (entries for the descriptor, views, range)."""
        present = [t for t in tensors if t is not None]
        if not self.pool_bytes or not present:
            return None
        dev = present[0].device
        if self._pool is None:
            self._pool = _Pool(self.pool_bytes, dev)
        if self._pool.buf.device != dev:
            return None
        sizes = [-(-t.nbytes // _ALIGN) * _ALIGN for t in present]
        with self._lock:
            base = self._pool.alloc(sum(sizes))
        if base is None:
            return None
        entries, views, off = [], [], base
        aligned = iter(sizes)
        for t in tensors:
            if t is None:
                entries.append(None)
                continue
            view = self._pool.buf[off:off + t.nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)
            entries.append((off, tuple(t.shape), t.dtype))
            views.append(view)
            off += next(aligned)
        return entries, views, (base, sum(sizes))

    def share(self, state: ResumeState) -> SharedState:
        """Share ``state``'s buffers (which must be one contiguous ``mla_rows`` buffer, when it has blocks)."""
        if state.mla_blocks and state.mla_rows is None:
            raise ValueError("share() needs the blocks as one buffer (export_state(on_device=True) makes one)")
        tensors: list[torch.Tensor | None] = [state.mla_rows if state.mla_blocks else None,
                                              state.tail.rows if state.tail is not None else None]
        tensors += [k.conv for k in state.kda] + [k.recurrent for k in state.kda]
        tensors = [None if t is None else t.contiguous() for t in tensors]
        share_id = uuid.uuid4().hex
        pooled = self._pooled(tensors)
        if pooled is not None:
            entries, present, span = pooled
            handles, pool = pickle.dumps(entries), (self._pool.pool_id, self._pool.handle)
        else:
            present = [t for t in tensors if t is not None]
            buf = io.BytesIO()
            ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(tensors)
            handles, pool, span = buf.getvalue(), None, None
        prints = [fingerprint(t) for t in present]  # also orders the buffers' writes before the IPC (NOTE 3)
        with self._lock:
            self._live[share_id] = (time.monotonic(), present)
            if span is not None:
                self._ranges[share_id] = span
                self.counters["pooled"] += 1
            self.counters["shared"] += 1
            self.counters["shared_bytes"] += sum(t.nbytes for t in present)
        self.reap()
        dev = present[0].device if present else torch.device("cpu")
        return SharedState(
            share_id, state.layout, state.position, state.first_block, len(state.mla_blocks),
            state.tail.start if state.tail is not None else -1,
            [(k.position, k.tp_rank, k.tp_size) for k in state.kda], handles, prints,
            sum(t.nbytes for t in present), str(dev), pool,
        )

    def _drop(self, share_id: str) -> bool:  # with the lock held
        entry = self._live.pop(share_id, None)
        span = self._ranges.pop(share_id, None)
        if span is not None:
            self._pool.free(*span)
        return entry is not None

    def release(self, share_id: str) -> bool:
        with self._lock:
            found = self._drop(share_id)
            if found:
                self.counters["released"] += 1
        return found

    def reap(self, now: float | None = None) -> int:
        """Drop shares older than ``ttl_s`` (their consumer never acked). Returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [k for k, (t, _) in self._live.items() if now - t > self.ttl_s]
            for k in old:
                self._drop(k)
            self.counters["expired"] += len(old)
        return len(old)

    def __len__(self) -> int:
        return len(self._live)

    def stats(self) -> dict:
        with self._lock:
            return dict(self.counters, live=len(self._live),
                        live_bytes=sum(sum(t.nbytes for t in ts) for _, ts in self._live.values()))


_MAPPED_POOLS: dict[str, torch.Tensor] = {}  # pool id -> this process's mapping of a producer's pool


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def open_shared(desc: SharedState, device: torch.device | str) -> ResumeState:
    """Map ``desc``'s buffers, copy them onto ``device`` and verify them; returns a ``ResumeState``
    whose tensors all live on ``device``. The mapping is dropped before this returns, so the
    caller acks the producer right after (NOTE 1). Raises ``CorruptObjectError`` on a bad copy."""
    device = torch.device(device)
    if desc.pool is not None:  # ranges of the producer's pool, mapped once per process (NOTE 4)
        pool_id, handle = desc.pool
        buf = _MAPPED_POOLS.get(pool_id)
        if buf is None:
            buf = _MAPPED_POOLS[pool_id] = pickle.loads(handle)
        mapped = [None if e is None else buf[e[0]:e[0] + _nbytes(e[1], e[2])].view(e[2]).view(e[1])
                  for e in pickle.loads(desc.handles)]
    else:
        mapped = pickle.loads(desc.handles)
    copies: list[torch.Tensor | None] = []
    try:
        for t in mapped:
            if t is None:
                copies.append(None)
                continue
            dst = torch.empty(t.shape, dtype=t.dtype, device=device)
            dst.copy_(t, non_blocking=device.type == "cuda")  # a peer copy between GPUs
            copies.append(dst)
    finally:
        del mapped  # unmap the producer's buffers (NOTE 1)
    got = [fingerprint(t) for t in copies if t is not None]  # also waits for the copies
    if got != desc.fingerprints:
        raise CorruptObjectError(f"device hand-off {desc.share_id}: fingerprints differ after the copy")
    mla_rows, tail_rows = copies[0], copies[1]
    n_kda = len(desc.kda_meta)
    convs, recs = copies[2:2 + n_kda], copies[2 + n_kda:]
    bs = desc.layout.block_size
    blocks = []
    if mla_rows is not None:
        blocks = [MLABlock(mla_rows[:, i * bs:(i + 1) * bs], (desc.first_block + i) * bs, bs)
                  for i in range(desc.num_blocks)]
    tail = None
    if tail_rows is not None:
        tail = MLABlock(tail_rows, desc.tail_start, desc.position - desc.tail_start)
    kda = [KDACheckpoint(c, r, pos, rank, size) for c, r, (pos, rank, size) in zip(convs, recs, desc.kda_meta,
                                                                                   strict=True)]
    return ResumeState(desc.layout, desc.position, blocks, desc.first_block, tail, kda,
                       mla_rows=mla_rows)
