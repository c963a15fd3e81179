"""State-aware router: prefix index + load + affinity, with P/D decisions.

Per request:

    1. one index walk for all workers -> resumable (tokens, tier) per worker,
       and the commonly held leading blocks (held by more than common_fraction
       of the n healthy workers, and by at least common_min_workers)
    2. effective loads = live stats + own in-flight predictions
    3a. aggregated pool (every role "both"): profile "both" picks one worker
    3b. P/D pools: profile "decode" picks D; the decider compares the uncached
        suffix at D against a threshold and the prefill pool's load; either
        prefill locally on D or run profile "prefill" to pick P

In-flight predictions (so the router reacts to load before stats arrive):

    pending(w) = sum over requests r routed to w at t_r > w.updated_at of
                 tokens(r) * exp(-(now - t_r) / prediction_tau_s)

Entries at or before the worker's stats timestamp are dropped: the stats
already include them.

Decision reasons are "<pd>/<cache>" with pd in {aggregated, disagg,
local_short_suffix, local_prefill_busy, local_no_prefill_pool} and cache in
{cache_hit, fallback, cold}: "fallback" means a better-cached eligible
worker existed but load (guard or scores) sent the request elsewhere.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from disagg.router.context import EffectiveLoad, RoutingContext
from disagg.router.decider import PDDecider
from disagg.router.filters.role import ALLOWED_ROLES
from disagg.router.index import PrefixIndex
from disagg.router.metrics import RouterMetrics
from disagg.router.profile import ProfileResult
from disagg.router.registry import build_profiles
from disagg.router.types import RouteDecision, RouteRequest, WorkerState


@dataclass(slots=True)
class RouterConfig:
    profiles: dict[str, Any] = field(default_factory=dict)  # overrides of DEFAULT_PROFILES
    plugins: dict[str, dict[str, Any]] = field(default_factory=dict)  # shared plugin params
    decider: dict[str, Any] = field(default_factory=dict)  # DeciderConfig fields
    common_fraction: float = 0.5  # share of workers that makes a block "common"
    common_min_workers: int = 2  # ... but never fewer workers than this
    prediction_tau_s: float = 5.0  # decay of in-flight predictions
    session_ttl_s: float = 120.0  # a session counts as active this long after its last turn
    queue_ewma_tau_s: float = 30.0  # smoothing of the queued-prefill average

    def __post_init__(self) -> None:
        if not 0.0 < self.common_fraction <= 1.0:
            raise ValueError("common_fraction must be in (0, 1]")
        if self.prediction_tau_s <= 0 or self.session_ttl_s <= 0:
            raise ValueError("time constants must be positive")

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
        self.config = config or RouterConfig()
        self.index = index or PrefixIndex()
        self.clock = clock
        self.profiles = build_profiles(self.config.profiles, self.config.plugins)
        self.decider = PDDecider(**self.config.decider)
        self.metrics = RouterMetrics()
        self._prefill_pending: dict[str, list[tuple[float, int]]] = {}  # worker -> (t, tokens)
        self._decode_pending: dict[str, list[tuple[float, int]]] = {}
        self._sessions: OrderedDict[str, tuple[str, str, float]] = OrderedDict()  # sid -> (worker, node, t)
        self._session_count: dict[str, int] = {}
        self._session_tok: dict[str, float] = {}
        self._ewma: dict[str, tuple[float, float, float]] = {}  # worker -> (avg, last q, t)
        self._inflight: dict[str, tuple[int, int]] = {}  # request id -> (predicted, prompt_len)

    # ---- effective state ---------------------------------------------------
    def _pending(self, book: dict[str, list[tuple[float, int]]], w: WorkerState, now: float) -> float:
        items = book.get(w.worker_id)
        if not items:
            return 0.0
        items[:] = [(t, n) for t, n in items if t > w.updated_at and now - t < 10 * self.config.prediction_tau_s]
        tau = self.config.prediction_tau_s
        return sum(n * math.exp(-(now - t) / tau) for t, n in items)

    def _expire_sessions(self, now: float) -> None:
        ttl = self.config.session_ttl_s
        while self._sessions:
            sid, (wid, _n, t, _) = next(iter(self._sessions.items()))
            if now - t <= ttl:
                break
            self._sessions.popitem(last=False)
            self._session_count[wid] -= 1
            self._session_tok[wid] -= _

    def effective_loads(self, workers: list[WorkerState], now: float) -> dict[str, EffectiveLoad]:
        self._expire_sessions(now)
        out = {}
        tau = self.config.queue_ewma_tau_s
        for w in workers:
            q = w.queued_prefill_tokens + self._pending(self._prefill_pending, w, now)
            avg, last, t = self._ewma.get(w.worker_id, (0.0, 0.0, now))
            avg += (1 - math.exp(-(now - t) / tau)) * (last - avg)
            self._ewma[w.worker_id] = (avg, q, now)
            out[w.worker_id] = EffectiveLoad(
                q,
                w.running_decode_tokens + self._pending(self._decode_pending, w, now),
                w.running_decode_requests,
                w.cache_utilization,
                self._session_count.get(w.worker_id, 0),
                self._session_tok.get(w.worker_id, 0),
                avg,
            )
        return out

    # ---- decision ------------------------------------------------------------
    def route(self, request: RouteRequest, workers: list[WorkerState]) -> RouteDecision:
        assert workers, "route() needs at least one worker"
        now = self.clock()
        for w in workers:
            self.index.add_worker(w.worker_id, w.node_id)
        ids = [w.worker_id for w in workers if w.healthy]
        cfg = self.config
        common_min = max(cfg.common_min_workers, math.floor(cfg.common_fraction * len(ids)) + 1)
        match = self.index.match(request, ids, common_min)
        prev = self._sessions.get(request.session_id) if request.session_id else None
        ctx = RoutingContext(
            request=request,
            match=match,
            loads=self.effective_loads(workers, now),
            session_worker=prev[0] if prev else None,
            session_node=prev[1] if prev else None,
            now=now,
        )
        if all(w.role == "both" for w in workers):
            res = self._run("both", ctx, workers)
            return self._decision(request, ctx, workers, res.picked or workers[0].worker_id, None, "aggregated", res, "both")
        dec = self._run("decode", ctx, workers)
        decode_id = dec.picked
        if decode_id is None:  # no healthy decode-capable worker: degrade to any healthy worker
            decode_id = ids[0] if ids else workers[0].worker_id
        suffix = request.prompt_len - ctx.prefix(decode_id).resumable_tokens
        pool = [w for w in workers if w.healthy and w.role in ALLOWED_ROLES["prefill"] and w.role != "both"]
        pd = self.decider.decide(suffix, [ctx.loads[w.worker_id].prefill_tokens for w in pool])
        if not pd.disaggregate:
            return self._decision(request, ctx, workers, decode_id, None, pd.reason, dec, "decode")
        pre = self._run("prefill", ctx, workers)
        if pre.picked is None:
            return self._decision(request, ctx, workers, decode_id, None, "local_no_prefill_pool", dec, "decode")
        return self._decision(request, ctx, workers, decode_id, pre.picked, pd.reason, pre, "prefill")

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
        m = ctx.prefix(target)
        roles = ALLOWED_ROLES[phase]
        eligible = [w.worker_id for w in workers if w.healthy and w.role in roles]
        best = max((ctx.prefix(w).resumable_tokens for w in eligible), default=0)
        cache = "cold" if best == 0 else "cache_hit" if m.resumable_tokens >= best else "fallback"
        return RouteDecision(
            request_id=request.request_id,
            decode_worker=decode_id,
            prefill_worker=prefill_id,
            reason=f"{pd_reason}/{cache}",
            predicted_cached_tokens=m.resumable_tokens,
            source_tier=m.tier,
            scores=dict(res.totals),
        )

    # ---- feedback --------------------------------------------------------------
    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        now = self.clock()
        uncached = max(request.prompt_len - decision.predicted_cached_tokens, 0)
        self._prefill_pending.setdefault(decision.prefill_target, []).append((now, uncached))
        self._decode_pending.setdefault(decision.decode_worker, []).append((now, request.prompt_len))
        if request.session_id:
            old = self._sessions.pop(request.session_id, None)
            if old is not None:
                self._session_count[old[0]] -= 1
                self._session_tok[old[0]] -= old[3]
            node = self.index.node_of(decision.decode_worker)
            wid = decision.decode_worker
            self._sessions[request.session_id] = (wid, node, now, request.prompt_len)
            self._session_count[wid] = self._session_count.get(wid, 0) + 1
            self._session_tok[wid] = self._session_tok.get(wid, 0) + request.prompt_len
        self._inflight[request.request_id] = (decision.predicted_cached_tokens, request.prompt_len)
        e = self._ewma.get(decision.prefill_target)
        if e is not None:
            self._ewma[decision.prefill_target] = (e[0], e[1] + uncached, e[2])
        self.metrics.record_decision(decision.reason, decision.source_tier)

    def on_finished(self, request_id: str, realized_cached_tokens: int) -> None:
        entry = self._inflight.pop(request_id, None)
        if entry is None:
            return
        predicted, prompt_len = entry
        self.metrics.record_finished(predicted, realized_cached_tokens, prompt_len)
