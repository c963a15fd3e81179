"""Effective loads: live stats plus what the router itself knows and stats lag.

Per worker w, at decision time ``now`` (one numpy column each, see
``disagg.router.context.LoadColumns``):

    pending(w)   = sum_{r routed to w, t_r > w.updated_at} n_r * exp(-(now - t_r) / prediction_tau_s)
    prefill(w)   = queued_prefill_tokens(w) + pending_prefill(w)          n_r = uncached tokens of r
    decode(w)    = running_decode_tokens(w) + inbound_decode_tokens(w)
                   + pending_decode(w) + pending_inbound(w)              n_r = prompt tokens of r
    requests(w)  = queued_prefill_requests(w) + pending_prefill(w)        n_r = 1 (the prefill_requests row)
    inbound(w)   = inbound_decode_requests(w) + pending_inbound(w)        n_r = 1, r prefilled in the pool
                                                                          (the inbound_decodes row, NOTE 5)
    sessions(w)  = sessions whose last turn went to w within session_ttl_s
    s_tokens(w)  = sum of those sessions' last prompt lengths
    queue_avg(w) = exponential time-average of prefill(w), time constant queue_avg_tau_s:

        prefill(w) is held piecewise constant between observations (each decision
        observes it; routing a request to w adds its uncached tokens at once), and
        queue_avg <- queue_avg + (1 - exp(-dt / tau)) * (held - queue_avg)

    area(w)      = prefill area booked by routing: each request routed to w adds
                   n (n / 2 + held(w)), n its uncached tokens (tokens^2: the token-seconds
                   of queued prefill it adds, waiting behind the held queue and then
                   draining, times the prefill rate); decays with area_tau_s (inf: never)

Predictions made before the worker's stats timestamp are dropped (the stats
include them; one made at the very instant of the stats is kept, so a burst
routed in one instant is spread), so the router reacts to a burst before
stats arrive and stops double counting once they do. The converse holds for
requests that ended: a report taken while r ran, older than r's end, still
counts r, so r's rows are taken off that report (NOTE 6). ``queue_avg`` is the smoothed load that breaks
ties between idle workers: most of the time every queue is empty, and the
worker that has carried the least queued prefill lately is the one to give
the next large prompt to.

NOTES
1. Per-worker state lives in arrays indexed by a stable slot per worker id
   (slots are never reused), so a decision's update is a few numpy ops.
2. ``_state[0, s] >= 0`` (sessions) and ``_state[1, s] >= 0`` (their tokens)
   for every slot s: a session is counted on exactly one worker (its latest
   turn's).
3. A slot never observed holds queue 0 since time 0, so its first
   observation leaves queue_avg at 0.
4. A request that ended takes its predictions with it (``on_finished``):
   until its worker's next report they would count a decode that no longer
   runs, and a session's next turn would see its own previous turn as load
   on the worker holding its state.
5. A request prefilled in the pool reaches its decode worker's batch only
   after its prefill and hand-off, so a decode prediction dropped at the
   worker's next report, which need not show it running yet, would leave it
   counted nowhere. The decode worker reports it as inbound from the moment
   it sends the prompt to the pool (``WorkerState.inbound_decode_requests``;
   in serving a few milliseconds after the routing, once its flow has
   decided), so the drop rule holds for these too: a report newer than that
   counts the request, inbound or running. Predictions of requests prefilled on
   their decode worker are counted by the prefill rows instead (that
   worker's queue), so they do not count as inbound.
6. A report stamped at t with routed_at(r) < t < ended(r) counted r, which
   runs nowhere now: until a report newer than r's end lands, r is taken off
   its decode worker's report (``on_finished`` with ``served``). Before
   ``decode_from`` (when its engine began counting it as a decode: its first
   output; handed off by the pool, the start of its decode) the report held
   it as a queued prefill (its uncached tokens and one request; prefilled in
   the pool: one inbound decode and its prompt tokens), from then on as one
   running decode of its prompt tokens. Each row stays >= 0, and when the
   report holds no request in the state the stamps and the routing say, r is
   taken from another state it can be in: near ``decode_from`` the engine's
   figures and the flow's stamp can disagree by an event-loop hop, and a
   serving decode pool's router does not know which requests its replicas
   send to the prefill pool (the flow decides, ``disagg.flow`` NOTE 5): it
   sees them as prefilled on their decode worker, and a report held them as
   inbound decodes. Without this a
   session's next turn, sent as soon as the last one answered, saw its own
   finished turn decoding on the worker holding its state (the report in hand
   was taken a moment before that turn's end), and the decode scorer could
   send it elsewhere. Serving stamps both ends on the replica's clock, like
   its reports (``StreamChunk.served``), so the comparison does not depend on
   how late the router hears of either. Where one router places both pools
   (the simulator's P/D), a pool's prefill worker is not discounted: its
   report held r's prefill only until the hand-off, long before r ended. In
   serving the prefill pool has its own router, in each decode replica's
   process; the decode replica tells it each remote prefill's end with the
   prefill replica's stamp of it (``PrefillHandle.computed_at`` as both
   ends: a prefill is a queued prefill until its prompt is computed).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from disagg.router.context import LOAD_FIELDS, LOAD_ROW, LoadColumns
from disagg.router.types import WorkerState

_T = attrgetter("updated_at")
_PREFILL_REQUESTS = LOAD_ROW["prefill_requests"]
_INBOUND = LOAD_ROW["inbound_decodes"]
_DECODE_REQUESTS = LOAD_ROW["decode_requests"]
_PREFILL_TOKENS = LOAD_ROW["prefill_tokens"]
_DECODE_TOKENS = LOAD_ROW["decode_tokens"]
_ROWS = 6  # per-slot state rows: sessions, their tokens, queue_avg, held prefill, its time, booked area


@dataclass(slots=True)
class SessionPlacement:
    """Where a session's latest turn went."""

    worker_id: str  # decode worker of the latest turn
    node_id: str  # its node
    routed_at: float  # router clock at routing
    prompt_len: int  # prompt tokens of that turn (the session's context)


