"""Session retention in the serving tiers: a session's superseded KDA checkpoints go first.

A session resumes from its *newest* checkpoints (its next prompt repeats the
previous one up to a point near its end), so of the dozens of checkpoints its
turns published only the last few can still serve it, yet each weighs as much
as thousands of tokens of MLA history. Eviction by recency alone keeps them
until they age out, while the state of a session in its think time goes.
``superseded`` is the policy (pure); ``SessionCheckpoints`` keeps what it needs
(per session, the points published and not demoted yet) and the flow calls it
when a turn's checkpoints land (``disagg.flow`` NOTE 9), then demotes what it
returns in the node's tiers (``StateStore.demote``: evicted first, still
readable; a demoted point read again is refreshed)::

    session s publishes   p1 p2 p3 | p4 p5 | p6 p7 p8 | p9 p10 p11   (turns in publish order;
                                                                     positions ascending
    keep = 4                                       |<-- newest 4 -->| in one publish)
    demote                p1 p2 p3   p4 p5   p6 p7
    (each point once, oldest first; the latest turn's points are kept past keep)

A turn never supersedes its own points: a prompt's first turn keeps checkpoints
on its way (every 2^k blocks, the branch point: ``disagg.reuse.placement``) for
sessions that may share its prefix later, and its next turn is the earliest
that can tell. (With ``speculative_first`` the 2^k ones go first, below.)

With ``speculative_first`` (``transfer.host``, off by default) a prompt's
*speculative* points, the placement's start prior (checkpoints at 2^k blocks in
a part of the prompt nobody sent before, for a later prompt that may turn out
to share it), are demoted as they land, the private ones: kept while the tiers
have room, they go before what a session is known to resume. On Mooncake's
conversation trace they were 42% of the checkpoints kept and carried 2.5% of
the resumed tokens; on the router suite's traces they carry more, and
demoting them costs TTFT there (docs/router.md, "Round 37").

A point is *shared* when the last full block at or before it is a block that
another session's prompt also started with (the system prompt, a forked
conversation's parent, the branch point where a session left them); shared
points are never demoted: another session resumes from them.

Config example::

    transfer:
      host:
        keep_checkpoints: 8   # 0: off (recency alone)

NOTES
1. Only the session's own points are ever demoted, only ones it published, and
   each at most once: demoting only reorders eviction, so a wrong guess costs a
   recompute of that point, never a wrong token.
2. ``shared`` only grows (bounded LRU); a point is tested when its turn's
   demotes are decided, so a point demoted before another session shared its
   prefix stays demoted (the other session's read of it refreshes it).
3. A point whose block is shared stays tracked by no one: it never counts
   among the session's newest ``keep`` (as in ``disagg.tools.sim.retention``).
4. Points of the session's latest turn (the turn of its newest point) are never
   demoted, even past ``keep``.
5. Bounded: at most ``max_sessions`` sessions (LRU) and, per session, ``keep``
   private points plus its latest turn's.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

from disagg.config import KEEP_CHECKPOINTS
from disagg.reuse.ledger import _Lru
from kv_transfer.keys import BlockHasher

__all__ = ["KEEP_CHECKPOINTS", "PublishedPoint", "RetentionResult", "SessionCheckpoints", "superseded"]


@dataclass(frozen=True, slots=True)
class PublishedPoint:
    """A resume point a session published."""

    position: int  # tokens before the point
    digest: bytes  # prefix digest D(p): names its objects (``StateStore.checkpoint_keys``)
    anchor: bytes  # digest of the last full block at or before p (the hasher's root below one block)
    turn: str = ""  # the request that published it (a prefill and its turn end share one)


def points_at(tokens: Sequence[int], hasher: BlockHasher, positions: Sequence[int], turn: str = "",
              hashes: Sequence[bytes] | None = None) -> list[PublishedPoint]:
    """The resume points of ``tokens`` at ``positions`` (ascending, each in ``(0, len(tokens)]``),
    named as a store names them; ``hashes``: the tokens' block digests when known."""
    bs = hasher.block_size
    if not positions:
        return []
    if hashes is None or len(hashes) < positions[-1] // bs:
        hashes = hasher.block_hashes(tokens[: positions[-1] // bs * bs])
    out = []
    for p in positions:
        n = p // bs
        anchor = hashes[n - 1] if n else hasher.root
        digest = hasher.tail_digest(anchor, tokens[n * bs : p]) if p % bs else anchor
        out.append(PublishedPoint(p, digest, anchor, turn))
    return out


@dataclass(frozen=True, slots=True)
class RetentionResult:
    demote: tuple[PublishedPoint, ...]  # superseded private points, oldest first
    track: tuple[PublishedPoint, ...]  # the private points kept (newest last)


def superseded(points: Sequence[PublishedPoint], keep: int, shared: Container[bytes]) -> RetentionResult:
    """Split a session's points (publish order, oldest first) into the superseded private ones
    (all but the newest ``keep`` and the latest turn's, NOTE 4) and the ones kept; shared points
    are in neither (NOTE 3). ``keep <= 0``: retention is off, nothing is demoted."""
    private = [pt for pt in points if pt.anchor not in shared]
    if keep <= 0 or not private:
        return RetentionResult((), tuple(private))
    latest = private[-1].turn
    cut = max(0, len(private) - keep)
    demote = tuple(pt for pt in private[:cut] if pt.turn != latest)
    return RetentionResult(demote, tuple(pt for pt in private if pt not in demote))


class SessionCheckpoints:
    """Per session, the points published and not demoted; the shared block digests (module docstring)."""

    def __init__(self, block_size: int, keep: int = KEEP_CHECKPOINTS, max_sessions: int = 1 << 16,
                 max_shared: int = 1 << 18):
        if keep < 0:
            raise ValueError("keep_checkpoints must be >= 0 (0: off)")
        self.block_size = block_size
        self.keep = keep
        self._sessions = _Lru(max_sessions)  # session -> tuple[PublishedPoint, ...] (NOTE 4)
        self.shared = _Lru(max_shared)  # block digest -> None (NOTE 2)
        self.num_demoted = 0  # points returned for demotion

    @property
    def enabled(self) -> bool:
        return self.keep > 0

    def note_shared(self, hashes: Sequence[bytes], num_blocks: int) -> None:
        """A prompt started with ``num_blocks`` blocks another session sent first (its ledger
        view's branch point): those blocks, and the points at or past them, are shared."""
        if not self.enabled:
            return
        for h in hashes[:num_blocks]:
            self.shared.put(h, None)

    def published(self, session: str, turn: str, tokens: Sequence[int], hasher: BlockHasher,
                  positions: Sequence[int], hashes: Sequence[bytes] | None = None,
                  speculative: Sequence[int] = ()) -> list[PublishedPoint]:
        """``session``'s points at ``positions`` of ``tokens``, published by request ``turn``,
        landed: its points superseded now (oldest first), each returned once (NOTE 1), then the
        private ones among them at ``speculative`` (the start prior's, module docstring: never
        tracked, so returned with each publish of them)."""
        positions = sorted({p for p in positions if 0 < p <= len(tokens)})
        if not self.enabled or not session or not positions:
            return []
        guess = set(speculative)
        early = [pt for pt in points_at(tokens, hasher, [p for p in positions if p in guess], turn, hashes)
                 if pt.anchor not in self.shared]  # never tracked: demoted as they land
        self.num_demoted += len(early)
        positions = [p for p in positions if p not in guess]
        if not positions:
            return early
        new = points_at(tokens, hasher, positions, turn, hashes)
        digests = {pt.digest for pt in new}
        before = [pt for pt in self._sessions.get(session, ()) if pt.digest not in digests]  # a re-publish is newest
        result = superseded(before + new, self.keep, self.shared)
        self._sessions.put(session, result.track)
        self.num_demoted += len(result.demote)
        return list(result.demote) + early

    def forget(self, session: str) -> None:
        self._sessions.pop(session, None)

    def end(self, session: str) -> list[PublishedPoint]:
        """``session`` will not come back (its client said so): every private point still tracked,
        oldest first, and the session is forgotten."""
        points = list(self._sessions.pop(session, None) or ())
        self.num_demoted += len(points)
        return points
