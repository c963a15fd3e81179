"""Load guard: exclude overloaded workers before scoring (anti-pinning).

Two guards, both relative to the candidates' mean:

    prefill:   drop w if  q_w > prefill_ratio * mean(q) + prefill_slack_tokens
    sessions:  drop w if  s_w > session_ratio * mean(s) + session_slack
               (only for a session's first turn: moving a live session costs
               its cache, so placed sessions are judged by the prefill guard)

q is the effective queued prefill (live + in-flight predictions), s the
active sessions placed on the worker. The guard never empties the list: if
every worker would be dropped, the least loaded one stays. With a hot shared
prompt this is what stops one worker from collecting every new session: once
it holds more than its share, new sessions go to the next-best (cached)
worker instead.

Config example (YAML)::

    load_guard: {prefill_ratio: 1.25, prefill_slack_tokens: 8192,
                 session_ratio: 1.1, session_slack: 1}
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from disagg.router.context import RoutingContext
from disagg.router.types import WorkerState


@dataclass(slots=True)
class LoadGuardConfig:
    prefill_ratio: float = 1.25  # allowed multiple of the mean queued prefill
    prefill_slack_tokens: float = 8192.0  # absolute slack (idle clusters)
    session_ratio: float = 1.1  # allowed multiple of the mean active sessions
    session_slack: float = 1.0  # absolute slack in sessions

    def __post_init__(self) -> None:
        if self.prefill_ratio < 1.0 or self.session_ratio < 1.0:
            raise ValueError("guard ratios must be >= 1")
        if self.prefill_slack_tokens < 0 or self.session_slack < 0:
            raise ValueError("guard slack must be >= 0")


class LoadGuardFilter:
    name = "load_guard"

    def __init__(self, config: LoadGuardConfig | None = None, **params: object):
        self.config = config or LoadGuardConfig(**params)  # type: ignore[arg-type]

    def filter(self, ctx: RoutingContext, workers: list[WorkerState]) -> list[WorkerState]:
        if len(workers) <= 1:
            return workers
        cfg = self.config
        v = ctx.view(workers)
        n = len(workers)
        q = v.prefill
        ok = q <= cfg.prefill_ratio * float(np.add.reduce(q)) / n + cfg.prefill_slack_tokens
        if ctx.session_worker is None:  # a new session: also the session guard
            s = v.sessions
            ok &= s <= cfg.session_ratio * float(np.add.reduce(s)) / n + cfg.session_slack
        num_kept = np.count_nonzero(ok)
        if num_kept == n:
            return workers
        if num_kept:
            return ctx.subset(workers, v, ok)
        least = min(range(len(workers)), key=lambda i: (q[i], workers[i].worker_id))
        return [workers[least]]
