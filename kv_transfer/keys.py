"""Content keys for stored state: chained block hashes over token IDs.

A prompt is cut into blocks of ``block_size`` tokens. Block ``i`` is named by

    h_0 = H("disagg/root/v1" | extras)
    h_i = H(h_{i-1} | tokens[(i-1)*bs : i*bs])            (16-byte digests)

so a block's key names its whole prefix: equal keys mean equal prefixes. The
extras (model id, layout version, tenant cache salt) enter the root, so two
tenants, two models or two cache layouts never share a key.

A resume point ``p`` that is not block-aligned is named by a *tail* digest over
the last full block's hash and the tokens after it:

    tail(p) = H("tail" | h_{p // bs} | tokens[(p // bs)*bs : p])

    tokens  |<- block 1 ->|<- block 2 ->|<- tail ->|
    keys           h_1           h_2      tail(p)
    prefix_digest(p) = h_{p/bs} if p % bs == 0 else tail(p)

H is SHA-256 truncated to 16 bytes: stable across processes, machines and
Python versions (never Python's ``hash()``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DIGEST_BYTES = 16
LAYOUT_VERSION = 1


def _h(*parts: bytes) -> bytes:
    m = hashlib.sha256()
    for p in parts:
        m.update(p)
    return m.digest()[:DIGEST_BYTES]


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<i8").tobytes()


@dataclass(frozen=True, slots=True)
class KeyExtras:
    """What, besides the tokens, decides whether two prefixes share state."""

    model_id: str  # model identity (name + weights fingerprint)
    layout_version: int = LAYOUT_VERSION  # cache layout / dtype version
    cache_salt: str = ""  # tenant isolation salt ("" = shared)

    def root(self) -> bytes:
        return _h(
            b"disagg/root/v1|",
            self.model_id.encode(),
            b"|",
            str(self.layout_version).encode(),
            b"|",
            self.cache_salt.encode(),
        )


class BlockHasher:
    """Computes chained block digests and prefix digests for one key space.

    Args:
        block_size: tokens per block.
        extras: model id, layout version and tenant salt entering the root.
    """

    def __init__(self, block_size: int, extras: KeyExtras):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.extras = extras
        self._root = extras.root()

    def with_salt(self, cache_salt: str) -> BlockHasher:
        """The same key space for another tenant."""
        return BlockHasher(
            self.block_size,
            KeyExtras(self.extras.model_id, self.extras.layout_version, cache_salt),
        )

    @property
    def root(self) -> bytes:
        return self._root

    def block_hashes(self, tokens: Sequence[int], parent: bytes | None = None) -> list[bytes]:
        """Digests of every *full* block of ``tokens`` (h_1 .. h_n)."""
        bs = self.block_size
        h = self._root if parent is None else parent
        n = len(tokens) // bs
        raw = _token_bytes(tokens[: n * bs])  # one conversion; block i is raw[i * 8 bs : (i + 1) * 8 bs]
        out: list[bytes] = []
        step = 8 * bs
        sha = hashlib.sha256
        for i in range(n):
            m = sha(h)
            m.update(raw[i * step : (i + 1) * step])
            h = m.digest()[:DIGEST_BYTES]
            out.append(h)
        return out

    def next_hash(self, parent: bytes, block_tokens: Sequence[int]) -> bytes:
        assert len(block_tokens) == self.block_size, "a block hash needs a full block"
        return _h(parent, _token_bytes(block_tokens))

    def tail_digest(self, parent: bytes, tail_tokens: Sequence[int]) -> bytes:
        assert 0 < len(tail_tokens) < self.block_size, "a tail is a non-empty partial block"
        return _h(b"tail|", parent, _token_bytes(tail_tokens))

    def tail_digests(self, parent: bytes, block_tokens: Sequence[int]) -> list[bytes]:
        """``tail_digest(parent, block_tokens[:t])`` for t = 1 .. len(block_tokens), in one pass."""
        assert len(block_tokens) < self.block_size, "tails are shorter than a block"
        m = hashlib.sha256(b"tail|")
        m.update(parent)
        out = []
        for chunk in np.asarray(block_tokens, dtype="<i8"):
            m.update(chunk.tobytes())
            out.append(m.copy().digest()[:DIGEST_BYTES])
        return out

    def prefix_digest(
        self, tokens: Sequence[int], position: int, hashes: list[bytes] | None = None
    ) -> bytes:
        """Digest naming the prefix ``tokens[:position]`` (a resume point)."""
        assert 0 < position <= len(tokens), f"bad resume position {position}"
        bs = self.block_size
        n_full = position // bs
        if hashes is None:
            hashes = self.block_hashes(tokens[: n_full * bs])
        parent = hashes[n_full - 1] if n_full else self._root
        if position % bs == 0:
            return parent
        return self.tail_digest(parent, tokens[n_full * bs : position])


@dataclass(frozen=True, slots=True)
class ObjectKey:
    """Name of one stored object.

    kind: "mla" (a full MLA block, all MLA layers), "tail" (MLA rows of a partial
    block ending at a resume point) or "kda" (KDA checkpoint at a resume point).
    digest: block digest (mla) or prefix digest (tail, kda).
    shard: which part of a sharded object: "" for MLA (stored once per TP
    group), "tp{rank}of{size}" for KDA head shards, "dcp{rank}of{size}" for
    DCP-interleaved MLA rows.
    """

    kind: str
    digest: bytes
    shard: str = ""

    def __post_init__(self) -> None:
        assert self.kind in ("mla", "tail", "kda"), f"unknown object kind {self.kind!r}"
        assert len(self.digest) == DIGEST_BYTES, "digest must be 16 bytes"

    def __str__(self) -> str:
        s = f"{self.kind}:{self.digest.hex()}"
        return f"{s}:{self.shard}" if self.shard else s

    @classmethod
    def parse(cls, text: str) -> ObjectKey:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"malformed object key {text!r}")
        return cls(parts[0], bytes.fromhex(parts[1]), parts[2] if len(parts) == 3 else "")


def kda_shard(tp_rank: int, tp_size: int) -> str:
    return f"tp{tp_rank}of{tp_size}"


def dcp_shard(dcp_rank: int, dcp_size: int) -> str:
    return f"dcp{dcp_rank}of{dcp_size}"
