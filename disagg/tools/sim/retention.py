"""Capacity-aware retention: what the simulated tiers evict first.

LRU alone evicts by age, so when the tiers are full a session in its think
time (it will resume within seconds) loses its state to objects nobody will
read again. A session resumes from its *newest* checkpoints (its next prompt
repeats the previous one up to a point near its end), so of the dozens of
periodic KDA checkpoints its context has collected only the last few can
still serve it, yet each weighs as much as many MLA blocks.
``SessionRetention`` reorders the tiers' eviction queues when the cluster
learns what will not be read again::

    a turn is stored     the session's private checkpoints except its newest
                         ``keep_checkpoints`` -> evicted first (policy "checkpoints":
                         never the turn's own, as serving's), and those of turns
                         older than its newest ``keep_turns`` (NOTE 4)
    session ends         its private objects (MLA blocks and checkpoints)
                         -> evicted first, the end of its context first
                         (policy "checkpoints": only when its client said
                         so, ``client_ends``: the API's ``session_end``)
    shared prefix found  a session's first prompt finds blocks another
                         session left: they (and their checkpoints) are
                         shared from now on and refreshed once
    session moved        a turn's state is stored on other workers' devices
                         than the last turn's: the session's private objects
                         on the devices it left -> evicted first (stale
                         duplicates: its next turn resumes where it went)
    state borrowed       a prefill read the session's state from its decode
                         worker's node (a peer read): the private checkpoints
                         it stored in the prefill worker's device and node
                         tiers -> evicted first (its home is the decode node)
    handed off           a turn's state went to a decode worker on another node: the
                         session's private objects in the prefill node's shared tiers
                         (host, disk) -> evicted first (one copy: the decode node's)
    speculative points   (``speculative_first``) the start prior's checkpoints a prefill on
                         the session's decode-side worker kept (points at 2^k blocks in a
                         prompt's unseen part, for a later prompt that may share it:
                         ``disagg.reuse.placement``), private ones -> evicted first in its
                         node's tiers (host, disk), kept on the device (a pool prefill's
                         hand-off keeps them: the session's state)

Objects are demoted, never dropped: a demoted object that is read again
(a rewrite resuming from an older checkpoint) is refreshed like any other.
Shared objects (system prompts, a parent's prefix) are never demoted.

Policy "lru" does nothing (plain LRU tiers); "session" does the above;
"checkpoints" does what serving does (``transfer.host.keep_checkpoints``,
``disagg.reuse.retention``; ``disagg.workers.tiered`` NOTE 3, ``disagg.flow``
NOTE 12), without what only the trace knows: a turn's superseded checkpoints,
its speculative points in the node tiers (with ``speculative_first``, as serving's option),
a borrowed turn's checkpoints and a handed-off session's private objects in
the prefill node's tiers go first; the devices a session left demote nothing,
and a session's end only when its client says so (``client_ends``: clients
that send ``session_end`` with a session's last turn, ``disagg.flow`` NOTE 13;
serving is not told otherwise).

NOTES
1. ``shared`` only grows; an object whose digest is in it is never demoted.
2. ``_sessions[skey]`` holds the live session's latest full-block digests
   and its private checkpoint keys in the order stored, of which the first
   ``_demoted[skey]`` have been demoted; both go when the session ends.
3. ``_devices[skey]`` holds the device tiers the session's latest turn was
   stored on (the prefill worker's, and the decode worker's when they differ).
4. ``keep_turns`` (serving's ``transfer.host.keep_turns``): 0, no limit; N, the
   private points of turns older than the session's newest N go first; "auto",
   N is learned from how many turns back the sessions' prompts reach
   (``disagg.reuse.retention.ResumeAges``): at each prompt, the furthest of the
   session's own stored checkpoints in it, and the turn that stored it
   (``_turns[skey]``: key -> the store's ordinal, ``_starts[skey]``: where each
   store's points begin in ``mine``).
"""

from __future__ import annotations

from collections.abc import Iterable

