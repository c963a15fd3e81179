"""Interface of a scorer (plugins implement it; this module imports none)."""

from __future__ import annotations

from typing import Protocol

from disagg.router.context import RoutingContext
from disagg.router.types import WorkerState


class BaseScorer(Protocol):
    name: str  # registry name

    def score(self, ctx: RoutingContext, workers: list[WorkerState]) -> dict[str, float]:
        """A value in [0, 1] per worker (higher is better)."""
