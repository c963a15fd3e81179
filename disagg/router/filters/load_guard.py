"""Load guard: exclude overloaded workers before scoring (anti-pinning).

Two guards, relative to the candidates:

    prefill:     drop w if  q_w > prefill_ratio * mean(q) + prefill_slack_tokens
    first turn:  only for a session's first turn (moving a live session costs its
                 cache, so placed sessions are judged by the prefill guard), one of
      "area"     (default) keep w only if placing the prompt there leaves the largest
                 booked prefill area where the best placement would:
                     post_w = A_w + n_w (n_w / 2 + q_w)       n_w = prompt - resumable(w)
                     keep w if post_w <= max(max_v A_v, min_v post_v)
                 and, when every worker it keeps is busy, the idle workers (nothing
                 queued, no decodes running or on their way) where it raises the
                 area least, by the same rule over the idle workers alone
      "sessions" drop w if  s_w > session_ratio * mean(s) + session_slack
      "none"

q is the effective queued prefill (live + in-flight predictions), s the
active sessions placed on the worker, A the prefill area booked on it
(``disagg.router.loads``: every routed request books ``n (n / 2 + q)``, the
token-seconds times the prefill rate that its n uncached tokens add to the
worker's queue, waiting behind q and then draining). ``n_w (n_w / 2 + q_w)``
is the work the new session brings to w, cache included: a worker that holds
the shared prompt books less. A small first turn fits under the current
maximum almost anywhere (the scorers choose); a large one goes where it
raises the maximum least. The guard never empties the list: if every worker
would be dropped, the least loaded one stays. With a hot shared prompt either
first-turn guard stops one worker from collecting every new session: the
sessions' areas add up on it (area), or it holds more than its share of
sessions (sessions); then new sessions go to the next-best (cached) worker.

The booked area is a long-run balance (it does not decay by default), so at
light load it can keep only workers that are busy *now*: on a Mooncake-format
trace at 16 workers, a first turn went to a worker decoding another session,
whose decode its 7K-token prefill stalled by 0.3 s, while four node mates
holding the same system prompt sat idle with more area booked. The guard never
forces that choice: when it keeps no idle worker, it also keeps the idle ones
it would keep if they were the only candidates, and the scorers (decode time,
cache) choose (docs/router.md, "Round 27").

Config example (YAML)::

    load_guard: {prefill_ratio: 1.25, prefill_slack_tokens: 8192, first_turn_guard: area,
                 session_ratio: 1.1, session_slack: 1}
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from disagg.router.context import LOAD_ROW, RoutingContext
from disagg.router.types import WorkerState

_B = LOAD_ROW["decode_requests"]
_N = LOAD_ROW["prefill_requests"]
_IN = LOAD_ROW["inbound_decodes"]


@dataclass(slots=True)
class LoadGuardConfig:
    prefill_ratio: float = 1.25  # allowed multiple of the mean queued prefill
    prefill_slack_tokens: float = 8192.0  # absolute slack (idle clusters)
    first_turn_guard: str = "area"  # a session's first turn: "area", "sessions" or "none"
    session_ratio: float = 1.1  # "sessions": allowed multiple of the mean active sessions
    session_slack: float = 1.0  # "sessions": absolute slack in sessions

    def __post_init__(self) -> None:
        if self.prefill_ratio < 1.0 or self.session_ratio < 1.0:
            raise ValueError("guard ratios must be >= 1")
        if self.prefill_slack_tokens < 0 or self.session_slack < 0:
            raise ValueError("guard slack must be >= 0")
        if self.first_turn_guard not in ("area", "sessions", "none"):
            raise ValueError("first_turn_guard must be 'area', 'sessions' or 'none'")


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
        guard = cfg.first_turn_guard
        # a new session: also the first-turn guard
        if ctx.session_worker is None and guard != "none":
            if guard == "area":
                if np.logical_or.reduce(ok):
                    nu = np.maximum(ctx.request.prompt_len - v.resumable, 0.0)
                    booked = v.booked_area
                    post = booked + nu * (0.5 * nu + q)  # booked area after placing it there
                    most = float(np.maximum.reduce(booked))

                    def under_top(among: np.ndarray) -> np.ndarray:  # the area rule over ``among``
                        return among & (post <= max(most, float(np.minimum.reduce(post[among]))))

                    kept = under_top(ok)
                    ld = v.loads
                    idle = ok & (q <= 0) & (ld[_B] + ld[_N] + ld[_IN] <= 0)
                    if np.logical_or.reduce(idle) and not np.logical_or.reduce(kept & idle):
                        kept |= under_top(idle)
                    ok = kept
            else:
                s = v.sessions
                ok &= s <= cfg.session_ratio * float(np.add.reduce(s)) / n + cfg.session_slack
        num_kept = np.count_nonzero(ok)
        if num_kept == n:
            return workers
        if num_kept:
            return ctx.subset(workers, v, ok)
        least = min(range(len(workers)), key=lambda i: (q[i], workers[i].worker_id))
        return [workers[least]]