from disagg.config import KEEP_CHECKPOINTS, KEEP_TURNS
from disagg.reuse.retention import resume_ages
from disagg.tools.sim.cache import LRUTier

RETENTION_POLICIES = ("lru", "checkpoints", "session")
_K = b"K"


class SessionRetention:
    def __init__(self, policy: str = "session", keep_checkpoints: int = KEEP_CHECKPOINTS,
                 client_ends: bool = False, keep_turns: int | str = KEEP_TURNS):
        if policy not in RETENTION_POLICIES:
            raise ValueError(f"retention must be one of {RETENTION_POLICIES}, got {policy!r}")
        if keep_checkpoints < 1:
            raise ValueError("keep_checkpoints must be >= 1")
        self.ages = resume_ages(keep_turns)  # NOTE 4: learned, or None
        self.keep_turns = 0 if keep_turns == "auto" else int(keep_turns)
        if client_ends and policy == "lru":
            raise ValueError("client_ends needs a retention that tracks sessions (checkpoints or session)")
        self.enabled = policy != "lru"  # sessions tracked, checkpoints demoted
        self.full = policy == "session"  # also session ends and moves
        self.client_ends = client_ends  # clients say which turn is a session's last (session_end)
        self.keep_checkpoints = keep_checkpoints
        self.shared: set[bytes] = set()  # NOTE 1
        self._sessions: dict[tuple[str, int], tuple[list[bytes], list[bytes]]] = {}  # NOTE 2
        self._demoted: dict[tuple[str, int], int] = {}
        self._devices: dict[tuple[str, int], list[LRUTier]] = {}  # NOTE 3
        self._turns: dict[tuple[str, int], dict[bytes, int]] = {}  # NOTE 4
        self._starts: dict[tuple[str, int], list[int]] = {}
        self.num_demoted = 0  # keys passed to demote (resident or not)

    def on_prompt(self, skey: tuple[str, int], digests: list[bytes], num_full: int, lead: int,
                  tiers: Iterable[LRUTier | None]) -> None:
        """A prompt arrived; its ``lead`` leading digests had been seen before in the run."""
        if not self.enabled:
            return
        state = self._sessions.get(skey)
        if self.ages is not None and state is not None:
            self._observe_age(skey, digests[:num_full])
        if state is None:  # the session's first prompt: what it found is someone else's
            new = [d for d in digests[:lead] if d not in self.shared]
            if new:
                self.shared.update(new)
                refresh = [k for d in new for k in (d, _K + d)]
                for tier in tiers:
                    if tier is not None:
                        tier.touch_present(refresh)
            self._sessions[skey] = (digests[:num_full], [])
            self._demoted[skey] = 0
        else:
            self._sessions[skey] = (digests[:num_full], state[1])

    def on_store(self, skey: tuple[str, int], ckpts: list[bytes], tiers: Iterable[LRUTier | None]) -> None:
        """A turn's prefill stored ``ckpts``: all but the session's newest few go first."""
        state = self._sessions.get(skey)
        if not self.enabled or state is None:
            return
        mine = state[1]
        shared = self.shared
        before = len(mine)
        mine.extend(k for k in ckpts if k[1:] not in shared)
        done = self._demoted[skey]
        upto = len(mine) - self.keep_checkpoints
        if not self.full:  # serving's: a turn never supersedes its own points (disagg.reuse.retention NOTE 4)
            upto = min(upto, before)
        if self.ages is not None or self.keep_turns:  # NOTE 4: a turn limit, fixed or learned
            starts = self._starts.setdefault(skey, [])
            starts.append(before)
            if self.ages is not None:
                self._turns.setdefault(skey, {}).update(dict.fromkeys(mine[before:], len(starts)))
            turns = self.turns()
            if turns and len(starts) > turns:  # turns older than the newest ``turns``
                upto = max(upto, starts[-turns])
        if upto > done:
            self._demote(mine[done:upto], tiers)
            self._demoted[skey] = upto

    def turns(self) -> int:
        """NOTE 4: the newest turns whose private points are kept (0: no limit)."""
        return self.ages.turns() if self.ages is not None else self.keep_turns

    def _observe_age(self, skey: tuple[str, int], chain: list[bytes]) -> None:
        """NOTE 4: how many turns back the furthest of the session's stored points in ``chain`` was."""
        stored = self._turns.get(skey)
        if not stored:
            return
        for d in reversed(chain):
            turn = stored.get(_K + d)
            if turn is not None:
                self.ages.observe(len(self._starts[skey]) - turn, len(self._starts[skey]))
                return

    def on_placed(self, skey: tuple[str, int], devices: list[LRUTier]) -> None:
        """A turn's state was stored on ``devices``: the session's copies on the devices it left go first."""
        state = self._sessions.get(skey)
        if not self.full or state is None:
            return
        left = [t for t in self._devices.get(skey, ()) if all(t is not d for d in devices)]
        self._devices[skey] = list(devices)
        if left:
            self._demote(self._private(state), left)

    def on_borrowed(self, skey: tuple[str, int], ckpts: list[bytes], tiers: Iterable[LRUTier | None]) -> None:
        """A prefill read the session's state from another node (a peer read) and stored its
        turn's checkpoints ``ckpts`` in ``tiers`` for the hand-off: the session's home stays the
        decode worker's node, so these copies (the private ones) go first."""
        if self.enabled and skey in self._sessions:
            self._demote_private(ckpts, tiers)

    def on_handed_off(self, skey: tuple[str, int], tiers: Iterable[LRUTier | None]) -> None:
        """The session's turn moved to a decode worker on another node, which stored it: its
        private objects in ``tiers`` (the prefill node's host and disk) go first."""
        state = self._sessions.get(skey)
        if self.enabled and state is not None:
            self._demote(self._private(state), tiers)

    def on_speculative(self, ckpts: list[bytes], tiers: Iterable[LRUTier | None]) -> None:
        """A prefill's speculative checkpoints ``ckpts`` (the start prior's) landed in ``tiers``
        (a node's host and disk): the private ones go first there. Kept while the tier has room,
        they yield to what a session is known to resume (docs/router.md, "Round 37")."""
        if self.enabled:
            self._demote_private(ckpts, tiers)

    def _demote_private(self, ckpts: list[bytes], tiers: Iterable[LRUTier | None]) -> None:
        """``ckpts`` but the shared ones (NOTE 1) go first in ``tiers``."""
        shared = self.shared
        self._demote([k for k in ckpts if k[1:] not in shared], tiers)

    def _private(self, state: tuple[list[bytes], list[bytes]]) -> list[bytes]:
        """The session's private objects, start to end (the end is demoted last: evicted first)."""
        digests, mine = state
        shared = self.shared
        keys: list[bytes] = []
        for d in digests:
            if d not in shared:
                keys.append(d)
                keys.append(_K + d)
        keys.extend(mine)
        return keys

    def on_session_end(self, skey: tuple[str, int], tiers: Iterable[LRUTier | None]) -> None:
        """The session will not come back: its private objects go first (tail first); policy
        "checkpoints" only forgets it, unless its client said so (``client_ends``)."""
        if not self.enabled:
            return
        state = self._sessions.pop(skey, None)
        done = self._demoted.pop(skey, 0)
        self._devices.pop(skey, None)
        self._turns.pop(skey, None)
        self._starts.pop(skey, None)
        if state is None or not (self.full or self.client_ends):
            return
        digests, mine = state
        shared = self.shared
        keys: list[bytes] = []
        for d in digests:  # start to end: the end is demoted last, so it is evicted first
            if d not in shared:
                keys.append(d)
                keys.append(_K + d)
        keys.extend(mine[done:])
        self._demote(keys, tiers)

    def _demote(self, keys: list[bytes], tiers: Iterable[LRUTier | None]) -> None:
        self.num_demoted += len(keys)
        for tier in tiers:
            if tier is not None:
                tier.demote(keys)
