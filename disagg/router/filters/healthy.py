"""Healthy filter: drop workers that fail health checks.

    keep w  iff  w.healthy

Config example (YAML)::

    filters: [healthy]
"""

from __future__ import annotations

from disagg.router.context import RoutingContext
from disagg.router.types import WorkerState


class HealthyFilter:
    name = "healthy"

    def __init__(self, **params: object):
        if params:
            raise ValueError(f"healthy filter takes no parameters, got {sorted(params)}")

    def filter(self, ctx: RoutingContext, workers: list[WorkerState]) -> list[WorkerState]:
        kept = [w for w in workers if w.healthy]
        return workers if len(kept) == len(workers) else kept
