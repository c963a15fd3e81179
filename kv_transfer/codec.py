"""Binary codec for MLA blocks, tails and KDA checkpoints.

An encoded object is a fixed 128-byte header, a payload of raw tensor bytes
(each tensor starting on a 64-byte boundary so zero-copy views are aligned) and
a 4-byte checksum trailer over header + payload:

    0        48                 112      128                         end-4  end
    | fixed  | 2 tensor specs   | parent |  payload (64-B aligned)   |  crc   |
      magic "DKVS", version, checksum algorithm, kind, layout fingerprint,
      payload length, position/start, span, rank, size   (all little-endian)

Positions: an MLA block or tail stores (start, span, dcp_rank, dcp_size); a KDA
checkpoint stores (position, 0, tp_rank, tp_size). A tail also stores the digest
of the last full block before it (``parent``), so a tail index can be rebuilt
from stored objects.

Tensors are written as byte views, so every torch dtype with a code in
``DTYPE_CODES`` round-trips bit-exactly, fp8 included.

Versions: 2 (written) has a one-byte checksum algorithm after the version byte
(``kv_transfer.checksum``: 1 CRC-32, 2 CRC32C); 1 (read only) had a two-byte
version and always CRC-32, so a version-1 object reads as version 1 with
algorithm byte 0 and stays decodable. A version-1 reader rejects version-2
objects as "unsupported format version 258/514" (a miss, then a recompute).

Checksum: CRC32C where ``google-crc32c`` is installed (hardware CRC, several
times zlib's CRC-32 here, GIL released), else CRC-32; it detects every burst
error up to 32 bits and any single flipped byte, and a corrupt object only
costs a recompute, so a cryptographic hash buys nothing. It is verified on
EVERY decode.

Hot paths: ``BlockCodec`` encodes and verifies-and-copies full MLA blocks with
a header template computed once per layout: per object one small struct pack
or compare, one numpy copy and one checksum call (both release the GIL), and
no torch allocation, so I/O threads run them in parallel with the engine.
"""

from __future__ import annotations

import functools
import struct
import warnings
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import torch

from kv_transfer import checksum as _checksum
from kv_transfer.errors import CorruptObjectError, LayoutMismatchError
from kv_transfer.objects import KDACheckpoint, MLABlock, StateLayout, dcp_count

# Decoding over a read-only buffer (bytes) without copying is deliberate: decoded
# tensors are read-only by contract. Silence torch's one-time warning about it.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

MAGIC = b"DKVS"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
HEADER_BYTES = 128
TRAILER_BYTES = 4
ALIGN = 64
MAX_DIMS = 4

_FIXED = struct.Struct("<4sBBBB16sQqIHH")  # 48 bytes: magic, version, checksum algo, kind, num_tensors, ...
_POSITIONS = struct.Struct("<qIHH")  # the fixed header's last 16 bytes: position, span, rank, size
_POSITIONS_AT = _FIXED.size - _POSITIONS.size
_TENSOR = struct.Struct("<BBH4IQ4x")  # 32 bytes: dtype, ndim, pad, dims[4], offset
_PARENT = struct.Struct("<16s")
_CRC = struct.Struct("<I")
assert _CRC.size == TRAILER_BYTES == _checksum.TRAILER  # ``checksum.seal`` writes the same trailer
_POSITIONS_NP = np.dtype([("start", "<i8"), ("span", "<u4"), ("rank", "<u2"), ("size", "<u2")])
assert _FIXED.size + 2 * _TENSOR.size + _PARENT.size == HEADER_BYTES

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float32: 3,
    torch.float64: 4,
    torch.float8_e4m3fn: 5,
    torch.float8_e5m2: 6,
    torch.float8_e4m3fnuz: 7,
    torch.float8_e5m2fnuz: 8,
    torch.int8: 9,
    torch.uint8: 10,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class ObjectKind(IntEnum):
    MLA = 1  # a full MLA block
    TAIL = 2  # MLA rows of a partial block ending at a resume point
    KDA = 3  # one TP shard of a KDA checkpoint


