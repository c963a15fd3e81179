"""State-aware router: prefix index + load + affinity, with P/D decisions.

Per request:

    0. the request's expected output tokens: the client's own figure if it gave one, else what the
       session's finished requests generated (a new session's: the cluster's), under its ``max_tokens``
       (``disagg.router.outputs``; docs/router.md, "Round 24")
    1. one index walk for all workers -> resumable (tokens, tier) per worker,
       and the commonly held leading blocks (read and resumed by more than common_fraction
       of the n healthy workers, and by at least common_min_workers)
    1b. with ``pending_credit`` (off by default): the prefixes that prefills routed earlier
        will store and have not yet, credited as device resumes where waiting for them is
        the shortest way to the first token (``disagg.router.pending``; docs/router.md,
        "Round 23")
    2. effective loads = live stats + own in-flight predictions
    3a. aggregated pool (every role "both"): profile "both" picks one worker
    3b. P/D pools: profile "decode" picks D, charging a candidate the stall of a local
        prefill where the decider, given the prefill pool's view, would take one there
        (``harm_pool_view``: ``PDDecider.local_mask``); (with ``peer_reads``, the prefill
        pool on other nodes is then credited with what D's node tiers hold, which
        a prefill reads through that node's state service: ``credit_node_state``;
        off by default, docs/router.md "Round 5"); the decider compares the uncached
        suffix at D against a threshold, the prefill pool's load and what the
        pool would compute (queued + uncached at its cheapest worker, against
        the suffix at D plus what it steals from D's running decodes; D counts
        as idle when no request routed to it is unfinished); either prefill
        locally on D or run profile "prefill" to pick P
    3c. one pool of one role ("prefill" or "decode": a Serve deployment, whose
        router sees only its own replicas): that phase's profile picks one; the
        P/D decision is taken where both pools' figures meet, the decode
        worker's request flow (``disagg.flow`` NOTE 5), with the same decider;
        a decode pool is told its prefill pool's nodes (``prefill_nodes``: what
        the decode profile's hand-off cost reads in 3b, as the Serve adapter
        learns them from the decode replicas' reports) and that pool's view of
        the request (``pool_view``: the local rules' figures, as in 3b; the
        adapter asks its process's router of the prefill pool)

    4. a session whose decode moved to another node than its last turn's left its
       state in that node's shared tiers: when they hold more of the prompt than the
       target's own walk row, the decision names that node and how much
       (``state_node`` / ``state_position``); the target reads it through that node's
       state service (``disagg.flow`` NOTE 10), and its turn lands on the new node
    5. the decision names where the prompt's prefill keeps extra KDA checkpoints
       (``checkpoint_back``): the distances back from a prompt's end at which the
       sessions' follow-ups diverge, learned from every session the router routes
       (``disagg.router.divergence``; a worker learns from its own sessions only),
       or none (``()``) once ``one_turn_after`` sessions started and none came back

Effective loads (live stats + in-flight predictions, active sessions and a
time-averaged queue per worker) come from ``disagg.router.loads``.

Per-decision work is one index walk (a fixed number of numpy calls over the
prompt's blocks, see ``disagg.router.index``) plus numpy over the candidates
(``RoutingContext.view``): O(prompt blocks + workers) with small constants.

Decision reasons are "<pd>/<cache>" with pd in {aggregated, disagg,
local_short_suffix, local_prefill_busy, local_state, local_idle, local_burst, local_no_prefill_pool, prefill_pool,
decode_pool} and cache in
{cache_hit, fallback, cold}: "fallback" means a better-cached eligible
worker existed but load (guard or scores) sent the request elsewhere.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from disagg.router.context import LOAD_ROW, EffectiveLoad, LoadColumns, RoutingContext
from disagg.router.decider import PDDecider
from disagg.router.divergence import DivergenceLearner
from disagg.router.filters.role import ALLOWED_ROLES
from disagg.router.index import PrefixIndex
from disagg.router.loads import LoadTracker
from disagg.router.match import MatchResult, credit_node_state
from disagg.router.metrics import PoolView, RouterMetrics
from disagg.router.outputs import OutputPredictor
from disagg.router.pending import PendingPrefixes
from disagg.router.profile import ProfileResult
from disagg.router.registry import build_profiles
from disagg.router.types import TIER_INDEX, RouteDecision, RouteRequest, WorkerState
from disagg.session import session_key

_ID_NODE = attrgetter("worker_id", "node_id")
_AGGREGATED = {"both"}


@dataclass(slots=True)
class RouterConfig:
    profiles: dict[str, Any] = field(default_factory=dict)  # overrides of DEFAULT_PROFILES
    plugins: dict[str, dict[str, Any]] = field(default_factory=dict)  # shared plugin params
    decider: dict[str, Any] = field(default_factory=dict)  # DeciderConfig fields (defaults: disagg.config)
    common_fraction: float = 0.5  # share of workers that makes a block "common"
    common_min_workers: int = 2  # ... but never fewer workers than this
    prediction_tau_s: float = 5.0  # decay of in-flight predictions
    session_ttl_s: float = 120.0  # a session counts as active this long after its last turn
    queue_avg_tau_s: float = 60.0  # time constant of the time-averaged queued prefill
    area_tau_s: float = math.inf  # decay of the booked prefill area (inf: none)
    peer_reads: bool = False  # P/D: credit the pool with the decode worker's node tiers (3b)
    checkpoint_hints: bool = True  # learn where follow-ups diverge and name it in each decision (step 5)
    one_turn_after: int = 256  # ... and name none once this many sessions started without a follow-up
    pending_credit: bool = False  # credit prefixes routed and not stored yet where waiting pays (step 1b)
    pending_ttl_s: float = 120.0  # ... forgotten this long after routing, if never finished
    pending_step_tokens: int = 8192  # ... an engine step's prefill budget (``disagg.router.pending`` NOTE 4)
    harm_pool_view: bool = True  # P/D: decode placement charges a local prefill where any local rule takes one

    def __post_init__(self) -> None:
        if not 0.0 < self.common_fraction <= 1.0:
            raise ValueError("common_fraction must be in (0, 1]")
        if min(self.prediction_tau_s, self.session_ttl_s, self.queue_avg_tau_s, self.area_tau_s,
               self.pending_ttl_s) <= 0:
            raise ValueError("time constants must be positive")
        if self.pending_step_tokens < 0:
            raise ValueError("pending_step_tokens must be >= 0")
        if self.one_turn_after < 1:
            raise ValueError("one_turn_after must be >= 1")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> RouterConfig:
        unknown = set(cfg) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown router config keys {sorted(unknown)}")
        return cls(**cfg)

    @classmethod
    def from_yaml(cls, path: str) -> RouterConfig:
        import yaml

        with open(path) as f:
            return cls.from_dict(yaml.safe_load(f) or {})


class StateAwareRouter:
    name = "state_aware"

    def __init__(
        self,
        index: PrefixIndex | None = None,
        config: RouterConfig | dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if isinstance(config, dict):
            config = RouterConfig.from_dict(config)
        self.config = cfg = config or RouterConfig()
        self.index = index or PrefixIndex()
        self.clock = clock
        self.profiles = build_profiles(cfg.profiles, cfg.plugins)
        self.decider = PDDecider(**cfg.decider)
        self.metrics = RouterMetrics()
        self.loads = LoadTracker(cfg.prediction_tau_s, cfg.session_ttl_s, cfg.queue_avg_tau_s, cfg.area_tau_s)
        # request id -> (predicted, prompt_len, decode worker, prefill target, routed at, uncached)
        self._inflight: dict[str, tuple[int, int, str, str, float, int]] = {}
        self._to_decode: dict[str, int] = {}  # decode worker -> routed there, not finished
        self._ending: dict[str, str] = {}  # request id -> the session it ends (RouteRequest.session_end)
        self._known: list[str] = []  # worker ids registered by the last route() call
        self.divergence = DivergenceLearner(one_turn_after=self.config.one_turn_after)  # step 5
        self.outputs = OutputPredictor()  # what requests generate (step 0)
        self.pending = (PendingPrefixes(ttl_s=cfg.pending_ttl_s, step_tokens=cfg.pending_step_tokens)
                        if cfg.pending_credit else None)  # prompts routed, not stored yet (step 1b)

    # ---- effective state ---------------------------------------------------
    def effective_loads(self, workers: list[WorkerState], now: float) -> dict[str, EffectiveLoad]:
        """Per-worker effective loads (a dict view of what ``route`` uses)."""
        cols = self.loads.columns(workers, now)
        return {wid: cols.row(i) for i, wid in enumerate(cols.worker_ids)}

    def _register(self, workers: list[WorkerState], worker_ids: list[str]) -> None:
        # add_worker is idempotent and keeps a known worker's node: only a new id list needs it
        if worker_ids != self._known:
            for wid, node in map(_ID_NODE, workers):
                self.index.add_worker(wid, node)
            self._known = worker_ids

    # ---- decision ------------------------------------------------------------
    def route(self, request: RouteRequest, workers: list[WorkerState],
              prefill_nodes: Collection[str] = (), pool_view: PoolView | None = None) -> RouteDecision:
        """Place ``request`` on ``workers``; ``prefill_nodes``: a decode pool's prefill pool's
        nodes when that pool is not among ``workers`` (step 3c; in 3b they are the prefill
        workers'); ``pool_view``: that pool as its own router sees it for ``request`` (3c, with
        ``harm_pool_view``: the decode scorer's harm where any local rule would fire)."""
        assert workers, "route() needs at least one worker"
        now = self.clock()
        all_ids = [w.worker_id for w in workers]
        self._register(workers, all_ids)
        ids = [w.worker_id for w in workers if w.healthy]
        if len(ids) == len(all_ids):
            ids = all_ids  # one list: later equality checks against it short-cut on identity
        cfg = self.config
        common_min = max(cfg.common_min_workers, math.floor(cfg.common_fraction * len(ids)) + 1)
        match = self.index.match(request, ids, common_min)
        loads = self.loads.columns(workers, now, all_ids)  # expires old sessions: before the lookup
        if self.pending is not None:
            match = self._credit_pending(request, match, loads, workers, now)
        session = _session_key(request)  # "" when the request names none
        prev = self.loads.session(session)
        ctx = RoutingContext(
            request=request,
            match=match,
            loads=loads,
            session_worker=prev.worker_id if prev else None,
            session_node=prev.node_id if prev else None,
            now=now,
            expected_output=self.outputs.expect(session, request.output_len_hint, request.max_output_tokens),
            local_prefill=self._short_suffix,  # where a decode worker prefills locally (decode scorer)
        )
        roles = {w.role for w in workers}
        if roles == _AGGREGATED:
            res = self._run("both", ctx, workers)
            return self._decision(request, ctx, workers, res.picked or workers[0].worker_id, None, "aggregated", res, "both")
        if len(roles) == 1:  # one phase's pool (3c)
            (phase,) = roles
            if phase == "decode" and prefill_nodes:  # the hand-off's link, as in 3b
                ctx.prefill_nodes = frozenset(prefill_nodes)
            if phase == "decode" and cfg.harm_pool_view and prefill_nodes:  # the local rules, as in 3b
                known = pool_view is not None and pool_view.loads and pool_view.uncached is not None
                self.metrics.pool_views["read" if known else "missing"] += 1
                if known:
                    ctx.local_prefill = self._local_rules(pool_view.loads, pool_view.uncached,
                                                          ctx.session_worker is None)
            res = self._run(phase, ctx, workers)
            return self._decision(request, ctx, workers, res.picked or workers[0].worker_id, None, f"{phase}_pool",
                                  res, phase)
        ctx.prefill_nodes = frozenset(w.node_id for w in workers if w.healthy and w.role == "prefill")
        pool = [w for w in workers if w.healthy and w.role in ALLOWED_ROLES["prefill"] and w.role != "both"]
        if cfg.harm_pool_view and pool:
            pv = ctx.view(pool)
            ctx.local_prefill = self._local_rules(pv.prefill.tolist(), (request.prompt_len - pv.resumable).tolist(),
                                                  ctx.session_worker is None)
        dec = self._run("decode", ctx, workers)
        decode_id = dec.picked
        if decode_id is None:  # no healthy decode-capable worker: degrade to any healthy worker
            decode_id = ids[0] if ids else workers[0].worker_id
        held = ctx.match.resume(decode_id)[0]
        suffix = request.prompt_len - held
        if cfg.peer_reads and held:  # the pool reads the state D's node tiers hold (not its device)
            dnode = self.index.node_of(decode_id)
            far = {w.worker_id for w in pool if w.node_id != dnode}  # the walk reads dnode's tiers for the rest
            m = credit_node_state(ctx.match, far, self.index.node_of, dnode, held, True) \
                if far and self.index.node_holds_point(request, held, dnode) else ctx.match
            if m is not ctx.match:
                ctx = RoutingContext(request=request, match=m, loads=ctx.loads, session_worker=ctx.session_worker,
                                     session_node=ctx.session_node, now=now, prefill_nodes=ctx.prefill_nodes)
        pv = ctx.view(pool)  # the pool's effective loads and resumable tokens, as columns
        pool_q = pv.prefill.tolist()
        pool_u = (request.prompt_len - pv.resumable).tolist()
        dworker = next((w for w in workers if w.worker_id == decode_id), workers[0])
        dload = ctx.load(dworker)
        running = dload.decode_requests
        coming = max(running, self._to_decode.get(decode_id, 0))  # running, or routed there and not finished
        pd = self.decider.decide(suffix, pool_q, pool_u, running, coming, first_turn=ctx.session_worker is None,
                                 decode_queued=dload.prefill_tokens)
        if not pd.disaggregate:
            return self._decision(request, ctx, workers, decode_id, None, pd.reason, dec, "decode")
        pre = self._run("prefill", ctx, workers)
        if pre.picked is None:
            return self._decision(request, ctx, workers, decode_id, None, "local_no_prefill_pool", dec, "decode")
        return self._decision(request, ctx, workers, decode_id, pre.picked, pd.reason, pre, "prefill")

    def _short_suffix(self, suffix, batch, queued):
        """The decode scorer's harm mask from the decode worker alone (``PDDecider.short_suffix``)."""
        return self.decider.short_suffix(suffix, batch)

    def _local_rules(self, loads: list[float], uncached: list[float], first_turn: bool) -> Callable:
        """Where the decider would prefill a request on each decode candidate, by every local rule,
        given the prefill pool's view (per worker its effective queued prefill and the request's
        uncached tokens) taken before placement (``PDDecider.local_mask``)."""
        mask = self.decider.local_mask
        return lambda suffix, batch, queued: mask(suffix, batch, queued, loads, uncached, first_turn)

    def _credit_pending(self, request: RouteRequest, match: MatchResult, loads: LoadColumns,
                        workers: list[WorkerState], now: float) -> MatchResult:
        """``match`` with the prefixes other requests' queued prefills will store credited, as device
        resumes, on the workers where waiting for them is the shortest way to the first token (step 1b,
        ``disagg.router.pending``); ``match`` itself when none is."""
        credit = self.pending.credit(request, now)
        if not credit:
            return match
        ids, held = match.worker_ids, match.resumable
        q = loads.data[LOAD_ROW["prefill_tokens"]].tolist()
        col = {wid: i for i, wid in enumerate(loads.worker_ids)}
        role = {w.worker_id: w.role for w in workers}
        cost = [q[col[wid]] - r for wid, r in zip(ids, held, strict=True)]  # queue ahead minus resumable
        res = tiers = None
        for i, wid in enumerate(ids):
            k = credit.get(wid, 0)
            if k <= held[i]:
                continue
            mine = role[wid]
            alt = min((c for j, c in enumerate(cost) if j != i and role[ids[j]] == mine), default=math.inf)
            if q[col[wid]] - k < alt:
                if res is None:
                    res, tiers = list(held), list(match.tiers)
                res[i], tiers[i] = k, TIER_INDEX["device"]
        if res is None:
            return match
        return MatchResult(common_blocks=match.common_blocks, worker_ids=ids, resumable=res, tiers=tiers,
                           mla_blocks=match.mla_blocks)

    def _run(self, profile: str, ctx: RoutingContext, workers: list[WorkerState]) -> ProfileResult:
        ctx.phase = profile
        return self.profiles[profile].run(ctx, workers)

    def _decision(
        self,
        request: RouteRequest,
        ctx: RoutingContext,
        workers: list[WorkerState],
        decode_id: str,
        prefill_id: str | None,
        pd_reason: str,
        res: ProfileResult,
        phase: str,
    ) -> RouteDecision:
        target = prefill_id if prefill_id is not None else decode_id
        cached, tier = ctx.match.resume(target)
        state_node, state_position = self._state_home(request, ctx, decode_id, target, cached)
        if phase == "both":  # every healthy worker is eligible: the walk's rows
            best = max(ctx.match.resumable, default=0)
        else:
            roles = ALLOWED_ROLES[phase]
            m = ctx.match
            held = dict(zip(m.worker_ids, m.resumable, strict=True))
            best = max((held.get(w.worker_id, 0) for w in workers if w.healthy and w.role in roles), default=0)
        cache = "cold" if best == 0 else "cache_hit" if cached >= best else "fallback"
        return RouteDecision(
            request_id=request.request_id,
            decode_worker=decode_id,
            prefill_worker=prefill_id,
            reason=f"{pd_reason}/{cache}",
            predicted_cached_tokens=cached,
            source_tier=tier,
            scores=res.totals,
            state_node=state_node,
            state_position=state_position,
            checkpoint_back=self.divergence.hint() if self.config.checkpoint_hints else None,
            first_turn=ctx.session_worker is None,
        )

    def _state_home(self, request: RouteRequest, ctx: RoutingContext, decode_id: str, target: str,
                    cached: int) -> tuple[str, int]:
        """(node, resumable tokens) of a moved session's last node when its shared tiers hold more
        of the prompt than ``target`` resumes by itself; ("", 0) otherwise (step 4)."""
        home = ctx.session_node
        node_of = self.index.node_of
        if not home or home == node_of(decode_id) or home == node_of(target):
            return "", 0
        m = ctx.match
        rows = [r for wid, r in zip(m.worker_ids, m.resumable, strict=True) if node_of(wid) == home]
        if rows:
            best = max(rows)
        else:  # no walked worker there (down, or another pool's): the session's last worker, walked alone
            best = self.index.resumable(request, ctx.session_worker)[0] if ctx.session_worker else 0
        if best > cached and self.index.node_holds_point(request, best, home):
            return home, best
        return "", 0

    # ---- feedback --------------------------------------------------------------
    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        now = self.clock()
        uncached = max(request.prompt_len - decision.predicted_cached_tokens, 0)
        session = _session_key(request)
        self.loads.on_routed(session, request.prompt_len, uncached, decision.prefill_target,
                             decision.decode_worker, self.index.node_of(decision.decode_worker), now)
        self.outputs.book(request.request_id, session)
        self._inflight[request.request_id] = (decision.predicted_cached_tokens, request.prompt_len,
                                              decision.decode_worker, decision.prefill_target, now, uncached)
        self._to_decode[decision.decode_worker] = self._to_decode.get(decision.decode_worker, 0) + 1
        if request.session_end and request.session_id:
            self._ending[request.request_id] = session
        if self.pending is not None and uncached:
            self.pending.add(request, decision.prefill_target, decision.predicted_cached_tokens, now,
                             decision.checkpoint_back or ())
        self.metrics.record_decision(decision.reason, decision.source_tier)
        if self.config.checkpoint_hints:
            self.divergence.observe(session, request.block_hashes, request.prompt_len,
                                    request.block_size)

    def end_session(self, session: str) -> None:
        """``session`` (a ``session_key``) is over, its client said (a DELETE; an in-band
        ``RouteRequest.session_end`` is forgotten when its request finishes): it stops counting
        on its worker."""
        self.loads.end_session(session)

    def on_finished(self, request_id: str, realized_cached_tokens: int | None,
                    output_tokens: int | None = None, served: tuple[float, float] | None = None,
                    worker: str | None = None) -> None:
        """The request ended: with the cached tokens it reused, or None without a result (abandoned,
        failed), which drops its bookkeeping and records nothing; ``output_tokens``: what it
        generated, which teaches the output expectation (step 0; None: not counted); ``served``:
        when its decode began and when it ended, on ``clock``, so reports taken before its end stop
        counting it (``disagg.router.loads`` NOTE 6); ``worker``: the one that ran it, where the
        caller knows (a serving layer may run a request elsewhere than routed: counted as
        overridden)."""
        self.outputs.learn(request_id, output_tokens if realized_cached_tokens is not None else None)
        if self.pending is not None:
            self.pending.remove(request_id)
        entry = self._inflight.pop(request_id, None)
        if entry is None:
            return
        predicted, prompt_len, decode_id, prefill_id, routed_at, uncached = entry
        self.loads.on_finished(prefill_id, decode_id, routed_at, uncached, prompt_len, served)
        ending = self._ending.pop(request_id, None)
        if ending is not None and realized_cached_tokens is not None:  # answered: the session is over
            self.loads.end_session(ending)
        left = self._to_decode[decode_id] - 1
        if left:
            self._to_decode[decode_id] = left
        else:
            del self._to_decode[decode_id]
        if realized_cached_tokens is not None:
            self.metrics.record_finished(predicted, realized_cached_tokens, prompt_len,
                                         overridden=worker is not None and worker != decode_id)


def _session_key(request: RouteRequest) -> str:
    """Sessions are a tenant's (``disagg.session``)."""
    return session_key(request.cache_salt, request.session_id)
