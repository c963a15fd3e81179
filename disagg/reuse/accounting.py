"""A worker's reuse accounting: ledger + placement + miss classification, glued.

The worker calls it at four marked points (``disagg.workers.tiered``, "reuse:"):

    begin     a prompt arrives: its view (bound, points), learned divergence,
              checkpoint positions for its prefill; the prompt is noted as seen
              and its checkpoints as pending at once, before the flow's first
              await, so a concurrent prompt that needs one of them sees it in
              flight and can wait for it (``awaited``; ``disagg.flow`` NOTE 8)
    checkpoint_at  the planned positions past where the prefill resumes
    finish    its prefill reused ``realized`` tokens: the missed tokens by
              reason (``disagg.reuse.misses``), counted and returned for the
              request's last chunk (the edge counts them in /metrics)
    published a publish landed (this worker's, or a prefill replica's by its handle)
    dropped   a publish will not land
    settle    a request's publishes are over: what it noted pending and did not
              store is dropped (a waiter stops waiting for it)
    superseded  a session's points landed: those of its points to demote now
              (``disagg.reuse.retention``; the prompt's shared blocks are noted at ``begin``)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from disagg.reuse.ledger import ReuseLedger, ReuseView, _Lru
from disagg.reuse.misses import MissInputs, classify
from disagg.reuse.placement import CheckpointPlacement
from disagg.reuse.retention import PublishedPoint, SessionCheckpoints, points_at
from disagg.session import session_key
from kv_transfer.keys import BlockHasher

HeldFn = Callable[[int], Awaitable[bool]]  # position -> is the state there still resumable (store or device)


@dataclass(slots=True, repr=False)
class ReuseTicket:
    """One request's accounting, from ``begin`` to ``finish``."""

    tokens: list[int]  # the prompt
    hasher: BlockHasher  # its salted key space
    view: ReuseView  # what the ledger knew at the lookup
    pending: tuple[int, ...]  # positions noted pending for this prompt's own publishes
    hashes: list[bytes] = field(default_factory=list)  # the prompt's block digests (hashed once)
    planned: tuple[int, ...] = ()  # extra checkpoints planned for its prefill (placement), before the resume
    speculative: tuple[int, ...] = ()  # those of them the start prior placed (retention demotes them)
    settled: bool = False  # its pending positions were published or dropped (``settle``)
    publishing: bool = False  # a background publish will settle it (the flow's turn end)
    misses: dict[str, int] = field(default_factory=dict)  # filled by ``finish``
    bound: int = 0  # infinite-cache bound counted for this request (filled by ``finish``)
    session: str | None = None  # its session (``session_key``), if any


