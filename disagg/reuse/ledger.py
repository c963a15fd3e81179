"""The reuse ledger: what a worker has seen and published, as bounded digest sets.

The serving side cannot know the infinite-cache bound of a prompt by itself,
so a worker that sees every prompt (the decode side, which orchestrates)
keeps a compact record, per tenant salt (the digests carry it):

    blocks   chained full-block digest -> the session that first sent it
    tails    parent digest -> lengths of partial blocks that ended a sequence
    points   prefix digest D(p) -> when a checkpoint at p was published
    pending  prefix digest D(p) -> when a publish of p began (not yet landed)

``view`` turns a prompt into a ``ReuseView`` (plain data): its bound (the
longest prefix seen, at most ``L - 1``), the published / pending points at or
below it, and the block boundary where it stops sharing another session's
blocks (a branch point, ``disagg.reuse.placement``). ``note_*`` record what
the worker sends and publishes.

NOTES
1. Bounded: every map is an LRU of at most ``max_entries`` digests; a prefix
   forgotten is "never seen" (no miss counted), never a wrong reason for a
   token the worker did not reuse.
2. Pending publishes older than ``pending_ttl_s`` count as dropped (a publish
   that failed without telling), so a lost publish cannot hold a reason of
   ``in_flight`` forever.
3. The bound covers what *this* ledger saw: with several decode replicas, each
   sees only the prompts routed to it (docs/perf/reuse-cpu.md).
4. ``private_blocks(session)``: the blocks a session sent first and no other session
   sent since (another's send marks a block ``shared`` for good), in the order last
   sent: a session re-sends its context every turn, so that is its context's order.
   What a session ends with when its client says so after the fact
   (``disagg.flow`` NOTE 14); one pass over the ledger, for an explicit call only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kv_transfer.keys import BlockHasher


@dataclass(slots=True)
class ReuseView:
    """What the ledger knew of one prompt when its lookup began."""

    num_prompt: int  # prompt tokens
    bound: int  # longest prefix seen before (this salt), at most num_prompt - 1
    bound_any_salt: int  # the same, full blocks of any salt
    published: dict[int, float]  # checkpoint position <= bound -> when it was published (monotonic)
    pending: tuple[int, ...]  # positions <= bound whose publish was in flight
    branch: int  # block boundary where the prompt stops sharing another session's blocks (0: none)
    started: float  # monotonic time of the lookup


class _Lru(OrderedDict):
    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


class ReuseLedger:
    """Seen and published state of one worker's prompts (module docstring)."""

    def __init__(self, block_size: int, max_entries: int = 1 << 18, pending_ttl_s: float = 60.0):
        self.block_size = block_size
        self.pending_ttl_s = pending_ttl_s
        self._blocks = _Lru(max_entries)  # digest -> owner session
        self._shared = _Lru(max_entries)  # digests another session than the owner sent too (NOTE 4)
        self._any = _Lru(max_entries)  # unsalted digest -> None
        self._tails = _Lru(max_entries)  # parent digest -> set of tail lengths
        self._points = _Lru(max_entries)  # prefix digest -> publish time
        self._pending: dict[bytes, float] = {}  # prefix digest -> publish start

    # -- queries ----------------------------------------------------------
    def view(self, tokens: Sequence[int], hasher: BlockHasher, session: str, unsalted: BlockHasher | None = None,
             hashes: list[bytes] | None = None) -> ReuseView:
        """The bound and resume points of ``tokens`` (before they are noted as seen)."""
        now = time.monotonic()
        bs, n_tok = self.block_size, len(tokens)
        hashes = hasher.block_hashes(tokens) if hashes is None else hashes
        n = 0
        while n < len(hashes) and hashes[n] in self._blocks:
            n += 1
        branch = n * bs if n and n * bs < n_tok and self._blocks[hashes[n - 1]] != session else 0
        bound = n * bs
        parent = hashes[n - 1] if n else hasher.root
        for t in sorted(self._tails.get(parent, ()), reverse=True):
            if bound + t <= n_tok and hasher.tail_digest(parent, tokens[bound : bound + t]) in self._tails_seen(parent, t):
                bound += t
                break
        bound = min(bound, n_tok - 1)
        any_bound = bound
        if unsalted is not None:
            m = 0
            for h in unsalted.block_hashes(tokens):
                if h not in self._any:
                    break
                m += 1
            any_bound = max(bound, min(m * bs, n_tok - 1))
        published, pending = self._points_upto(tokens, hasher, hashes, bound, now)
        return ReuseView(n_tok, bound, any_bound, published, pending, branch, now)

    def published_since(self, tokens: Sequence[int], hasher: BlockHasher, view: ReuseView,
                        hashes: list[bytes] | None = None) -> tuple[int, ...]:
        """Points <= the view's bound published after its lookup began (raced it)."""
        published, _ = self._points_upto(tokens, hasher, hashes, view.bound, time.monotonic())
        return tuple(p for p, t in published.items() if t >= view.started)

    def pending_among(self, tokens: Sequence[int], hasher: BlockHasher, positions: Sequence[int],
                      hashes: list[bytes] | None = None) -> tuple[int, ...]:
        """Those of ``positions`` (checkpoints of ``tokens``) whose publish is in flight now."""
        bs, now = self.block_size, time.monotonic()
        positions = [p for p in positions if 0 < p <= len(tokens)]
        if not positions:
            return ()
        if hashes is None:
            hashes = hasher.block_hashes(tokens[: max(positions) // bs * bs])
        out = []
        for p in positions:
            n = p // bs
            parent = hashes[n - 1] if n else hasher.root
            digest = parent if p % bs == 0 else hasher.tail_digest(parent, tokens[n * bs : p])
            started = self._pending.get(digest)
            if started is not None and now - started <= self.pending_ttl_s:  # NOTE 2
                out.append(p)
        return tuple(out)

    def _tails_seen(self, parent: bytes, length: int) -> set[bytes]:
        return self._tails.get((parent, length), set())

    def _points_upto(self, tokens, hasher: BlockHasher, hashes: list[bytes] | None, bound: int,
                     now: float) -> tuple[dict[int, float], tuple[int, ...]]:
        bs = self.block_size
        if hashes is None:
            hashes = hasher.block_hashes(tokens[: bound // bs * bs])
        published: dict[int, float] = {}
        pending: list[int] = []

        def check(p: int, digest: bytes) -> None:
            t = self._points.get(digest)
            if t is not None:
                published[p] = t
            started = self._pending.get(digest)
            if started is not None:
                if now - started <= self.pending_ttl_s:
                    pending.append(p)
                else:  # NOTE 2
                    del self._pending[digest]

        for k in range(bound // bs + 1):
            parent = hashes[k - 1] if k else hasher.root
            if k:
                check(k * bs, parent)
            for t in self._tails.get(parent, ()):
                if k * bs + t <= bound:
                    check(k * bs + t, hasher.tail_digest(parent, tokens[k * bs : k * bs + t]))
        return published, tuple(sorted(pending))

    # -- records ---------------------------------------------------------
    def note_seen(self, tokens: Sequence[int], hasher: BlockHasher, session: str,
                  unsalted: BlockHasher | None = None, hashes: list[bytes] | None = None) -> None:
        """``tokens`` were sent (their state is computed, or will be)."""
        hashes = hasher.block_hashes(tokens) if hashes is None else hashes
        for h in hashes:
            owner = self._blocks.get(h, session)
            if owner != session:
                self._shared.put(h, None)
            self._blocks.put(h, owner)
        if unsalted is not None:
            for h in unsalted.block_hashes(tokens):
                self._any.put(h, None)
        else:
            for h in hashes:
                self._any.put(h, None)
        self._note_tail(tokens, hasher, hashes, len(tokens))

    def private_blocks(self, session: str) -> list[bytes]:
        """The full-block digests ``session`` sent first and no other session sent, in the order
        last sent (NOTE 4)."""
        shared = self._shared
        return [h for h, owner in self._blocks.items() if owner == session and h not in shared]

    def _note_tail(self, tokens, hasher: BlockHasher, hashes: list[bytes], p: int) -> bytes:
        bs = self.block_size
        n = p // bs
        parent = hashes[n - 1] if n else hasher.root
        if p % bs == 0:
            return parent
        digest = hasher.tail_digest(parent, tokens[n * bs : p])
        lengths = self._tails.get(parent) or set()
        lengths.add(p % bs)
        self._tails.put(parent, lengths)
        seen = self._tails.get((parent, p % bs)) or set()
        seen.add(digest)
        self._tails.put((parent, p % bs), seen)
        return digest

    def note_points(self, tokens: Sequence[int], hasher: BlockHasher, positions: Sequence[int], state: str,
                    hashes: list[bytes] | None = None) -> None:
        """Checkpoints of ``tokens`` at ``positions``: "pending" (a publish began), "published"
        (it landed) or "dropped" (it will not land). ``hashes``: the tokens' block digests, when known."""
        assert state in ("pending", "published", "dropped"), f"bad state {state!r}"
        positions = [p for p in positions if 0 < p <= len(tokens)]
        if not positions:
            return
        now = time.monotonic()
        if hashes is None:
            hashes = hasher.block_hashes(tokens[: max(positions) // self.block_size * self.block_size])
        for p in positions:
            digest = self._note_tail(tokens, hasher, hashes, p)
            if state == "pending":
                self._pending[digest] = now
                continue
            self._pending.pop(digest, None)
            if state == "published":  # a re-publish keeps the first time (a race is judged by it)
                self._points.put(digest, self._points.get(digest, now))