@dataclass(slots=True)
class _Ended:
    """A request that ended, while reports taken before its end still count it (NOTE 6)."""

    routed_at: float
    decode_from: float  # from then its engine counted it as a decode: before, as a prefill (or inbound)
    ended: float
    prompt_len: int
    uncached: int
    local: bool  # prefilled on its decode worker (else in the pool: inbound before its decode)


class LoadTracker:
    """Pending predictions, active sessions and smoothed queues per worker."""

    def __init__(self, prediction_tau_s: float = 5.0, session_ttl_s: float = 120.0, queue_avg_tau_s: float = 60.0,
                 area_tau_s: float = math.inf):
        if min(prediction_tau_s, session_ttl_s, queue_avg_tau_s, area_tau_s) <= 0:
            raise ValueError("time constants must be positive")
        self.prediction_tau_s = prediction_tau_s
        self.session_ttl_s = session_ttl_s
        self.queue_avg_tau_s = queue_avg_tau_s
        self.area_tau_s = area_tau_s
        self._slot: dict[str, int] = {}  # worker id -> slot (NOTE 1)
        self._last_ids: list[str] = []  # worker list of the last columns() call ...
        self._last_slots: np.ndarray | slice = slice(0, 0)  # ... and its slots
        self._prefill_pending: dict[str, list[tuple[float, int]]] = {}  # worker -> [(t, tokens)]
        self._decode_pending: dict[str, list[tuple[float, int]]] = {}  # prefilled on the decode worker
        self._inbound_pending: dict[str, list[tuple[float, int]]] = {}  # prefilled in the pool (NOTE 5)
        self._ended: dict[str, list[_Ended]] = {}  # decode worker -> requests that ended lately (NOTE 6)
        self._sessions: OrderedDict[str, SessionPlacement] = OrderedDict()  # oldest first
        # per slot (columns): active sessions, their tokens, queue_avg, the prefill load observed
        # last (held until the next observation) and the time of that observation
        self._state = np.zeros((_ROWS, 0))

    # ---- slots ---------------------------------------------------------------
    def _slots(self, ids: list[str]) -> np.ndarray | slice:
        """Slots of ``ids``: a slice when they are consecutive (the usual, stable worker list)."""
        if ids == self._last_ids:
            return self._last_slots
        get = self._slot.get
        out = [get(w) for w in ids]
        if None in out:
            for i, w in enumerate(ids):
                if out[i] is None:
                    out[i] = self._slot[w] = len(self._slot)
            self._grow(len(self._slot))
        slots: np.ndarray | slice = np.asarray(out, np.intp)
        if out and out == list(range(out[0], out[0] + len(out))):
            slots = slice(out[0], out[0] + len(out))
        if len(ids) > 2:
            self._last_ids, self._last_slots = ids, slots
        return slots

    def _slot_of(self, worker_id: str) -> int:
        slot = self._slot.get(worker_id)
        if slot is None:
            slot = self._slot[worker_id] = len(self._slot)
            self._grow(len(self._slot))
        return slot

    def _grow(self, n: int) -> None:
        old = self._state.shape[1]
        if n > old:
            self._state = np.concatenate([self._state, np.zeros((_ROWS, max(n, 2 * old, 16) - old))], axis=1)

    # ---- queries -------------------------------------------------------------
    def session(self, session_id: str) -> SessionPlacement | None:
        return self._sessions.get(session_id) if session_id else None

    def _pending(self, book: dict[str, list[tuple[float, int]]], pos: dict[str, int], updated: list[float],
                 now: float, out: np.ndarray, count: np.ndarray | None = None) -> None:
        tau = self.prediction_tau_s
        horizon = 10 * tau
        for wid in list(book):
            i = pos.get(wid)
            if i is None:
                continue
            t_stats = updated[i]
            items = [(t, n) for t, n in book[wid] if t >= t_stats and now - t < horizon]
            if items:
                book[wid] = items
                weights = [math.exp(-(now - t) / tau) for t, _ in items]
                out[i] += sum(n * x for (_, n), x in zip(items, weights, strict=True))
                if count is not None:
                    count[i] += sum(weights)
            else:
                del book[wid]

    def _discount_ended(self, pos: dict[str, int], updated: list[float], now: float, data: np.ndarray) -> None:
        """Take the requests that ended after their worker's report off that report (NOTE 6)."""
        horizon = 10 * self.prediction_tau_s
        for wid in list(self._ended):
            i = pos.get(wid)
            if i is None:
                continue
            t_stats = updated[i]
            live = [e for e in self._ended[wid] if e.ended > t_stats and now - e.ended < horizon]
            if not live:
                del self._ended[wid]
                continue
            self._ended[wid] = live
            for e in live:
                if e.routed_at >= t_stats:  # the report predates r: a newer one may count it
                    continue
                before = (_PREFILL_REQUESTS, _INBOUND) if e.local else (_INBOUND, _PREFILL_REQUESTS)
                states = (_DECODE_REQUESTS, *before) if t_stats >= e.decode_from else (*before, _DECODE_REQUESTS)
                # the state the stamps say, else another one it can be in
                row = next((r for r in states if data[r, i] >= 1), None)
                if row is None:
                    continue
                data[row, i] -= 1
                if row == _PREFILL_REQUESTS:  # a queued prefill: its uncached tokens
                    data[_PREFILL_TOKENS, i] = max(data[_PREFILL_TOKENS, i] - e.uncached, 0.0)
                else:  # a running or inbound decode: its prompt tokens
                    data[_DECODE_TOKENS, i] = max(data[_DECODE_TOKENS, i] - e.prompt_len, 0.0)

    def _expire_sessions(self, now: float) -> None:
        ttl = self.session_ttl_s
        while self._sessions:
            sid, s = next(iter(self._sessions.items()))
            if now - s.routed_at <= ttl:
                break
            self._sessions.popitem(last=False)
            self._forget(s)

    def _forget(self, s: SessionPlacement) -> None:
        slot = self._slot[s.worker_id]
        self._state[0, slot] -= 1
        self._state[1, slot] -= s.prompt_len
        assert self._state[0, slot] >= 0 and self._state[1, slot] >= 0, "session books went negative"

    def columns(self, workers: list[WorkerState], now: float, worker_ids: list[str] | None = None) -> LoadColumns:
        """Effective loads of ``workers`` at ``now``; also observes their queues for queue_avg.

        ``worker_ids`` (optional) is ``[w.worker_id for w in workers]``, when the caller has it.
        """
        self._expire_sessions(now)
        ids = [w.worker_id for w in workers] if worker_ids is None else worker_ids
        n = len(ids)
        slots = self._slots(ids)
        data = np.empty((len(LOAD_FIELDS), n))
        data[:4] = [[w.queued_prefill_tokens for w in workers],
                    [w.running_decode_tokens + w.inbound_decode_tokens for w in workers],
                    [w.running_decode_requests for w in workers], [w.cache_utilization for w in workers]]
        base = data[:4]  # the four live stats, one row each
        data[_PREFILL_REQUESTS] = [w.queued_prefill_requests for w in workers]
        data[_INBOUND] = [w.inbound_decode_requests for w in workers]
        if self._prefill_pending or self._decode_pending or self._inbound_pending or self._ended:
            pos = dict(zip(ids, range(n), strict=True))
            updated = list(map(float, map(_T, workers)))  # Python floats: compared per pending item
            if self._ended:
                self._discount_ended(pos, updated, now, data)
            self._pending(self._prefill_pending, pos, updated, now, base[0], data[_PREFILL_REQUESTS])
            self._pending(self._decode_pending, pos, updated, now, base[1])
            self._pending(self._inbound_pending, pos, updated, now, base[1], data[_INBOUND])
        st = self._state[:, slots]
        avg = st[2] + (1.0 - np.exp((st[4] - now) / self.queue_avg_tau_s)) * (st[3] - st[2])
        data[4:6] = st[:2]
        data[6] = avg
        state = self._state
        if self.area_tau_s != math.inf:
            st[5] *= np.exp((st[4] - now) / self.area_tau_s)
            state[5, slots] = st[5]
        data[7] = st[5]
        state[2, slots] = avg
        state[3, slots] = base[0]
        state[4, slots] = now
        return LoadColumns(ids, data)

    # ---- feedback ------------------------------------------------------------
    def on_routed(self, session_id: str, prompt_len: int, uncached: int, prefill_worker: str,
                  decode_worker: str, decode_node: str, now: float) -> None:
        """A request was dispatched: book its predicted load, its prefill area and its session."""
        self._prefill_pending.setdefault(prefill_worker, []).append((now, uncached))
        book = self._decode_pending if prefill_worker == decode_worker else self._inbound_pending
        book.setdefault(decode_worker, []).append((now, prompt_len))
        p_slot, d_slot = self._slot_of(prefill_worker), self._slot_of(decode_worker)
        self._state[5, p_slot] += uncached * (0.5 * uncached + self._state[3, p_slot])
        self._state[3, p_slot] += uncached
        if session_id:
            old = self._sessions.pop(session_id, None)
            if old is not None:
                self._forget(old)
            self._sessions[session_id] = SessionPlacement(decode_worker, decode_node, now, prompt_len)
            self._state[0, d_slot] += 1
            self._state[1, d_slot] += prompt_len

    def end_session(self, session_id: str) -> None:
        """The session is over (its client said so): it no longer counts on its worker."""
        old = self._sessions.pop(session_id, None) if session_id else None
        if old is not None:
            self._forget(old)

    def on_finished(self, prefill_worker: str, decode_worker: str, routed_at: float, uncached: int,
                    prompt_len: int, served: tuple[float, float] | None = None) -> None:
        """A request routed at ``routed_at`` ended: drop the load ``on_routed`` predicted for it. It
        runs nowhere now, whether or not a stats report saying so has landed yet (NOTE 4).
        ``served`` (when its engine began counting it as a decode, its end; this tracker's clock)
        takes it off its worker's reports taken before its end (NOTE 6); None: they count it until
        a newer one lands."""
        if served is not None and served[1] > routed_at:
            self._ended.setdefault(decode_worker, []).append(
                _Ended(routed_at, served[0], served[1], prompt_len, uncached, prefill_worker == decode_worker))
        decode_book = self._decode_pending if prefill_worker == decode_worker else self._inbound_pending
        for book, wid, n in ((self._prefill_pending, prefill_worker, uncached),
                             (decode_book, decode_worker, prompt_len)):
            items = book.get(wid)
            if items is None:
                continue
            try:
                items.remove((routed_at, n))
            except ValueError:  # dropped already: a report newer than the routing, or past the horizon
                continue
            if not items:
                del book[wid]