@dataclass(frozen=True, slots=True)
class TensorSpec:
    dtype: torch.dtype  # element type
    shape: tuple[int, ...]  # dims (at most 4)
    offset: int  # byte offset within the payload (64-byte aligned)

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class ObjectHeader:
    kind: ObjectKind  # what the payload holds
    fingerprint: str  # StateLayout.fingerprint() of the writer
    payload_len: int  # payload bytes including alignment padding
    position: int  # MLA: start; KDA: position
    span: int  # MLA: positions covered; KDA: 0
    rank: int  # dcp_rank (MLA) or tp_rank (KDA)
    size: int  # dcp_size (MLA) or tp_size (KDA)
    tensors: tuple[TensorSpec, ...]  # one (MLA rows) or two (KDA conv, recurrent)
    parent: bytes  # tail: digest of the last full block before it; else zeros
    checksum: int = _checksum.CRC32  # trailer algorithm (kv_transfer.checksum code)

    @property
    def total_len(self) -> int:
        return HEADER_BYTES + self.payload_len + TRAILER_BYTES


def checksum(data: bytes | bytearray | memoryview, value: int = 0, algo: int | None = None) -> int:
    """The trailer checksum of ``data`` (default: the algorithm this build writes)."""
    return _checksum.compute(_checksum.WRITE_ALGO if algo is None else algo, data, value)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _tensors_of(obj: MLABlock | KDACheckpoint) -> list[torch.Tensor]:
    return [obj.rows] if isinstance(obj, MLABlock) else [obj.conv, obj.recurrent]


def _specs(tensors: list[torch.Tensor]) -> tuple[tuple[TensorSpec, ...], int]:
    specs, off = [], 0
    for t in tensors:
        assert t.dtype in DTYPE_CODES, f"unsupported dtype {t.dtype}"
        assert t.dim() <= MAX_DIMS, "at most 4 dims per tensor"
        spec = TensorSpec(t.dtype, tuple(t.shape), off)
        specs.append(spec)
        off = _align(off + spec.nbytes)
    return tuple(specs), off


def encoded_size(obj: MLABlock | KDACheckpoint) -> int:
    """Bytes ``encode`` will produce for ``obj``."""
    _, payload_len = _specs(_tensors_of(obj))
    return HEADER_BYTES + payload_len + TRAILER_BYTES


def encode_into(
    obj: MLABlock | KDACheckpoint,
    layout: StateLayout,
    out: memoryview | bytearray,
    parent: bytes | None = None,
) -> int:
    """Write the encoding of ``obj`` into ``out`` (e.g. a host-arena region).

    Returns the number of bytes written (``encoded_size(obj)``).
    """
    tensors = _tensors_of(obj)
    specs, payload_len = _specs(tensors)
    total = HEADER_BYTES + payload_len + TRAILER_BYTES
    out = memoryview(out).cast("B")
    assert len(out) >= total, f"output region too small: {len(out)} < {total}"
    if isinstance(obj, MLABlock):
        kind = ObjectKind.MLA if obj.span == layout.block_size else ObjectKind.TAIL
        assert 0 < obj.span <= layout.block_size, f"bad MLA span {obj.span}"
        fields = (obj.start, obj.span, obj.dcp_rank, obj.dcp_size)
    else:
        kind = ObjectKind.KDA
        fields = (obj.position, 0, obj.tp_rank, obj.tp_size)
    parent = parent or bytes(16)
    assert len(parent) == 16, "parent digest must be 16 bytes"
    _FIXED.pack_into(out, 0, MAGIC, FORMAT_VERSION, _checksum.WRITE_ALGO, int(kind), len(specs),
                     layout.fingerprint().encode(), payload_len, *fields)
    for i in range(2):
        if i < len(specs):
            s = specs[i]
            dims = list(s.shape) + [0] * (MAX_DIMS - len(s.shape))
            _TENSOR.pack_into(out, _FIXED.size + i * _TENSOR.size,
                              DTYPE_CODES[s.dtype], len(s.shape), 0, *dims, s.offset)
        else:
            out[_FIXED.size + i * _TENSOR.size : _FIXED.size + (i + 1) * _TENSOR.size] = bytes(_TENSOR.size)
    _PARENT.pack_into(out, HEADER_BYTES - _PARENT.size, parent)
    payload = out[HEADER_BYTES : HEADER_BYTES + payload_len]
    cursor = 0
    for t, s in zip(tensors, specs, strict=True):
        if s.offset > cursor:  # zero the alignment padding: output is deterministic
            payload[cursor : s.offset] = bytes(s.offset - cursor)
        if s.nbytes:
            src = _as_numpy(t.detach().cpu())
            dst = np.frombuffer(payload, dtype=src.dtype, count=src.size, offset=s.offset)
            np.copyto(dst.reshape(src.shape), src)  # strided sources too, no temporary
        cursor = s.offset + s.nbytes
    if payload_len > cursor:
        payload[cursor:payload_len] = bytes(payload_len - cursor)
    crc = checksum(out[: HEADER_BYTES + payload_len])
    _CRC.pack_into(out, HEADER_BYTES + payload_len, crc)
    return total


