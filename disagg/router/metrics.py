"""Router counters: decisions by reason, predicted vs realized cache hits.

    prediction_ratio = realized_cached_tokens / predicted_cached_tokens
    overpredicted    = requests whose realized hit < predicted hit

A ratio well below 1 means the index lags the caches (events late or lost);
the router then routes to state that is gone. ``overridden`` counts requests
a serving layer ran elsewhere than routed (Ray Serve goes down the router's
ranks when its pick does not take a request): each resumes state the router
did not plan for, or recomputes it. ``pool_views`` counts a decode pool's
placements that read their prefill pool's view and those that found none
(``harm_pool_view``; ``deployments.request_router`` NOTE 2).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from disagg.messages import GenerateParams
    from kv_transfer.keys import BlockHasher


@dataclass(slots=True)
class RouterMetrics:
    decisions: Counter = field(default_factory=Counter)  # reason -> count
    tiers: Counter = field(default_factory=Counter)  # predicted source tier -> count
    num_decisions: int = 0  # routed requests
    num_finished: int = 0  # requests reported finished
    predicted_cached_tokens: int = 0  # sum over finished requests
    realized_cached_tokens: int = 0  # sum over finished requests
    overpredicted: int = 0  # finished requests with realized < predicted
    prompt_tokens: int = 0  # sum of prompt tokens of finished requests
    overridden: int = 0  # finished requests that ran on another worker than the one routed to
    pool_views: Counter = field(default_factory=Counter)  # decode-pool placements: "read" / "missing" the
    #                                                        prefill pool's view (deployments.request_router NOTE 2)

    def record_decision(self, reason: str, tier: str | None) -> None:
        self.num_decisions += 1
        self.decisions[reason] += 1
        self.tiers[tier or "none"] += 1

    def record_finished(self, predicted: int, realized: int, prompt_len: int, overridden: bool = False) -> None:
        self.num_finished += 1
        self.overridden += overridden
        self.predicted_cached_tokens += predicted
        self.realized_cached_tokens += realized
        self.prompt_tokens += prompt_len
        if realized < predicted:
            self.overpredicted += 1

    @property
    def prediction_ratio(self) -> float:
        if self.predicted_cached_tokens == 0:
            return 1.0
        return self.realized_cached_tokens / self.predicted_cached_tokens

    def snapshot(self) -> dict[str, object]:
        return {
            "decisions": dict(self.decisions),
            "tiers": dict(self.tiers),
            "num_decisions": self.num_decisions,
            "num_finished": self.num_finished,
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "realized_cached_tokens": self.realized_cached_tokens,
            "prediction_ratio": round(self.prediction_ratio, 4),
            "overpredicted": self.overpredicted,
            "overridden": self.overridden,
            "pool_views": dict(self.pool_views),
        }


# Policies alive in this process, by name (set by serving adapters), so the process can
# report finished requests to them and export their counters.
LIVE_POLICIES: dict[str, object] = {}


@dataclass(frozen=True, slots=True)
class PoolQuery:
    """What the decode side knows of one request when it asks for the prefill pool's view."""

    params: GenerateParams  # the request (its prompt and cache salt)
    hasher: BlockHasher | None = None  # the asker's key space for the prompt (salted), when it has digests
    hashes: list[bytes] | None = None  # the prompt's full-block digests under ``hasher`` (spares a hash)
    node_id: str | None = None  # the asker's node
    node_resumable: int = 0  # prompt tokens that node's shared tiers resume (its lookup): any replica there can

    def __repr__(self) -> str:
        return (f"PoolQuery(request_id={self.params.request_id!r}, digests={self.hashes is not None}, "
                f"node_id={self.node_id!r}, node_resumable={self.node_resumable})")


@dataclass(frozen=True, slots=True)
class PoolView:
    """The prefill pool as one request's P/D decision sees it (``disagg.flow`` NOTE 5).

    Row i is the pool's i-th healthy replica in both lists (the decider zips them).
    """

    loads: list[float]  # effective queued prefill tokens per replica
    uncached: list[float] | None  # prompt tokens each replica could not resume; None: unknown (no digests yet)

    def __post_init__(self) -> None:
        assert self.uncached is None or len(self.uncached) == len(self.loads), "uncached not aligned with loads"


# Per deployment name, the pool view of its replicas for one request (loads, and the request's
# uncached tokens per replica from that router's prefix index), as this process's router of that
# deployment sees them (set by the Serve adapter; read by the decode flow, disagg.flow NOTE 5).
POOL_VIEWS: dict[str, Callable[[PoolQuery], PoolView | None]] = {}

# Per deployment name, the ids of its replicas this process's router of it knows (set by the Serve
# adapter; read by the ingress, which tells each decode replica of a session's end, disagg.flow NOTE 14).
REPLICA_IDS: dict[str, Callable[[], list[str]]] = {}

# Per deployment name, the nodes its replicas report, as this process's router of it knows them (set by
# the Serve adapter; read by a decode replica, which reports its prefill pool's nodes to the decode
# deployment's router: the decode profile's hand-off cost, ``disagg.router.scorers.decode``).
REPLICA_NODES: dict[str, Callable[[], list[str]]] = {}

# Per deployment name, this process's policy of that deployment's router (set by the Serve adapter; read
# by a decode replica, which tells its prefill pool's router each remote prefill's end: the prefill replica
# called is not in the ingress, where requests' ends are reported, disagg.router.loads NOTE 6).
POOL_POLICIES: dict[str, object] = {}
