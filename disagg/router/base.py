"""What every router (ours and the baselines) offers its callers.

The Serve adapter and the simulator only use this surface:

    decision = router.route(request, workers)     pure decision, no side effects
    router.on_routed(request, decision)           the request was dispatched
    router.on_finished(request_id, cached, out)   realized cached tokens (None: the request ended
                                                  without a result, abandoned or failed: its
                                                  bookkeeping goes, nothing is recorded) and the
                                                  output tokens it generated (None: not counted)
"""

from __future__ import annotations

from typing import Protocol

from disagg.router.types import RouteDecision, RouteRequest, WorkerState


class BaseRouter(Protocol):
    name: str  # short policy name for tables

    def route(self, request: RouteRequest, workers: list[WorkerState]) -> RouteDecision: ...

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None: ...

    def on_finished(self, request_id: str, realized_cached_tokens: int | None,
                    output_tokens: int | None = None, served: tuple[float, float] | None = None,
                    worker: str | None = None) -> None: ...