def encode(obj: MLABlock | KDACheckpoint, layout: StateLayout, parent: bytes | None = None) -> bytearray:
    """The encoding of ``obj`` as a new bytearray."""
    buf = bytearray(encoded_size(obj))
    encode_into(obj, layout, buf, parent)
    return buf


def read_header(buf: bytes | bytearray | memoryview) -> ObjectHeader:
    """Parse and sanity-check the header; does NOT verify the checksum."""
    mv = memoryview(buf).cast("B")
    if len(mv) < HEADER_BYTES + TRAILER_BYTES:
        raise CorruptObjectError(f"truncated object: {len(mv)} bytes")
    magic, version, algo, kind, num_tensors, fp, payload_len, pos, span, rank, size = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptObjectError(f"bad magic {magic!r}")
    if version == 1:  # version 1: a two-byte version (so the next byte is 0), always CRC-32
        if algo != 0:
            raise CorruptObjectError(f"unsupported format version {version + 256 * algo} (reads {READABLE_VERSIONS})")
        algo = _checksum.CRC32
    elif version not in READABLE_VERSIONS:
        raise CorruptObjectError(f"unsupported format version {version} (reads {READABLE_VERSIONS})")
    if algo not in _checksum.NAMES:
        raise CorruptObjectError(f"unknown checksum algorithm {algo}")
    if kind not in (1, 2, 3) or num_tensors != (2 if kind == ObjectKind.KDA else 1):
        raise CorruptObjectError(f"bad object kind {kind} / {num_tensors} tensors")
    if HEADER_BYTES + payload_len + TRAILER_BYTES != len(mv):
        raise CorruptObjectError(f"length mismatch: header says {payload_len}, have {len(mv)}")
    specs = []
    for i in range(num_tensors):
        code, ndim, _, d0, d1, d2, d3, off = _TENSOR.unpack_from(mv, _FIXED.size + i * _TENSOR.size)
        if code not in CODE_DTYPES or not 0 < ndim <= MAX_DIMS or off % ALIGN:
            raise CorruptObjectError(f"bad tensor descriptor {i}")
        spec = TensorSpec(CODE_DTYPES[code], (d0, d1, d2, d3)[:ndim], off)
        if off + spec.nbytes > payload_len:
            raise CorruptObjectError(f"tensor {i} overruns the payload")
        specs.append(spec)
    if size == 0 or rank >= size:
        raise CorruptObjectError(f"bad rank {rank} of {size}")
    (parent,) = _PARENT.unpack_from(mv, HEADER_BYTES - _PARENT.size)
    try:
        fingerprint = fp.decode("ascii")
    except UnicodeDecodeError as e:
        raise CorruptObjectError("bad layout fingerprint") from e
    return ObjectHeader(ObjectKind(kind), fingerprint, payload_len, pos, span, rank, size,
                        tuple(specs), parent, algo)


