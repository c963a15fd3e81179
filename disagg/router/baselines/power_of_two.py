"""Power of two choices on queue length.

    a, b = two distinct workers drawn uniformly (seeded)
    pick = argmin(queue_length) over {a, b}; ties -> a

queue_length = queued prefill requests + running decode requests + inbound
decode requests (what Ray Serve's default router compares: the requests a
replica holds, a P/D decode replica's included while their prefill runs).
"""

from __future__ import annotations

import random

from disagg.router.baselines.common import NoFeedback, decision, is_aggregated, pools
from disagg.router.types import RouteDecision, RouteRequest, WorkerState


def pow2_pick(rng: random.Random, workers: list[WorkerState]) -> WorkerState:
    if len(workers) == 1:
        return workers[0]
    a, b = rng.sample(range(len(workers)), 2)
    wa, wb = workers[a], workers[b]
    return wb if wb.queue_length < wa.queue_length else wa


class PowerOfTwoRouter(NoFeedback):
    name = "power_of_two"

    def __init__(self, seed: int = 0):
        self._rng = random.Random(seed)

    def route(self, request: RouteRequest, workers: list[WorkerState]) -> RouteDecision:
        pre, dec = pools(workers)
        if is_aggregated(workers):
            wid = pow2_pick(self._rng, dec).worker_id
            return decision(request, wid, wid, True, "power_of_two")
        p = pow2_pick(self._rng, pre).worker_id
        d = pow2_pick(self._rng, dec).worker_id
        return decision(request, p, d, False, "power_of_two")
