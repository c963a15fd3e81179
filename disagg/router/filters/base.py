"""Interface of a filter (plugins implement it; this module imports none)."""

from __future__ import annotations

from typing import Protocol

from disagg.router.context import RoutingContext
from disagg.router.types import WorkerState


class BaseFilter(Protocol):
    name: str  # registry name

    def filter(self, ctx: RoutingContext, workers: list[WorkerState]) -> list[WorkerState]:
        """The workers that stay candidates, in their input order.

        A filter that keeps every worker may return ``workers`` itself (the runner
        never mutates the list; candidate views are then found by identity).
        """
