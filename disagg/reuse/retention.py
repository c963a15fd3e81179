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

A session's turns also age as a whole (``keep_turns``): the private points of
its turns older than its newest N go first, whatever ``keep_checkpoints``
says. A tool loop or a chat that sends its history back verbatim resumes from
its latest turn only, and each turn publishes a few points (its turn end, its
prompt's end and last full block, the learned ones), so ``keep_checkpoints``
alone keeps the last two or three turns' points, each weighing as much as
thousands of tokens of history, for prompts that will never ask for them. A
conversation that branches, is edited or rewinds does resume from older
turns. ``"auto"`` learns N from the workload (``ResumeAges``, NOTE 6); the
default, 0, sets no limit (docs/router.md, "Round 38": it lifts the held-out
agentic shapes; "Round 39": learned, it no longer costs Mooncake's synthetic
trace, and it stays off until every family has run with it).

Config example::

    transfer:
      host:
        keep_checkpoints: 8   # 0: off (recency alone)
        keep_turns: 0         # no limit (the default); N >= 1 newest turns; auto: learned

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
6. Learned turns (``keep_turns: auto``): every finished request of a session
   names the point it could resume from, its realized resume or the furthest
   published point past it (``ReuseAccounting.finish``), and ``wanted`` ages
   it by the session's turns published since the point's (``_owner``: digest
   -> session and turn, kept after a demote, so a prompt that wanted a demoted
   point still counts; ``_turns``: the session's newest turns). ``ResumeAges``
   turns the ages into N, 0 (no limit) until it has seen enough prompts of
   sessions with more than N turns (the ones that can reach N back). A
   point a session wants after N was set too low is a recompute, never a wrong
   token, and the ages it adds raise N. Per replica: each decode replica learns
   from the sessions it serves. In the simulator (docs/router.md, "Round 38")
   the held-out sets' prompts all extend their session's last (a one-turn
   limit), the router suite's reach back 1.5-8% of the time, Mooncake's
   synthetic trace's 72%; before it has seen what deep sessions do, the
   learner can set a limit too low for them (the synthetic trace's cost).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

from disagg.config import KEEP_CHECKPOINTS, KEEP_TURNS, check_keep_turns
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


class ResumeAges:
    """How many turns back a session's resumes reach, learned (NOTE 6): ``turns()`` is how many
    of its newest turns keep their private points, 0 for no limit.

    Each prompt of a session that could resume from one of the session's own points (the furthest
    its lookup saw published) has an age: 0 for a point its latest turn published, 1 for the turn
    before, and so on, out of the ``turns`` the session had published. A linear session (an
    agent's tool loop, a chat that sends its history back verbatim) resumes from its latest turn
    only, and every older point is room another session's state could use; a conversation that
    branches, is edited or rewinds resumes from older turns too. A young session cannot reach far
    back, so the share of prompts reaching ``a`` turns back is taken among those of sessions that
    had more than ``a`` turns (a survival estimate). ``turns()`` is the fewest newest turns such
    that, at every age past them, at most ``tail`` of those prompts reach back that far (however
    few: a demoted point a session then wants costs a recompute of its context); 0 (no limit)
    when more than ``tail`` reach ``cap`` turns back, or while fewer than ``min_resumes`` prompts
    of sessions that had more than N turns were seen: only those can show whether prompts reach N
    turns back, and early in a workload, while every session is young, none has (a warm-up
    counted in all prompts let a trace whose sessions go far back set limits its older sessions
    then broke; docs/router.md, "Round 39"). Counts decay exponentially (``half_life`` prompts),
    so the limit follows a workload that changes.
    """

    def __init__(self, tail: float = 0.005, min_resumes: int = 64, half_life: float = 1024.0, cap: int = 16):
        if not 0.0 < tail < 1.0 or min_resumes < 1 or half_life <= 0 or cap < 1:
            raise ValueError("need 0 < tail < 1, min_resumes >= 1, half_life > 0 and cap >= 1")
        self.tail, self.min_resumes, self.cap = tail, min_resumes, cap
        self._decay = 0.5 ** (1.0 / half_life)
        self._age = [0.0] * (cap + 1)  # decayed prompts per age; the last bucket: cap or older
        self._had = [0.0] * (cap + 2)  # ... per turns the session had (the last bucket: cap + 1 or more)
        self.observed = 0

    def observe(self, age: int, turns: int) -> None:
        """A prompt of a session with ``turns`` published turns could resume ``age`` turns back."""
        d = self._decay
        for w in (self._age, self._had):
            for i in range(len(w)):
                w[i] *= d
        self._age[min(max(age, 0), self.cap)] += 1.0
        self._had[min(max(turns, age + 1, 1), self.cap + 1)] += 1.0
        self.observed += 1

    def turns(self) -> int:
        older = had = 0.0  # prompts reaching back a or more turns; those of sessions with more than a
        for a in range(self.cap, 0, -1):
            older += self._age[a]
            had += self._had[a + 1]
            if older > self.tail * had:
                return 0 if a == self.cap else self._seen_deep(a + 1)
        return self._seen_deep(1)

    def _seen_deep(self, n: int) -> int:
        """``n``, once ``min_resumes`` prompts of sessions with more than ``n`` turns were seen (their
        decayed count, rounded); else 0."""
        return n if round(sum(self._had[n + 1:])) >= self.min_resumes else 0


def resume_ages(keep_turns: int | str) -> ResumeAges | None:
    """``transfer.host.keep_turns``: "auto", the learner of N (``ResumeAges``); 0 (no limit) or
    N >= 1 newest turns: None. ValueError for anything else."""
    check_keep_turns(keep_turns)
    return ResumeAges() if keep_turns == "auto" else None


@dataclass(frozen=True, slots=True)
class RetentionResult:
    demote: tuple[PublishedPoint, ...]  # superseded private points, oldest first
    track: tuple[PublishedPoint, ...]  # the private points kept (newest last)


def superseded(points: Sequence[PublishedPoint], keep: int, shared: Container[bytes],
               turns: int = 0) -> RetentionResult:
    """Split a session's points (publish order, oldest first) into the superseded private ones
    (all but the newest ``keep`` and the latest turn's, NOTE 4, and with ``turns`` those of every
    turn older than the newest ``turns``, NOTE 6) and the ones kept; shared points are in neither
    (NOTE 3). ``keep <= 0``: retention is off, nothing is demoted."""
    private = [pt for pt in points if pt.anchor not in shared]
    if keep <= 0 or not private:
        return RetentionResult((), tuple(private))
    latest = private[-1].turn
    cut = max(0, len(private) - keep)
    recent: set[str] | None = None
    if turns > 0:
        order = list(dict.fromkeys(pt.turn for pt in reversed(private)))  # newest turn first
        recent = set(order[:turns]) if len(order) > turns else None
    demote = tuple(pt for i, pt in enumerate(private)
                   if pt.turn != latest and (i < cut or (recent is not None and pt.turn not in recent)))
    return RetentionResult(demote, tuple(pt for pt in private if pt not in demote))


class SessionCheckpoints:
    """Per session, the points published and not demoted; the shared block digests (module docstring)."""

    def __init__(self, block_size: int, keep: int = KEEP_CHECKPOINTS, max_sessions: int = 1 << 16,
                 max_shared: int = 1 << 18, keep_turns: int | str = KEEP_TURNS):
        if keep < 0:
            raise ValueError("keep_checkpoints must be >= 0 (0: off)")
        self.block_size = block_size
        self.keep = keep
        self.ages = resume_ages(keep_turns)  # NOTE 6: learned, or None
        self.keep_turns = 0 if self.ages is not None else int(keep_turns)
        self._sessions = _Lru(max_sessions)  # session -> tuple[PublishedPoint, ...] (NOTE 4)
        self._turns = _Lru(max_sessions)  # session -> its newest turns, oldest first (NOTE 6)
        self._owner = _Lru(max_shared)  # digest of a private point published -> (session, turn) (NOTE 6)
        self.shared = _Lru(max_shared)  # block digest -> None (NOTE 2)
        self.num_demoted = 0  # points returned for demotion

    def turns(self) -> int:
        """NOTE 6: how many of a session's newest turns keep their private points (0: no limit)."""
        return self.ages.turns() if self.ages is not None else self.keep_turns

    def wanted(self, session: str, digest: bytes) -> None:
        """A prompt of ``session`` could resume at the point named ``digest`` (the furthest its
        lookup saw published): learn how many turns back it was (NOTE 6)."""
        if self.ages is None or not session:
            return
        owner = self._owner.get(digest)
        if owner is None or owner[0] != session:
            return  # another session's, shared, or forgotten
        order = self._turns.get(session) or []
        turn = owner[1]
        self.ages.observe(len(order) - 1 - order.index(turn) if turn in order else self.ages.cap, len(order))

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
        if self.ages is not None:
            order = [t for t in self._turns.get(session) or () if t != turn] + [turn]
            self._turns.put(session, order[-(self.ages.cap + 1):])
            for pt in new:
                if pt.anchor not in self.shared:
                    self._owner.put(pt.digest, (session, turn))
        result = superseded(before + new, self.keep, self.shared, self.turns())
        self._sessions.put(session, result.track)
        self.num_demoted += len(result.demote)
        return list(result.demote) + early

    def forget(self, session: str) -> None:
        self._sessions.pop(session, None)
        self._turns.pop(session, None)

    def end(self, session: str) -> list[PublishedPoint]:
        """``session`` will not come back (its client said so): every private point still tracked,
        oldest first, and the session is forgotten."""
        points = list(self._sessions.pop(session, None) or ())
        self._turns.pop(session, None)
        self.num_demoted += len(points)
        return points
