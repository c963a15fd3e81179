"""Wait scorer: prefer workers that can start this prefill soon, relative to its length.

    wait_w = q_w / prefill_tokens_per_s              queued prefill ahead of the request
    own    = max((prompt_len - max_v c_v) / prefill_tokens_per_s, floor_s)
    score_w = own / (own + wait_w)                   in (0, 1]; 1 for an idle worker

q is the effective queued prefill (live + in-flight predictions), c_v the
resumable tokens of candidate v. ``own`` is the request's own compute at its
best-cached candidate, so a wait counts in proportion to the request: a short
follow-up turn behind a long first-turn prefill scores low (it would wait many
times its own compute), a long prompt barely notices the same queue. The
scorer ignores where the cache is (the prefix scorer's job), so, next to it,
a session's turn stays on its worker until that worker's queue costs more
than reading the state from a node mate's shared host tier.

Config example (YAML)::

    wait: {prefill_tokens_per_s: 25000, floor_s: 0.02}
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from disagg.router.context import RoutingContext
from disagg.router.scorers.base import ArrayScorer
from disagg.router.types import WorkerState


@dataclass(slots=True)
class WaitScorerConfig:
    prefill_tokens_per_s: float = 25000.0  # prefill rate of one worker
    floor_s: float = 0.02  # smallest "own" time (one short prefill step)

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.floor_s <= 0:
            raise ValueError("prefill_tokens_per_s and floor_s must be positive")


class WaitScorer(ArrayScorer):
    name = "wait"

    def __init__(self, config: WaitScorerConfig | None = None, **params: object):
        self.config = config or WaitScorerConfig(**params)  # type: ignore[arg-type]

    def score_array(self, ctx: RoutingContext, workers: list[WorkerState]) -> np.ndarray:
        rate = self.config.prefill_tokens_per_s
        v = ctx.view(workers)
        own = max((ctx.request.prompt_len - float(np.maximum.reduce(v.resumable))) / rate, self.config.floor_s)
        return own / (own + v.prefill / rate)
