"""Synthetic prompt tokens from a trace's hash ids.

Each hash id expands to one block of ``block_size`` token ids in
``[first_id, vocab_size)``, drawn from a counter-based generator keyed by the
id (SplitMix64 over ``(seed, key, position)``), so the same id always gives
the same tokens, in any process, and ids never need a lookup table::

    hash_ids  [  7  ][  8  ][ 91 ]          block_size = 4, input_length = 10
    tokens    a b c d e f g h i j (k l)      the last block is truncated

Cache busting: replaying a session again (recycling, or a new sweep point)
must not hit the cache entries of its earlier replay. ``salt != 0`` remaps
every *session-unique* id to a new key, while ids in ``shared_ids`` (the
global tool/system prefix, shared by several sessions) keep their tokens, as
a second user of the same agent would.

Text mode: for servers that only take text, each token id maps to one of a
fixed list of pseudo-words; the server's tokenizer decides the real token
count, so prompt lengths are approximate in this mode.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from disagg.tools.bench.trace import DEFAULT_BLOCK_SIZE, TraceRecord

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_SALT_TAG = 0x5A17C0DE


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer over a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64, copy=True) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def _mix_scalar(x: int) -> int:
    return int(splitmix64(np.array([x & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))[0])


def shared_hash_ids(records: Iterable[TraceRecord]) -> frozenset[int]:
    """Ids used by more than one session family (a session plus its subagents)."""
    owner: dict[int, str] = {}
    shared: set[int] = set()
    for rec in records:
        family = rec.parent_session or rec.session_id
        for h in rec.hash_ids:
            prev = owner.setdefault(h, family)
            if prev != family:
                shared.add(h)
    return frozenset(shared)


def _make_words(n: int = 4096) -> list[str]:
    onsets = ["b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
    codas = ["", "n", "r", "s", "t", "l", "x", "m"]
    words: list[str] = []
    for i in range(n):
        a, b = divmod(i, len(onsets) * len(vowels) * len(codas))
        o, rest = divmod(b, len(vowels) * len(codas))
        v, c = divmod(rest, len(codas))
        word = onsets[o] + vowels[v] + codas[c]
        words.append(word + (onsets[a % len(onsets)] + vowels[a % len(vowels)] if a else ""))
    return words


WORDS: tuple[str, ...] = tuple(_make_words())


@dataclass(slots=True)
class TokenFactory:
    """Deterministic token blocks for hash ids.

    NOTE 1: equal (key, seed) -> equal tokens, across processes and runs.
    NOTE 2: a salt never changes the tokens of an id in ``shared_ids``.
    """

    block_size: int = DEFAULT_BLOCK_SIZE  # default when a record carries none
    vocab_size: int = 32_000  # token ids are < vocab_size
    first_id: int = 100  # token ids are >= first_id (skips special tokens)
    seed: int = 0  # changes every block's tokens
    shared_ids: frozenset[int] = field(default_factory=frozenset)  # ids a salt leaves alone

    def __post_init__(self) -> None:
        if not 0 <= self.first_id < self.vocab_size:
            raise ValueError(
                f"need 0 <= first_id < vocab_size, got {self.first_id}, {self.vocab_size}"
            )
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")

    def block_keys(self, hash_ids: Sequence[int], salt: int = 0) -> np.ndarray:
        """Per-block generator keys after salting (what a cache would see as identity)."""
        ids = np.asarray(hash_ids, dtype=np.uint64)
        if salt == 0 or ids.size == 0:
            return ids
        salted = splitmix64(ids ^ np.uint64(_mix_scalar(salt ^ _SALT_TAG)))
        if self.shared_ids:
            keep = np.fromiter(
                (h in self.shared_ids for h in hash_ids), dtype=bool, count=len(hash_ids)
            )
            salted = np.where(keep, ids, salted)
        return salted

    def token_array(
        self,
        hash_ids: Sequence[int],
        input_length: int,
        salt: int = 0,
        block_size: int | None = None,
    ) -> np.ndarray:
        """Token ids (int64) of a prompt: blocks concatenated, truncated to ``input_length``."""
        bs = block_size or self.block_size
        if len(hash_ids) * bs < input_length:
            raise ValueError(f"{len(hash_ids)} blocks of {bs} cannot cover {input_length} tokens")
        keys = self.block_keys(hash_ids, salt)
        with np.errstate(over="ignore"):
            base = splitmix64(keys ^ np.uint64(_mix_scalar(self.seed)))
            grid = base[:, None] + np.arange(bs, dtype=np.uint64)[None, :]
        flat = splitmix64(grid.reshape(-1)[:input_length])
        span = np.uint64(self.vocab_size - self.first_id)
        return (flat % span).astype(np.int64) + self.first_id

    def prompt_ids(self, record: TraceRecord, salt: int = 0) -> np.ndarray:
        return self.token_array(record.hash_ids, record.input_length, salt, record.block_size)

    def prompt_text(self, record: TraceRecord, salt: int = 0) -> str:
        """Deterministic words, one per synthetic token."""
        ids = self.prompt_ids(record, salt)
        words = WORDS
        n = len(words)
        return " ".join(words[i % n] for i in ids.tolist())
