"""Load scorer: prefer workers with less queued prefill, decode and cache fill.

    q_n = q_w / max(max_v q_v, q_floor)          queued prefill tokens (effective)
    d_n = d_w / max(max_v d_v, d_floor)          running decode context tokens
    s_n = s_w / max(max_v s_v, s_floor)          active sessions placed here
    score_w = 1 - (a * q_n + b * d_n + c * util_w + e * s_n) / (a + b + c + e)   in [0, 1]

The floors keep tiny absolute differences (a few hundred tokens) from
looking like a 100% imbalance when the cluster is idle. The loads are the
router's *effective* loads: live stats plus its own in-flight predictions
(see ``RoutingContext``), so the scorer reacts to a burst before the next
stats report.

Config example (YAML)::

    load: {prefill_weight: 1.0, decode_weight: 0.5, cache_weight: 0.2, session_weight: 0.5,
           prefill_floor_tokens: 16384, decode_floor_tokens: 262144, session_floor: 4}
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.router.context import RoutingContext
from disagg.router.types import WorkerState


@dataclass(slots=True)
class LoadScorerConfig:
    prefill_weight: float = 1.0  # a: queued prefill tokens
    decode_weight: float = 0.5  # b: running decode tokens
    cache_weight: float = 0.2  # c: device cache utilization
    session_weight: float = 0.5  # e: active sessions
    prefill_floor_tokens: float = 16384.0  # q_floor
    decode_floor_tokens: float = 262144.0  # d_floor
    session_floor: float = 4.0  # s_floor
    session_tokens_weight: float = 0.0
    session_tokens_floor: float = 65536.0
    ewma_weight: float = 0.0
    ewma_floor: float = 1024.0

    def __post_init__(self) -> None:
        ws = (self.prefill_weight, self.decode_weight, self.cache_weight, self.session_weight, self.session_tokens_weight, self.ewma_weight)
        if min(ws) < 0 or sum(ws) <= 0:
            raise ValueError("load weights must be >= 0 and not all zero")
        if min(self.prefill_floor_tokens, self.decode_floor_tokens, self.session_floor) <= 0:
            raise ValueError("load floors must be positive")


class LoadScorer:
    name = "load"

    def __init__(self, config: LoadScorerConfig | None = None, **params: object):
        self.config = config or LoadScorerConfig(**params)  # type: ignore[arg-type]

    def score(self, ctx: RoutingContext, workers: list[WorkerState]) -> dict[str, float]:
        cfg = self.config
        loads = {w.worker_id: ctx.load(w) for w in workers}
        q_max = max([cfg.prefill_floor_tokens] + [x.prefill_tokens for x in loads.values()])
        d_max = max([cfg.decode_floor_tokens] + [x.decode_tokens for x in loads.values()])
        s_max = max([cfg.session_floor] + [x.active_sessions for x in loads.values()])
        t_max = max([cfg.session_tokens_floor] + [x.session_tokens for x in loads.values()])
        e_max = max([cfg.ewma_floor] + [x.queue_ewma for x in loads.values()])
        total = cfg.prefill_weight + cfg.decode_weight + cfg.cache_weight + cfg.session_weight + cfg.session_tokens_weight + cfg.ewma_weight
        out: dict[str, float] = {}
        for wid, x in loads.items():
            pressure = (
                cfg.prefill_weight * x.prefill_tokens / q_max
                + cfg.decode_weight * x.decode_tokens / d_max
                + cfg.cache_weight * min(max(x.cache_utilization, 0.0), 1.0)
                + cfg.session_weight * x.active_sessions / s_max
                + cfg.session_tokens_weight * x.session_tokens / t_max
                + cfg.ewma_weight * x.queue_ewma / e_max
            ) / total
            out[wid] = min(max(1.0 - pressure, 0.0), 1.0)
        return out
