"""Interface of a scorer (plugins implement it; this module imports none).

``score`` is the contract: ``{worker_id: float in [0, 1]}``. A scorer that
computes over all candidates at once (numpy over ``ctx.view(workers)``) may
also offer ``score_array`` returning the same values as an array aligned with
``workers``; the profile runner then uses it and skips the dict round trip.
The runner checks the range either way.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from disagg.router.context import RoutingContext
from disagg.router.types import WorkerState


class BaseScorer(Protocol):
    name: str  # registry name

    def score(self, ctx: RoutingContext, workers: list[WorkerState]) -> dict[str, float]:
        """A value in [0, 1] per worker (higher is better)."""


class ArrayScorer:
    """Mixin for vectorized scorers: implement ``score_array``, get ``score``."""

    def score_array(self, ctx: RoutingContext, workers: list[WorkerState]) -> np.ndarray:
        raise NotImplementedError

    def score(self, ctx: RoutingContext, workers: list[WorkerState]) -> dict[str, float]:
        if not workers:
            return {}
        return dict(zip([w.worker_id for w in workers], self.score_array(ctx, workers).tolist(), strict=True))
