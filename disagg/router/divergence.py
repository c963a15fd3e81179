"""Where sessions' follow-ups diverge, learned by the router from every request it routes.

A worker's checkpoint placement (``disagg.reuse.placement``) learns how far back
from its predecessor's last full block a follow-up diverges, but only from the
follow-ups it serves whose predecessor it also served (placement NOTE 4). The
router sees every turn of every session, so it runs the same class over all of
them, and each decision carries the learned distances
(``RouteDecision.checkpoint_back``, in tokens); the decode-side flow keeps its
prefill's extra checkpoints there instead of at its own.

Per session the router keeps its previous prompt's length, its number of full
blocks ``n`` and the 8-byte prefixes of its last ``max_blocks_back + 1`` block
digests (``W`` of them). Digests are chained, so a follow-up shares its
predecessor's first ``i`` blocks exactly when their ``i``-th digests agree, and
whether they agree is monotone in ``i``: a binary search over the window finds
the divergence::

    predecessor  h1 h2 ... | h(n-W+1) ... h(n-2) h(n-1) h(n)   <- window kept
    follow-up    h1 h2 ... | h(n-W+1) ... h(n-2) g(n-1) ...    shares n - 2 blocks: 1 back

A follow-up that diverged before the window (a compaction, a rewrite) is past
``max_blocks_back`` and would not be learned anyway (placement ``observe``).

Sessions that never come back (one-turn questions on shared documents, one-shot
calls) teach nothing, and until a follow-up is learned a decision names no
distances, so every decode-side worker keeps its placement's cold-start back
prior: three extra KDA checkpoints a prompt (each one KDA state, ~143 MiB for
K3), none ever resumed. The router sees every session start: once
``one_turn_after`` sessions have started and none has sent a follow-up, its
decisions name no distances (``()``: no back points), until a follow-up comes.
A worker cannot tell so itself: a session that moved to it looks new there.
Measured on the held-out ``rag/pd`` (1,200 one-turn questions on four
documents): the prior's points filled the prefill pool's devices and pushed
the documents' checkpoints out (docs/router.md, "Round 45").

Cost: ``observe`` is one binary search (log2 W ~ 7 digest compares), a join of
W 8-byte slices and the placement's update (at most ``max_blocks_back + 1``
bins); ``hint`` is cached between observations. Memory: at most ``max_sessions``
windows of ``8 W`` bytes (520 B at W = 65).
"""

from __future__ import annotations

from collections.abc import Sequence

from disagg.reuse.ledger import _Lru
from disagg.reuse.placement import CheckpointPlacement

_PREFIX = 8  # bytes of a block digest kept per window entry


class DivergenceLearner:
    """The router's ``CheckpointPlacement``, fed from the sessions it routes (module docstring)."""

    def __init__(self, max_sessions: int = 1 << 15, one_turn_after: int = 256):
        if one_turn_after < 1:
            raise ValueError("one_turn_after must be >= 1")
        self.placement: CheckpointPlacement | None = None  # made at the first session's request (its block size)
        self.one_turn_after = one_turn_after  # sessions started with no follow-up: the prior goes (docstring)
        self.sessions_started = 0  # prompts of a session not seen before (or forgotten: ``max_sessions``)
        self._prev = _Lru(max_sessions)  # session -> (prompt length, full blocks, window), oldest evicted first
        self._hint: tuple[int, ...] | None = None  # cached ``hint()`` (None: recompute)

    def observe(self, session: str, hashes: Sequence[bytes], prompt_len: int, block_size: int) -> None:
        """A prompt of ``session`` ("" = none: nothing learned) was routed; ``hashes`` are its full blocks'
        chained digests."""
        if not session:
            return
        pl = self.placement
        if pl is None or pl.block_size != block_size:
            pl = self.placement = CheckpointPlacement(block_size)
            self._prev.clear()
            self._hint = None
            self.sessions_started = 0
        prev = self._prev.pop(session, None)
        if prev is None:
            self.sessions_started += 1
        else:
            shared = _shared_blocks(hashes, prev[1], prev[2])
            if shared is not None:
                before = pl.num_observed
                pl.observe(prev[0], shared * block_size)
                if pl.num_observed != before:
                    self._hint = None
        n = len(hashes)
        lo = max(0, n - pl.max_blocks_back - 1)
        self._prev.put(session, (prompt_len, n, b"".join([h[:_PREFIX] for h in hashes[lo:n]])))

    def hint(self) -> tuple[int, ...] | None:
        """Where prompts keep their learned checkpoints, in tokens back from their last full block
        (``CheckpointPlacement.distances``, ranked); None (each worker's own, its prior) until a
        follow-up was learned, or ``()`` (none) once ``one_turn_after`` sessions started without one."""
        pl = self.placement
        if pl is None:
            return None
        if not pl.num_observed:
            return () if self.sessions_started >= self.one_turn_after else None
        if self._hint is None:
            self._hint = tuple(b * pl.block_size for b in pl.distances())
        return self._hint


def _shared_blocks(hashes: Sequence[bytes], n_prev: int, window: bytes) -> int | None:
    """Leading full blocks a prompt shares with its predecessor (``n_prev`` full blocks, the digest
    prefixes of its last ones in ``window``); None when it diverged before the window."""
    w = len(window) // _PREFIX
    lo = n_prev - w  # the window's first entry is block lo + 1 (1-based)
    hi = min(n_prev, len(hashes))

    def same(i: int) -> bool:  # do the i-th (1-based) digests agree? i in (lo, hi]
        k = (i - 1 - lo) * _PREFIX
        return hashes[i - 1][:_PREFIX] == window[k : k + _PREFIX]

    if hi <= lo or not same(lo + 1):
        return 0 if lo == 0 else None
    a, b = lo + 1, hi  # same(a) holds; find the largest i in [a, b] with same(i)
    while a < b:
        mid = (a + b + 1) // 2
        if same(mid):
            a = mid
        else:
            b = mid - 1
    return a
