"""Prompts routed and not stored yet: what a worker will hold once its queued prefills ran.

Engines look their device up when they admit a request (the reference engine's
``_admit``, vLLM's scheduler when it schedules one), so a request queued behind
the prefill that computes the prefix they share resumes that prefix. The index
learns a prefix only when its prefill stored it: for the requests of a burst
on one prompt (a document, a system prompt), every worker looks cold, and each
recomputes the prompt wherever the load sends it.

This table books, per routed request, the points at which its prefill will keep
a KDA checkpoint on its prefill target (``disagg.reuse.placement``), as the
prefix digests that name them, until the request finishes::

    points(r) = { n } U { n - d : d in the router's learned divergences }
                U the ``start_points`` largest 2^j <= n              (blocks, past what r resumed)

    n: r's full blocks. These are where the worker's prefill keeps checkpoints in a
    prompt's unseen part (its last full block, the learned distances back from it,
    and powers of two from the start); the prompt end and branch points are left out,
    the router cannot name them.

A later request sharing an entry's prefix up to point k may resume k tokens on
that entry's worker, after waiting for what is queued there. ``credit`` returns
the furthest such point per worker; the router credits it only where that wait
costs less than computing it elsewhere (``StateAwareRouter._credit_pending``):

    credit on w   iff   q_w - k  <  min_{v in w's pool, v != w} (q_v - r_v)

    q: effective queued prefill tokens, r: resumable tokens from the index

so a burst queues behind its prefix's first computation while that is the
shortest way to its first token, and spreads once the queue there costs more
than the prefix. The router keeps this table only with ``RouterConfig.pending_credit``,
off by default: on the router suite and the held-out shapes it won bursts on a few
shared documents and lost elsewhere (docs/router.md, "Round 23").

NOTES
1. An entry lives from ``add`` until ``remove`` (the request finished, or was
   dropped) or ``ttl_s`` after it was routed, whichever is first: a finished prefill's
   blocks are in the index by then, and a lost ``remove`` cannot credit forever.
2. Points are block counts ``1 <= k <= n``; ``credit`` returns ``k * block_size`` only
   when it is below the asking prompt's length (one token is always computed, as in
   ``disagg.router.index`` NOTE 1).
3. Digests are chained (a block digest names its whole prefix), so a point's digest
   among a request's block digests means the request shares that prefix.
4. A request admitted in the same engine step as the prefill that computes its prefix
   resumes nothing: the checkpoint is not stored until that step ends (the simulator's
   admission, Simulator NOTE 8; KDA states, unlike attention blocks, exist only once
   computed). An engine admits in queue order, and a step takes at most ``step_tokens``
   (vLLM's ``max_num_batched_tokens``), so a request lands in a later step than an entry's
   last chunk once at least that many tokens were routed to the worker after the entry:
   ``credit`` counts an entry only then. The count is the uncached tokens ``add`` saw,
   per worker, since the entry's own (``_routed``); a prefill queue is first in, first out,
   so they are all still queued behind it while it is pending.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from disagg.router.types import RouteRequest


class PendingPrefixes:
    """Checkpoint points of routed, unfinished prefills, by prefix digest (module docstring)."""

    def __init__(self, start_points: int = 3, ttl_s: float = 120.0, step_tokens: int = 8192):
        if start_points < 0 or ttl_s <= 0 or step_tokens < 0:
            raise ValueError("need start_points >= 0, ttl_s > 0 and step_tokens >= 0")
        self.start_points = start_points
        self.ttl_s = ttl_s
        self.step_tokens = step_tokens
        self._points: dict[bytes, dict[str, int]] = {}  # digest -> request id -> tokens
        # request id -> (point digests, worker, mark: NOTE 4, routed at)
        self._entries: dict[str, tuple[tuple[bytes, ...], str, float, float]] = {}
        self._routed: dict[str, float] = {}  # worker -> uncached tokens routed there so far (NOTE 4)
        self._order: deque[tuple[float, str]] = deque()  # (routed at, request id), oldest first (NOTE 1)

    def __len__(self) -> int:
        return len(self._entries)

    def points(self, num_blocks: int, cached_blocks: int, back_blocks: Sequence[int] = ()) -> list[int]:
        """Block counts past ``cached_blocks`` where a prefill of ``num_blocks`` full blocks keeps
        checkpoints (module docstring), furthest first."""
        pts = {num_blocks, *(num_blocks - b for b in back_blocks)}
        powers = [1 << j for j in range(num_blocks.bit_length()) if (1 << j) > cached_blocks]
        pts.update(powers[-self.start_points:] if self.start_points else ())
        return sorted((p for p in pts if cached_blocks < p <= num_blocks), reverse=True)

    def add(self, request: RouteRequest, worker_id: str, cached_tokens: int, now: float,
            back_tokens: Sequence[int] = ()) -> None:
        """Book ``request``'s prefill on ``worker_id``, which resumes ``cached_tokens`` and computes the rest."""
        self._expire(now)
        if request.request_id in self._entries:
            self.remove(request.request_id)
        mark = self._routed[worker_id] = self._routed.get(worker_id, 0.0) + max(request.prompt_len - cached_tokens, 0)
        bs = request.block_size
        hashes = request.block_hashes
        pts = self.points(len(hashes), cached_tokens // bs, [t // bs for t in back_tokens if t > 0])
        if not pts:
            return
        rid = request.request_id
        digests = tuple(hashes[p - 1] for p in pts)
        for d, p in zip(digests, pts, strict=True):
            self._points.setdefault(d, {})[rid] = p * bs
        self._entries[rid] = (digests, worker_id, mark, now)
        self._order.append((now, rid))

    def remove(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        digests = entry[0]
        for d in digests:
            book = self._points.get(d)
            if book is not None:
                book.pop(request_id, None)
                if not book:
                    del self._points[d]

    def _expire(self, now: float) -> None:
        order, entries = self._order, self._entries
        while order:
            at, rid = order[0]
            entry = entries.get(rid)
            if entry is not None and entry[3] == at and now - at <= self.ttl_s:
                return
            order.popleft()  # removed already, booked again later (a re-route), or expired (NOTE 1)
            if entry is not None and entry[3] == at:
                self.remove(rid)

    def credit(self, request: RouteRequest, now: float) -> dict[str, int]:
        """Worker -> the furthest booked point of another request's prefill there that ``request``
        shares (tokens, below its prompt length); empty when none."""
        self._expire(now)
        if not self._points:
            return {}
        hashes = request.block_hashes
        hits = self._points.keys() & hashes  # C-level: most requests share no booked point
        if not hits:
            return {}
        bs, plen = request.block_size, request.prompt_len
        entries, routed, step = self._entries, self._routed, self.step_tokens
        out: dict[str, int] = {}
        for i, h in enumerate(hashes):
            if h in hits:
                tokens = (i + 1) * bs
                if tokens >= plen:
                    break
                for rid in self._points[h]:
                    _, wid, mark, _ = entries[rid]
                    if routed[wid] - mark >= step:  # admitted a step after that prefill ends (NOTE 4)
                        out[wid] = tokens  # blocks in order: the last hit per worker is its furthest
        return out
