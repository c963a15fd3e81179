"""Placement policy: prefix index, filters -> weighted scorers -> picker, P/D decider.

Pure Python over plain data: the Serve adapter, the simulator and the
benchmarks run the same code.
"""

from disagg.router.index import MatchResult, PrefixIndex, PrefixMatch, update_from_event
from disagg.router.router import RouterConfig, StateAwareRouter
from disagg.router.types import RouteDecision, RouteRequest, TailProbe, WorkerState

__all__ = [
    "MatchResult",
    "PrefixIndex",
    "PrefixMatch",
    "RouteDecision",
    "RouteRequest",
    "RouterConfig",
    "StateAwareRouter",
    "TailProbe",
    "WorkerState",
    "update_from_event",
]