def verify(buf: bytes | bytearray | memoryview) -> ObjectHeader:
    """Parse the header and verify the CRC over header + payload."""
    mv = memoryview(buf).cast("B")
    header = read_header(mv)
    end = HEADER_BYTES + header.payload_len
    (stored,) = _CRC.unpack_from(mv, end)
    if checksum(mv[:end], algo=header.checksum) != stored:
        raise CorruptObjectError(f"checksum ({_checksum.NAMES[header.checksum]}) mismatch")
    return header


def _tensor(mv: memoryview, spec: TensorSpec, copy: bool) -> torch.Tensor:
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=spec.dtype)
    raw = torch.frombuffer(mv, dtype=torch.uint8, count=spec.nbytes, offset=HEADER_BYTES + spec.offset)
    t = raw.view(spec.dtype).view(spec.shape)
    if not copy:
        return t
    out = torch.empty(spec.shape, dtype=spec.dtype)
    host_copy(out, t)
    return out



def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for CPU tensors of one dtype, through numpy on same-width integer views.

    numpy copies in the calling thread and releases the GIL; torch's CPU copy
    starts an intra-op parallel region per call, which from several I/O
    threads at once oversubscribes the cores (measured 30x slower under load).
    """
    assert dst.dtype == src.dtype and dst.shape == src.shape, "host_copy needs equal dtypes and shapes"
    np.copyto(_as_numpy(dst), _as_numpy(src))


_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's bytes as same-width integers (numpy has no bf16 / fp8)."""
    return t.view(_TORCH_INT[t.dtype.itemsize]).numpy()


def _check_layout(h: ObjectHeader, layout: StateLayout) -> None:
    if h.fingerprint != layout.fingerprint():
        raise LayoutMismatchError(f"layout fingerprint {h.fingerprint} != {layout.fingerprint()}")
    if h.kind == ObjectKind.KDA:
        heads = layout.kda_heads // h.size
        want = [
            (getattr(torch, layout.conv_dtype), (layout.num_kda_layers, layout.conv_width - 1, 3 * heads * layout.head_k)),
            (getattr(torch, layout.state_dtype), (layout.num_kda_layers, heads, layout.head_k, layout.head_v)),
        ]
    else:
        if not 0 < h.span <= layout.block_size or (h.kind == ObjectKind.MLA) != (h.span == layout.block_size):
            raise LayoutMismatchError(f"span {h.span} does not fit block size {layout.block_size}")
        rows = dcp_count(h.position, h.span, h.size, h.rank)
        want = [(getattr(torch, layout.cache_dtype), (layout.num_mla_layers, rows, layout.latent_dim))]
    for spec, (dtype, shape) in zip(h.tensors, want, strict=True):
        if spec.dtype != dtype or spec.shape != shape:
            raise LayoutMismatchError(f"tensor {spec.dtype}{list(spec.shape)} != {dtype}{list(shape)}")


def decode(
    buf: bytes | bytearray | memoryview,
    layout: StateLayout,
    copy: bool = False,
) -> MLABlock | KDACheckpoint:
    """Verify and decode one object.

    Args:
        buf: exactly one encoded object.
        layout: the reader's layout; the header must match it.
        copy: False returns tensors that alias ``buf`` (zero-copy; keep ``buf``
            alive and unmodified while they are used); True returns owned tensors.

    Raises:
        CorruptObjectError: bad magic/version, truncation, checksum mismatch,
            or (LayoutMismatchError) a header that does not fit ``layout``.
    """
    mv = memoryview(buf).cast("B")
    h = verify(mv)
    _check_layout(h, layout)
    if h.kind == ObjectKind.KDA:
        conv, rec = (_tensor(mv, s, copy) for s in h.tensors)
        return KDACheckpoint(conv, rec, h.position, h.rank, h.size)
    return MLABlock(_tensor(mv, h.tensors[0], copy), h.position, h.span, h.size, h.rank)


