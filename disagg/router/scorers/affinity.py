"""Session-affinity scorer: keep a session's turns where its state was left.

    score_w = 1.0            if w ran the session's previous turn
            = node_score     if w shares that worker's node (host-tier reach)
            = 0.0            otherwise (or for a session's first turn)

It is a tie-breaker next to the prefix scorer (which sees what is actually
cached); affinity also covers the window between routing a turn and the
store events that report its state.

Config example (YAML)::

    affinity: {node_score: 0.5}
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from disagg.router.context import RoutingContext
from disagg.router.scorers.base import ArrayScorer
from disagg.router.types import WorkerState


@dataclass(slots=True)
class AffinityScorerConfig:
    node_score: float = 0.5  # score for another worker of the same node

    def __post_init__(self) -> None:
        if not 0.0 <= self.node_score <= 1.0:
            raise ValueError("node_score must be in [0, 1]")


class AffinityScorer(ArrayScorer):
    name = "affinity"

    def __init__(self, config: AffinityScorerConfig | None = None, **params: object):
        self.config = config or AffinityScorerConfig(**params)  # type: ignore[arg-type]

    def score_array(self, ctx: RoutingContext, workers: list[WorkerState]) -> np.ndarray:
        sw, sn = ctx.session_worker, ctx.session_node
        if sw is None:
            return np.zeros(len(workers))
        mate = self.config.node_score if sn is not None else 0.0
        return np.array([1.0 if w.worker_id == sw else mate if w.node_id == sn else 0.0 for w in workers])
