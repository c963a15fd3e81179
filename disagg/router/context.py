"""The per-decision view every filter and scorer reads.

A ``RoutingContext`` is built once per request by the router: the prefix-index
walk (one walk for all workers), the effective load of each worker (live
stats plus the router's own in-flight predictions), the session's previous
placement, and which phase is being placed.

    effective_prefill(w) = queued_prefill_tokens(w)
                         + sum_{routed r to w after w.updated_at} uncached(r) * exp(-(now - t_r) / tau)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.router.index import MatchResult, PrefixMatch
from disagg.router.types import RouteRequest, WorkerState

PHASES = ("prefill", "decode", "both")


@dataclass(slots=True)
class EffectiveLoad:
    """Load the policy acts on: live stats plus not-yet-reported predictions."""

    prefill_tokens: float = 0.0  # queued prefill tokens
    decode_tokens: float = 0.0  # context tokens of running decodes
    decode_requests: float = 0.0  # running decode requests
    cache_utilization: float = 0.0  # device cache fill, 0..1
    active_sessions: float = 0.0  # sessions whose last turn ran here within the TTL
    session_tokens: float = 0.0  # context tokens of those sessions
    queue_ewma: float = 0.0  # time-smoothed prefill_tokens


@dataclass(slots=True)
class RoutingContext:
    """Everything a plugin may read for one placement."""

    request: RouteRequest  # the request being placed
    match: MatchResult  # prefix-index walk over all known candidates
    loads: dict[str, EffectiveLoad]  # per worker
    phase: str = "both"  # "prefill" | "decode" | "both"
    session_worker: str | None = None  # worker of the session's previous turn
    session_node: str | None = None  # node of that worker
    now: float = 0.0  # router clock
    extra: dict[str, object] = field(default_factory=dict)  # plugin scratch space

    def __post_init__(self) -> None:
        assert self.phase in PHASES, f"unknown phase {self.phase!r}"

    def prefix(self, worker_id: str) -> PrefixMatch:
        return self.match.matches.get(worker_id) or PrefixMatch()

    def common_tokens(self) -> int:
        """Tokens of the leading blocks most candidates hold (hot shared prefix)."""
        r = self.request
        return min(self.match.common_blocks * r.block_size, r.prompt_len)

    def load(self, w: WorkerState) -> EffectiveLoad:
        return self.loads.get(w.worker_id) or EffectiveLoad(
            w.queued_prefill_tokens, w.running_decode_tokens, w.running_decode_requests, w.cache_utilization, 0.0
        )
