"""Wait scorer (prototype)."""

from __future__ import annotations

from dataclasses import dataclass

from disagg.router.context import RoutingContext
from disagg.router.types import WorkerState


@dataclass(slots=True)
class WaitScorerConfig:
    prefill_tokens_per_s: float = 25000.0
    floor_s: float = 0.02


class WaitScorer:
    name = "wait"

    def __init__(self, config: WaitScorerConfig | None = None, **params: object):
        self.config = config or WaitScorerConfig(**params)  # type: ignore[arg-type]

    def score(self, ctx: RoutingContext, workers: list[WorkerState]) -> dict[str, float]:
        cfg = self.config
        best = max((ctx.prefix(w.worker_id).resumable_tokens for w in workers), default=0)
        t0 = max((ctx.request.prompt_len - best) / cfg.prefill_tokens_per_s, cfg.floor_s)
        return {w.worker_id: t0 / (t0 + ctx.load(w).prefill_tokens / cfg.prefill_tokens_per_s) for w in workers}
