"""Round robin: worker i of the pool for the i-th request (per pool).

    pick = pool[counter % len(pool)]; counter += 1
"""

from __future__ import annotations

from disagg.router.baselines.common import NoFeedback, decision, is_aggregated, pools
from disagg.router.types import RouteDecision, RouteRequest, WorkerState


class RoundRobinRouter(NoFeedback):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = {"prefill": 0, "decode": 0}

    def _take(self, pool: str, workers: list[WorkerState]) -> str:
        i = self._next[pool] % len(workers)
        self._next[pool] += 1
        return workers[i].worker_id

    def route(self, request: RouteRequest, workers: list[WorkerState]) -> RouteDecision:
        pre, dec = pools(workers)
        agg = is_aggregated(workers)
        if agg:
            wid = self._take("decode", dec)
            return decision(request, wid, wid, True, "round_robin")
        return decision(request, self._take("prefill", pre), self._take("decode", dec), False, "round_robin")
