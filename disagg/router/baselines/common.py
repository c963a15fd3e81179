"""Shared plumbing of the baseline routers (pool split, decision record).

Baselines place one request on one worker. On an aggregated pool (every role
"both") that worker prefills and decodes; with P/D pools they always
disaggregate: the policy picks the prefill worker from the prefill pool and
the decode worker from the decode pool (no conditional disaggregation).
"""

from __future__ import annotations

from disagg.router.types import RouteDecision, RouteRequest, WorkerState


def pools(workers: list[WorkerState]) -> tuple[list[WorkerState], list[WorkerState]]:
    """(prefill pool, decode pool); equal for an aggregated cluster. Unhealthy ones dropped
    unless none is healthy."""
    healthy = [w for w in workers if w.healthy] or list(workers)
    if all(w.role == "both" for w in healthy):
        return healthy, healthy
    pre = [w for w in healthy if w.role in ("prefill", "both")] or healthy
    dec = [w for w in healthy if w.role in ("decode", "both")] or healthy
    return pre, dec


def is_aggregated(workers: list[WorkerState]) -> bool:
    return all(w.role == "both" for w in workers if w.healthy)


def decision(
    request: RouteRequest,
    prefill_id: str,
    decode_id: str,
    aggregated: bool,
    reason: str,
    predicted: int = 0,
    scores: dict[str, float] | None = None,
) -> RouteDecision:
    return RouteDecision(
        request_id=request.request_id,
        decode_worker=decode_id,
        prefill_worker=None if aggregated else prefill_id,
        reason=reason,
        predicted_cached_tokens=predicted,
        source_tier="device" if predicted else None,
        scores=scores or {},
    )


class NoFeedback:
    """Mixin for baselines that ignore dispatch and completion reports."""

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        return None

    def on_finished(self, request_id: str, realized_cached_tokens: int | None,
                    output_tokens: int | None = None, served: tuple[float, float] | None = None,
                    worker: str | None = None) -> None:
        return None
