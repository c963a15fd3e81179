"""TTFT scorer: prefer the worker expected to produce the first token soonest.

(prototype)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.router.context import RoutingContext
from disagg.router.types import WorkerState


def _bw() -> dict[str, float]:
    return {"host": 50.0, "disk": 5.0, "remote": 20.0}


def _lat() -> dict[str, float]:
    return {"host": 50e-6, "disk": 500e-6, "remote": 1e-3}


@dataclass(slots=True)
class TTFTScorerConfig:
    prefill_tokens_per_s: float = 25000.0
    bandwidth_gbps: dict[str, float] = field(default_factory=_bw)
    latency_s: dict[str, float] = field(default_factory=_lat)
    bytes_per_token: float = 4608.0
    checkpoint_bytes: float = 16e6
    floor_s: float = 0.05


class TTFTScorer:
    name = "ttft"

    def __init__(self, config: TTFTScorerConfig | None = None, **params: object):
        self.config = config or TTFTScorerConfig(**params)  # type: ignore[arg-type]

    def estimate(self, ctx: RoutingContext, w: WorkerState) -> float:
        cfg = self.config
        m = ctx.prefix(w.worker_id)
        q = ctx.load(w).prefill_tokens
        c = m.resumable_tokens
        t = (q + ctx.request.prompt_len - c) / cfg.prefill_tokens_per_s
        if c and m.tier != "device":
            t += (c * cfg.bytes_per_token + cfg.checkpoint_bytes) / (cfg.bandwidth_gbps[m.tier] * 1e9) + cfg.latency_s[m.tier]
        return t

    def score(self, ctx: RoutingContext, workers: list[WorkerState]) -> dict[str, float]:
        est = {w.worker_id: self.estimate(ctx, w) for w in workers}
        lo = min(est.values()) + self.config.floor_s
        return {k: lo / (v + self.config.floor_s) for k, v in est.items()}