def decode_mla(buf: bytes | bytearray | memoryview, layout: StateLayout, copy: bool = False) -> MLABlock:
    obj = decode(buf, layout, copy)
    if not isinstance(obj, MLABlock):
        raise CorruptObjectError("expected an MLA block or tail")
    return obj


def decode_kda(buf: bytes | bytearray | memoryview, layout: StateLayout, copy: bool = False) -> KDACheckpoint:
    obj = decode(buf, layout, copy)
    if not isinstance(obj, KDACheckpoint):
        raise CorruptObjectError("expected a KDA checkpoint")
    return obj


class BlockCodec:
    """Encode and verify-and-copy full MLA blocks (no DCP) of one layout: the hot path.

    The 128-byte header of a full block differs between blocks only in its
    positions, so it is built once; an encode writes the template, packs the
    start, copies the rows and checksums; a decode compares the header with the
    template, checksums and copies the rows into the caller's buffer. Anything
    that does not match the template (another checksum algorithm, a tail, a
    DCP shard, damage) returns None from ``decode_into`` and takes the general
    ``decode`` path, which reads it or says exactly what is wrong.

    NOTES
    1. ``decode_into`` writes ``dst`` only after the checksum has passed.
    2. Sources and destinations are numpy integer views (``_as_numpy``) of
       [num_mla_layers, block_size, latent_dim]; they may be strided slices of
       one larger buffer.
    3. ``encode_run`` writes a run of blocks whose objects lie evenly spaced
       (slots of one size class): the headers with two array assignments, the
       rows of every block with one strided copy. Each call into numpy or the
       checksum library lets go of the GIL and takes it back, and a thread that
       takes it back from a busy engine thread costs that thread a hand-off;
       per run this is a few calls, per block it was three.
    """

    def __init__(self, layout: StateLayout):
        self.layout = layout
        self.block_size = layout.block_size
        dtype = getattr(torch, layout.cache_dtype)
        self.shape = (layout.num_mla_layers, layout.block_size, layout.latent_dim)
        self.np_dtype = np.dtype(_as_numpy(torch.empty(0, dtype=dtype)).dtype)
        self.count = self.shape[0] * self.shape[1] * self.shape[2]
        self.nbytes = self.count * dtype.itemsize
        self.payload_len = _align(self.nbytes)
        self.end = HEADER_BYTES + self.payload_len  # checksummed bytes
        self.total_len = self.end + TRAILER_BYTES
        self.algo = _checksum.WRITE_ALGO
        block = MLABlock(torch.zeros(self.shape, dtype=dtype), 0, layout.block_size)
        sample = encode(block, layout)
        self._template = bytes(sample[:HEADER_BYTES])
        self._head = self._template[:_POSITIONS_AT]  # everything before the positions
        self._rest = self._template[_FIXED.size :]  # tensor specs + (zero) parent
        self._pad = bytes(self.payload_len - self.nbytes)

    def encode_into(self, out: memoryview, src: np.ndarray, start: int, seal: bool = True) -> int:
        """Encode the block at ``start`` with rows ``src`` into ``out``; returns bytes written
        (``seal=False``: without the checksum, as ``encode_run``)."""
        assert src.shape == self.shape and src.dtype == self.np_dtype, f"rows {src.shape} {src.dtype}"
        assert start % self.block_size == 0, f"block start {start} is not block-aligned"
        out = out.cast("B") if out.format != "B" else out
        assert len(out) >= self.total_len, f"output region too small: {len(out)} < {self.total_len}"
        out[:HEADER_BYTES] = self._template
        _POSITIONS.pack_into(out, _POSITIONS_AT, start, self.block_size, 0, 1)
        dst = np.frombuffer(out, dtype=self.np_dtype, count=self.count, offset=HEADER_BYTES)
        np.copyto(dst.reshape(self.shape), src)
        if self._pad:
            out[HEADER_BYTES + self.nbytes : self.end] = self._pad
        if seal:
            _CRC.pack_into(out, self.end, _checksum.compute(self.algo, out[: self.end]))
        return self.total_len

    def encode_run(self, dst: np.ndarray, src: np.ndarray, starts: np.ndarray, seal: bool = True) -> None:
        """Encode ``m`` consecutive blocks at once (NOTE 3).

        Args:
            dst: [m, total_len] uint8, object j in row j (rows may lie further apart: a view
                over slots of one size class in the arena).
            src: [num_mla_layers, m * block_size, latent_dim] rows, block j at columns
                ``j * bs : (j + 1) * bs`` (e.g. a state's one staging buffer).
            starts: block j's start position, int64 [m].
            seal: write the checksums; False leaves the trailers for ``checksum.seal`` (the tier
                owner's ``seal_many``).
        """
        m = len(starts)
        layers, bs, dim = self.shape
        assert dst.dtype == np.uint8 and dst.shape == (m, self.total_len), f"objects {dst.shape}"
        assert src.shape == (layers, m * bs, dim) and src.dtype == self.np_dtype, f"rows {src.shape} {src.dtype}"
        assert not np.any(np.asarray(starts) % bs), "block starts must be block-aligned"
        dst[:, :HEADER_BYTES] = np.frombuffer(self._template, dtype=np.uint8)
        pos = np.zeros(m, dtype=_POSITIONS_NP)
        pos["start"], pos["span"], pos["size"] = starts, bs, 1
        dst[:, _POSITIONS_AT : _POSITIONS_AT + _POSITIONS.size] = pos.view(np.uint8).reshape(m, -1)
        payload = dst[:, HEADER_BYTES : HEADER_BYTES + self.nbytes].view(self.np_dtype).reshape(m, layers, bs, dim)
        assert np.may_share_memory(payload, dst), "the rows view must be of the objects, not a copy"
        np.copyto(payload, src.reshape(layers, m, bs, dim).transpose(1, 0, 2, 3))  # the one bulk copy
        if self._pad:
            dst[:, HEADER_BYTES + self.nbytes : self.end] = 0
        if seal:
            for j in range(m):
                _checksum.seal(memoryview(dst[j]), self.algo)

    def verify(self, buf: memoryview) -> int | None:
        """Check one full block in place (header template, then checksum); its start, or None when
        the object is not a template block of this layout (use ``decode``). Raises
        CorruptObjectError on a checksum mismatch. Its rows are bytes
        ``[HEADER_BYTES, HEADER_BYTES + nbytes)`` of the object."""
        mv = buf.cast("B") if buf.format != "B" else buf
        start = self.check_header(mv)
        if start is None:
            return None
        (stored,) = _CRC.unpack_from(mv, self.end)
        if _checksum.compute(self.algo, mv[: self.end]) != stored:
            raise CorruptObjectError(f"checksum ({_checksum.NAMES[self.algo]}) mismatch")
        return start

    def check_header(self, buf: memoryview) -> int | None:
        """``verify`` without the checksum: the block's start if ``buf`` is a template block of this
        layout, else None (the caller checks the checksum, e.g. on the device)."""
        mv = buf.cast("B") if buf.format != "B" else buf
        if len(mv) != self.total_len or mv[:_POSITIONS_AT] != self._head or mv[_FIXED.size : HEADER_BYTES] != self._rest:
            return None
        start, span, rank, size = _POSITIONS.unpack_from(mv, _POSITIONS_AT)
        if span != self.block_size or rank != 0 or size != 1 or start % self.block_size:
            return None
        return start

    def decode_into(self, buf: memoryview, dst: np.ndarray) -> int | None:
        """``verify`` one full block, then copy its rows into ``dst``; its start, or None (as
        ``verify``)."""
        start = self.verify(buf)
        if start is None:
            return None
        mv = buf.cast("B") if buf.format != "B" else buf
        src = np.frombuffer(mv, dtype=self.np_dtype, count=self.count, offset=HEADER_BYTES)
        np.copyto(dst, src.reshape(self.shape))
        return start


@functools.lru_cache(maxsize=16)
def block_codec(layout: StateLayout) -> BlockCodec:
    """The (cached) ``BlockCodec`` of ``layout``."""
    return BlockCodec(layout)