class ReuseAccounting:
    """See the module docstring. ``placement=None``: no extra checkpoints (the engine's own only);
    ``retention=None``: no session retention (nothing demoted)."""

    def __init__(self, block_size: int, placement: CheckpointPlacement | None = None,
                 ledger: ReuseLedger | None = None, retention: SessionCheckpoints | None = None):
        self.block_size = block_size
        self.ledger = ledger or ReuseLedger(block_size)
        self.placement = placement
        self.retention = retention
        self._last_len = _Lru(1 << 16)  # session -> its previous prompt's length
        self.counters: dict[str, int] = {}  # reason -> missed tokens (this worker)
        self.bound_tokens = 0  # sum of the bounds counted

    def begin(self, tokens: list[int], hasher: BlockHasher, session: str | None, request_id: str,
              cache_salt: str = "", back: Sequence[int] | None = None) -> ReuseTicket:
        """``back``: the router's learned divergences in tokens back from the prompt's last full block
        (placement NOTE 4), in place of this worker's placement's own; None: its own."""
        session = session_key(cache_salt, session) or None  # a tenant's session (disagg.session)
        owner = session or request_id
        unsalted = hasher.with_salt("") if cache_salt else None
        hashes = hasher.block_hashes(tokens)
        view = self.ledger.view(tokens, hasher, owner, unsalted, hashes)
        if session is not None:
            prev = self._last_len.get(session)
            if prev is not None and self.placement is not None:
                self.placement.observe(prev, min(view.bound, prev))
            self._last_len.put(session, len(tokens))
        self.ledger.note_seen(tokens, hasher, owner, unsalted, hashes)
        bs = self.block_size
        if self.retention is not None and view.branch:  # its leading blocks are another session's
            self.retention.note_shared(hashes, view.branch // bs)
        planned: tuple[int, ...] = ()
        speculative: tuple[int, ...] = ()
        if self.placement is not None:
            branch = view.branch if view.branch not in view.published else 0
            likely = max(view.published, default=0)  # where the lookup will most likely resume
            blocks = None if back is None else [t // bs for t in back]
            placed = self.placement.placed(len(tokens), likely, branch, view.bound, blocks)
            planned = tuple(p for p, _ in placed)
            speculative = tuple(p for p, kind in placed if kind == "start")
        own = {len(tokens), len(tokens) // bs * bs} - {0}
        noted = tuple(sorted((own | set(planned)) - set(view.pending)))  # another's in-flight point stays its
        self.ledger.note_points(tokens, hasher, noted, "pending", hashes)
        return ReuseTicket(tokens, hasher, view, noted, hashes, planned, speculative, session=session)

    def checkpoint_at(self, ticket: ReuseTicket, resume: int = 0) -> tuple[int, ...]:
        """Extra checkpoint positions for the ticket's prefill (engine NOTE 7): the planned ones past
        ``resume``; those at or before it will not be published by this request (dropped)."""
        points = tuple(p for p in ticket.planned if p > resume)
        skipped = [p for p in ticket.planned if p <= resume and p in ticket.pending]
        self.ledger.note_points(ticket.tokens, ticket.hasher, skipped, "dropped", ticket.hashes)
        return points

    def awaited(self, ticket: ReuseTicket) -> tuple[int, ...]:
        """Positions past the furthest published resume point of the prompt whose publish (another
        request's) was in flight at its lookup: worth waiting for (``disagg.flow`` NOTE 8)."""
        view = ticket.view
        best = max((p for p in view.published if p <= view.bound), default=0)
        return tuple(p for p in view.pending if p > best)

    def still_pending(self, ticket: ReuseTicket, positions: Sequence[int]) -> bool:
        """Is any of ``positions`` of the ticket's prompt still in flight (not published or dropped)?"""
        return bool(self.ledger.pending_among(ticket.tokens, ticket.hasher, positions, ticket.hashes))

    def settle(self, ticket: ReuseTicket, stored: Sequence[int]) -> None:
        """The ticket's publishes are over: ``stored`` landed, the rest it noted pending will not."""
        self.ledger.note_points(ticket.tokens, ticket.hasher, stored, "published", ticket.hashes)
        rest = [p for p in ticket.pending if p not in set(stored)]
        self.ledger.note_points(ticket.tokens, ticket.hasher, rest, "dropped", ticket.hashes)
        ticket.settled = True

    async def finish(self, ticket: ReuseTicket, realized: int, failure: str = "",
                     held: HeldFn | None = None) -> dict[str, int]:
        view = ticket.view
        published = tuple(p for p, t in view.published.items() if t < view.started)
        furthest = max((p for p in published if realized < p <= view.bound), default=0)
        still = True
        if furthest and held is not None and not failure:
            try:
                still = await held(furthest)
            except Exception:  # noqa: BLE001 - a failing probe only blurs the reason, never the count
                still = True
        raced = self.ledger.published_since(ticket.tokens, ticket.hasher, view, ticket.hashes or None)
        inputs = MissInputs(view.num_prompt, realized, view.bound, view.bound_any_salt, published,
                            view.pending, raced, still, failure)
        ticket.misses = classify(inputs)
        ticket.bound = max(view.bound_any_salt, realized)
        want = furthest or realized  # where it could resume: retention learns how old that was
        if want and ticket.session and self.retention is not None and self.retention.ages is not None:
            point = points_at(ticket.tokens, ticket.hasher, [want], hashes=ticket.hashes or None)[0]
            self.retention.wanted(ticket.session, point.digest)
        for reason, n in ticket.misses.items():
            self.counters[reason] = self.counters.get(reason, 0) + n
        self.bound_tokens += ticket.bound
        return ticket.misses

    def superseded(self, session: str | None, turn: str, tokens: Sequence[int], hasher: BlockHasher,
                   positions: Sequence[int], hashes: Sequence[bytes] | None = None,
                   speculative: Sequence[int] = ()) -> list[PublishedPoint]:
        """``session``'s points at ``positions`` of ``tokens`` (published by request ``turn``)
        landed: its superseded checkpoints and the private ones at ``speculative`` (its ticket's)
        to demote now (``disagg.reuse.retention``); [] without retention."""
        if self.retention is None or not session:
            return []
        return self.retention.published(session, turn, tokens, hasher, positions, hashes, speculative)

    def end_session(self, session: str | None) -> list[PublishedPoint]:
        """``session`` ended (``disagg.flow`` NOTE 13): the private points its retention still
        tracks, now forgotten, to demote ([] without retention)."""
        if self.retention is None or not session:
            return []
        return self.retention.end(session)

    def private_blocks(self, session: str) -> list[bytes]:
        """The block digests only ``session`` (a ``session_key``) sent, in its context's order, less
        those its retention knows shared (ledger NOTE 4)."""
        shared = self.retention.shared if self.retention is not None else ()
        return [h for h in self.ledger.private_blocks(session) if h not in shared]

    def shared_blocks(self, ticket: ReuseTicket) -> int:
        """The ticket's prompt's leading full blocks known to be another session's too: up to its
        branch point, or further while the retention has seen the blocks shared."""
        n = ticket.view.branch // self.block_size
        if self.retention is not None:
            shared, hashes = self.retention.shared, ticket.hashes
            while n < len(hashes) and hashes[n] in shared:
                n += 1
        return n

    def published(self, tokens: Sequence[int], hasher: BlockHasher, positions: Sequence[int]) -> None:
        self.ledger.note_points(tokens, hasher, positions, "published")

    def dropped(self, tokens: Sequence[int], hasher: BlockHasher, positions: Sequence[int]) -> None:
        self.ledger.note_points(tokens, hasher, positions, "dropped")

    def stats(self) -> dict:
        out = {"miss_tokens": dict(self.counters), "bound_tokens": self.bound_tokens}
        if self.retention is not None:
            out["demoted_checkpoints"] = self.retention.num_demoted
        return out
