"""The per-decision view every filter and scorer reads.

A ``RoutingContext`` is built once per request by the router: the prefix-index
walk (one walk for all workers), the effective load of each worker (live
stats plus the router's own in-flight predictions), the session's previous
placement, and which phase is being placed.

    effective_prefill(w) = queued_prefill_tokens(w)
                         + sum_{routed r to w after w.updated_at} uncached(r) * exp(-(now - t_r) / tau)

Plugins that work on all candidates at once ask for ``ctx.view(workers)``:
numpy columns aligned with ``workers`` (row i = workers[i]), built once per
candidate list and shared by the scorers of a profile:

    view.loads                  effective loads, one row per EffectiveLoad field (LOAD_ROW)
    view.prefill, view.decode, view.cache, view.sessions, ...   named rows of view.loads
    view.resumable, view.tier   index walk (tier -1: none)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from itertools import repeat

import numpy as np

from disagg.router.index import MatchResult, PrefixMatch
from disagg.router.types import RouteRequest, WorkerState

PHASES = ("prefill", "decode", "both")


@dataclass(slots=True)
class EffectiveLoad:
    """Load the policy acts on: live stats plus not-yet-reported predictions."""

    prefill_tokens: float = 0.0  # queued prefill tokens
    decode_tokens: float = 0.0  # context tokens of running and inbound decodes
    decode_requests: float = 0.0  # running decode requests
    cache_utilization: float = 0.0  # device cache fill, 0..1
    active_sessions: float = 0.0  # sessions whose last turn ran here within the TTL
    session_tokens: float = 0.0  # context tokens of those sessions (their last prompt)
    queue_avg: float = 0.0  # time-average of prefill_tokens (see disagg.router.loads)
    booked_area: float = 0.0  # prefill area booked by routing, tokens^2 (see disagg.router.loads)
    prefill_requests: float = 0.0  # requests queued for prefill (live + predictions): the batch's next joiners
    inbound_decodes: float = 0.0  # P/D: requests prefilling in the pool for this decode worker, or handing
    #                               off (live + predictions): its batch's next joiners from elsewhere


LOAD_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(EffectiveLoad))
LOAD_ROW: dict[str, int] = {name: i for i, name in enumerate(LOAD_FIELDS)}


@dataclass(slots=True)
class LoadColumns:
    """Effective loads of a worker list: ``data[LOAD_ROW[field], i]`` is worker_ids[i]'s value."""

    worker_ids: list[str]  # column order
    data: np.ndarray  # float64, shape (len(LOAD_FIELDS), len(worker_ids))

    def __post_init__(self) -> None:
        assert self.data.shape == (len(LOAD_FIELDS), len(self.worker_ids)), "load matrix shape"

    def row(self, i: int) -> EffectiveLoad:
        return EffectiveLoad(*self.data[:, i].tolist())


@dataclass(slots=True)
class CandidateView:
    """Columns for one candidate list, aligned with it (see module docstring)."""

    worker_ids: list[str]  # candidates, in the order the plugin received them
    loads: np.ndarray  # (len(LOAD_FIELDS), n) effective loads, rows in LOAD_FIELDS order
    resumable: np.ndarray  # resumable tokens (float64)
    tier: np.ndarray  # slowest tier index of the resume, -1 = none (int64)

    @property
    def prefill(self) -> np.ndarray:  # effective queued prefill tokens
        return self.loads[0]

    @property
    def decode(self) -> np.ndarray:  # effective running decode tokens
        return self.loads[1]

    @property
    def cache(self) -> np.ndarray:  # device cache utilization, 0..1
        return self.loads[3]

    @property
    def sessions(self) -> np.ndarray:  # active sessions
        return self.loads[4]

    @property
    def session_tokens(self) -> np.ndarray:  # context tokens of the active sessions
        return self.loads[5]

    @property
    def queue_avg(self) -> np.ndarray:  # time-averaged queued prefill tokens
        return self.loads[6]

    @property
    def booked_area(self) -> np.ndarray:  # prefill area booked by routing, tokens^2
        return self.loads[7]


