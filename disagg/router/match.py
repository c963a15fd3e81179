"""Walk results: what ``PrefixIndex.match`` returns.

``MatchResult`` holds the walk's columns (row i for ``worker_ids[i]``), which
vectorized plugins read; ``matches`` / ``get`` give the per-worker
``PrefixMatch`` view, built on first use.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from disagg.router.types import TIER_INDEX, TIERS

_NO_TIER = -1
_ONE = np.uint64(1)


@dataclass(slots=True)
class PrefixMatch:
    """Result of a walk for one worker."""

    resumable_tokens: int = 0  # furthest resume point p (0 = nothing to resume)
    tier: str | None = None  # slowest tier read by the resume (None when p == 0)
    mla_blocks: int = 0  # consecutive MLA blocks readable from the start (any tier)


class MatchResult:
    """Walk result for one request over a set of candidate workers.

    Column form (what the walk produces and vectorized plugins read), row i
    for ``worker_ids[i]``; ``matches`` is the per-worker dict view, built on
    first use. Either form may be given to the constructor.
    """

    __slots__ = ("worker_ids", "resumable", "tiers", "mla_blocks", "common_blocks", "_matches", "_arrays")

    def __init__(
        self,
        matches: dict[str, PrefixMatch] | None = None,
        common_blocks: int = 0,
        *,
        worker_ids: list[str] | None = None,
        resumable: list[int] | None = None,
        tiers: list[int] | None = None,
        mla_blocks: list[int] | None = None,
        arrays: tuple[np.ndarray, np.ndarray] | None = None,
    ):
        self.common_blocks = common_blocks  # leading blocks >= common_min candidates read (and resume: index NOTE 8)
        self._matches = matches
        if matches is not None:
            worker_ids = list(matches)
            vals = list(matches.values())
            resumable = [m.resumable_tokens for m in vals]
            tiers = [_NO_TIER if m.tier is None else TIER_INDEX[m.tier] for m in vals]
            mla_blocks = [m.mla_blocks for m in vals]
        self.worker_ids: list[str] = worker_ids or []  # candidates, row order
        self.resumable: list[int] = resumable or []  # resumable tokens per row
        self.tiers: list[int] = tiers or []  # slowest tier index per row (-1: no resume)
        self.mla_blocks: list[int] = mla_blocks if mla_blocks is not None else []  # readable leading blocks per row
        assert len(self.worker_ids) == len(self.resumable) == len(self.tiers) == len(self.mla_blocks)
        self._arrays = arrays  # (resumable float64, tiers int64) equal to the lists, when the walk made them

    def columns(self) -> tuple[np.ndarray, np.ndarray]:
        """(resumable tokens as float64, tier index as int64), row order."""
        if self._arrays is None:
            self._arrays = (np.array(self.resumable, np.float64), np.array(self.tiers, np.int64))
        return self._arrays

    @property
    def matches(self) -> dict[str, PrefixMatch]:
        if self._matches is None:
            self._matches = {
                w: PrefixMatch(p, TIERS[t] if t >= 0 else None, m)
                for w, p, t, m in zip(self.worker_ids, self.resumable, self.tiers, self.mla_blocks, strict=True)
            }
        return self._matches

    def resume(self, worker_id: str) -> tuple[int, str | None]:
        """(resumable tokens, slowest tier) of one worker: ``get`` without the block count."""
        if self._matches is not None:
            m = self._matches.get(worker_id)
            return (m.resumable_tokens, m.tier) if m is not None else (0, None)
        try:
            i = self.worker_ids.index(worker_id)
        except ValueError:
            return 0, None
        t = self.tiers[i]
        return self.resumable[i], TIERS[t] if t >= 0 else None

    def get(self, worker_id: str) -> PrefixMatch:
        if self._matches is not None:
            return self._matches.get(worker_id) or PrefixMatch()
        try:
            i = self.worker_ids.index(worker_id)
        except ValueError:
            return PrefixMatch()
        t = self.tiers[i]
        return PrefixMatch(self.resumable[i], TIERS[t] if t >= 0 else None, self.mla_blocks[i])


class _Lengths:
    """Leading readable blocks per candidate, counted from the walk's alive masks on first use."""

    __slots__ = ("_alive", "_word", "_shift", "_list")

    def __init__(self, alive: np.ndarray, word: np.ndarray, shift: np.ndarray):
        self._alive, self._word, self._shift, self._list = alive, word, shift, None

    def _expand(self) -> list[int]:
        if self._list is None:  # alive[i]: readers of blocks 0..i, non-increasing: count the rows with the bit
            inside = (self._alive[:, self._word] >> self._shift) & _ONE
            self._list = inside.sum(axis=0, dtype=np.int64).tolist()
        return self._list

    def __len__(self) -> int:
        return len(self._word)

    def __getitem__(self, i: int) -> int:
        if self._list is not None:
            return self._list[i]
        column = self._alive[:, self._word[i]] >> self._shift[i]
        return int(np.count_nonzero(column & _ONE))

    def __iter__(self):
        return iter(self._expand())

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other)  # type: ignore[call-overload]


class _IntLengths:
    """``_Lengths`` of the int walk (``disagg.router.walk``): ``alive[i]`` the readers of blocks 0..i as ints."""

    __slots__ = ("_alive", "_bits", "_list")

    def __init__(self, alive: list[int], bits: list[int]):
        self._alive, self._bits, self._list = alive, bits, None

    def _count(self, bit: int) -> int:  # alive is non-increasing: the rows holding the bit lead
        n = 0
        for a in self._alive:
            if not a >> bit & 1:
                break
            n += 1
        return n

    def _expand(self) -> list[int]:
        if self._list is None:
            self._list = [self._count(b) for b in self._bits]
        return self._list

    def __len__(self) -> int:
        return len(self._bits)

    def __getitem__(self, i: int) -> int:
        if self._list is not None:
            return self._list[i]
        return self._count(self._bits[i])

    def __iter__(self):
        return iter(self._expand())

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other)  # type: ignore[call-overload]


def credit_node_state(m: MatchResult, candidates: set[str], node_of, state_node: str, held: int,
                      peer_reads: bool) -> MatchResult:
    """``m`` with the prompt's state held in ``state_node``'s shared tiers (``held`` tokens resumable
    there: a decode worker's node, where its hand-offs and turn ends land) credited to ``candidates``.

    A candidate on that node reads those tiers as its own (tier "host"); one on another node reads
    them through that node's state service (tier "remote") when ``peer_reads``. A candidate
    resuming at least as much by itself keeps its own row::

        resumable'(w) = max(resumable(w), held)    w on state_node, or any w with peer_reads

    Only the rows of ``candidates`` change (the prefill pool: what the P/D decider and the
    prefill placement read); ``m`` is left as it is.
    """
    if held <= 0 or not state_node:
        return m
    res, tiers = list(m.resumable), list(m.tiers)
    changed = False
    for i, wid in enumerate(m.worker_ids):
        if wid not in candidates or res[i] >= held:
            continue
        same = node_of(wid) == state_node
        if same or peer_reads:
            res[i], tiers[i] = held, TIER_INDEX["host" if same else "remote"]
            changed = True
    if not changed:
        return m
    return MatchResult(common_blocks=m.common_blocks, worker_ids=m.worker_ids, resumable=res, tiers=tiers,
                       mla_blocks=m.mla_blocks)