@dataclass(slots=True)
class RoutingContext:
    """Everything a plugin may read for one placement."""

    request: RouteRequest  # the request being placed
    match: MatchResult  # prefix-index walk over all known candidates
    loads: dict[str, EffectiveLoad] | LoadColumns  # per worker (dict) or as columns (router)
    phase: str = "both"  # "prefill" | "decode" | "both"
    session_worker: str | None = None  # worker of the session's previous turn
    session_node: str | None = None  # node of that worker
    now: float = 0.0  # router clock
    prefill_nodes: frozenset[str] = frozenset()  # P/D: nodes of the healthy prefill workers (else empty)
    expected_output: float = 0.0  # the request's expected output tokens (router step 0; 0 = unknown)
    # P/D: (suffix, running decodes, queued prefill tokens) per candidate -> whether the decider would
    # prefill the request on that decode worker (the short-suffix rule, or every rule where the prefill
    # pool's view is known: ``Router._local_rules``; None: not known, every candidate may)
    local_prefill: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray] | None = None
    extra: dict[str, object] = field(default_factory=dict)  # plugin scratch space
    _views: dict[tuple[str, ...], CandidateView] = field(default_factory=dict)  # cache of view()
    _last: tuple[list[WorkerState], WorkerState, CandidateView] | None = None  # last list viewed (identity)
    _base: CandidateView | None = None  # first view built
    _base_rows: dict[str, int] | None = None  # worker id -> row of _base (built on first subset)
    _load_rows: dict[str, int] | None = None  # worker id -> column of loads (columns form)
    _match_rows: dict[str, int] | None = None  # worker id -> row of match

    def __post_init__(self) -> None:
        assert self.phase in PHASES, f"unknown phase {self.phase!r}"

    def prefix(self, worker_id: str) -> PrefixMatch:
        return self.match.get(worker_id)

    def common_tokens(self) -> int:
        """Tokens of the leading blocks most candidates hold and resume (hot shared prefix; index NOTE 8)."""
        r = self.request
        return min(self.match.common_blocks * r.block_size, r.prompt_len)

    def load(self, w: WorkerState) -> EffectiveLoad:
        if isinstance(self.loads, LoadColumns):
            if self._load_rows is None:
                self._load_rows = {wid: i for i, wid in enumerate(self.loads.worker_ids)}
            i = self._load_rows.get(w.worker_id)
            if i is not None:
                return self.loads.row(i)
        elif w.worker_id in self.loads:
            return self.loads[w.worker_id]
        return EffectiveLoad(
            w.queued_prefill_tokens, w.running_decode_tokens + w.inbound_decode_tokens, w.running_decode_requests,
            w.cache_utilization, prefill_requests=w.queued_prefill_requests, inbound_decodes=w.inbound_decode_requests,
        )

    def view(self, workers: list[WorkerState]) -> CandidateView:
        """Numpy columns for ``workers`` (cached per candidate list).

        The plugins of one profile receive the same list object: the last
        list viewed is recognized by identity (and its last element), so
        scorers after the first pay no per-worker work.
        """
        last = self._last
        if last is not None and last[0] is workers and workers and workers[-1] is last[1]:
            return last[2]
        ids = [w.worker_id for w in workers]
        key = tuple(ids)
        v = self._views.get(key)
        if v is None:
            if self._base is None:
                self._base = self._full_view()
            v = self._views[key] = self._subset_view(ids) or CandidateView(
                ids, self._load_matrix(workers, ids), *self._match_columns(ids))
            if self._base is None:
                self._base = v
        if workers:
            self._last = (workers, workers[-1], v)
        return v

    def worker_ids(self, workers: list[WorkerState]) -> list[str]:
        """``[w.worker_id for w in workers]``, from the view when ``workers`` is the list viewed last."""
        last = self._last
        if last is not None and last[0] is workers and workers and workers[-1] is last[1]:
            return last[2].worker_ids
        return [w.worker_id for w in workers]

    def subset(self, workers: list[WorkerState], view: CandidateView, keep: np.ndarray) -> list[WorkerState]:
        """``workers[i]`` for each i with ``keep[i]`` (a filter's result), with its view ready.

        ``view`` is ``self.view(workers)``; the kept rows of it become the kept
        list's view (recognized by identity), so the scorers after the filter
        pay no per-worker lookup.
        """
        rows = keep.nonzero()[0]
        rows_l = rows.tolist()
        kept = list(map(workers.__getitem__, rows_l))
        if kept:
            v = CandidateView(list(map(view.worker_ids.__getitem__, rows_l)), view.loads[:, rows],
                              view.resumable[rows], view.tier[rows])
            self._last = (kept, kept[-1], v)
        return kept

    def _full_view(self) -> CandidateView | None:
        """The view of every worker the load columns hold, in their order (None: loads as a dict).
        Candidate lists are subsets of it: their views are its rows (``_subset_view``)."""
        cols = self.loads
        if not isinstance(cols, LoadColumns):
            return None
        ids = cols.worker_ids
        return CandidateView(ids, cols.data, *self._match_columns(ids))

    def _subset_view(self, ids: list[str]) -> CandidateView | None:
        """Rows of the base view (every worker of the load columns, else the first view built),
        when it holds every id (filters only remove)."""
        base = self._base
        if base is None:
            return None
        if ids == base.worker_ids:
            return base
        if self._base_rows is None:
            self._base_rows = {wid: i for i, wid in enumerate(base.worker_ids)}
        pos = self._base_rows
        n = len(ids)
        rows = np.fromiter(map(pos.get, ids, repeat(-1, n)), np.intp, n)
        if n and rows.min() < 0:
            return None
        return CandidateView(ids, base.loads[:, rows], base.resumable[rows], base.tier[rows])

    def _match_columns(self, ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        m = self.match
        if ids == m.worker_ids:
            return m.columns()
        if self._match_rows is None:
            self._match_rows = {wid: i for i, wid in enumerate(m.worker_ids)}
        n = len(ids)
        rows = np.fromiter(map(self._match_rows.get, ids, repeat(-1, n)), np.intp, n)
        res_all, tier_all = m.columns()
        res = np.append(res_all, 0.0)[rows]  # row -1: the appended "no match"
        tier = np.append(tier_all, -1)[rows]
        return res, tier

    def _load_matrix(self, workers: list[WorkerState], ids: list[str]) -> np.ndarray:
        cols = self.loads
        if isinstance(cols, LoadColumns):
            if ids == cols.worker_ids:
                return cols.data
            if self._load_rows is None:
                self._load_rows = {wid: i for i, wid in enumerate(cols.worker_ids)}
            rows = [self._load_rows.get(wid, -1) for wid in ids]
            if -1 not in rows:
                return cols.data[:, np.asarray(rows, np.intp)]
        per = [self.load(w) for w in workers]
        return np.array([[getattr(x, f) for x in per] for f in LOAD_FIELDS], np.float64).reshape(len(LOAD_FIELDS), -1)
