"""Scheduling profile: filters -> weighted scorers -> picker.

    candidates = f_k(... f_1(workers))
    total_w    = sum_j weight_j * s_j(w) / sum_j weight_j       s_j(w) in [0, 1]
    ranked     = picker(total)

The runner checks every scorer's output range and that filters return a
subset; plugins are built from config by ``disagg.router.registry`` (the one
table that names them), never imported here.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from operator import attrgetter

import numpy as np

from disagg.router.context import RoutingContext
from disagg.router.filters.base import BaseFilter
from disagg.router.picker import MaxScorePicker
from disagg.router.scorers.base import BaseScorer
from disagg.router.types import WorkerState

_ID = attrgetter("worker_id")


class ProfileResult:
    """Outcome of one profile run.

    ``ranked`` and ``filtered_out`` may be given as lists or as functions that
    build them: the runner passes functions (and ``picked``) when the picker is
    deterministic, since a decision reads only ``picked`` and ``totals``; the
    lists are built on first access and are the same either way.
    """

    __slots__ = ("totals", "per_scorer", "_ranked", "_filtered_out", "_picked")

    def __init__(
        self,
        ranked: list[str] | Callable[[], list[str]],
        totals: dict[str, float],
        per_scorer: dict[str, np.ndarray] | None = None,
        filtered_out: list[str] | Callable[[], list[str]] | None = None,
        picked: str | None = None,
    ):
        self.totals = totals  # weighted total per candidate
        self.per_scorer = per_scorer if per_scorer is not None else {}  # scorer -> [0, 1] per candidate
        self._ranked = ranked  # candidates best first (ranked[0] is the pick), or its builder
        self._filtered_out = filtered_out if filtered_out is not None else []  # dropped by filters, or its builder
        self._picked = picked  # ranked[0], when known without the ranking

    @property
    def ranked(self) -> list[str]:
        if callable(self._ranked):
            self._ranked = self._ranked()
        return self._ranked

    @property
    def filtered_out(self) -> list[str]:
        if callable(self._filtered_out):
            self._filtered_out = self._filtered_out()
        return self._filtered_out

    @property
    def picked(self) -> str | None:
        if self._picked is not None:
            return self._picked
        ranked = self.ranked
        return ranked[0] if ranked else None


def _removed(workers: list[WorkerState], kept: list[WorkerState]) -> Callable[[], list[str]]:
    def build() -> list[str]:
        kept_ids = set(map(_ID, kept))
        return [wid for wid in map(_ID, workers) if wid not in kept_ids]

    return build


class SchedulingProfile:
    def __init__(
        self,
        name: str,
        filters: list[BaseFilter],
        scorers: list[tuple[BaseScorer, float]],
        picker: MaxScorePicker | None = None,
    ):
        if any(w < 0 for _, w in scorers):
            raise ValueError("scorer weights must be >= 0")
        self.name = name
        self.filters = filters
        self.scorers = scorers
        self.picker = picker or MaxScorePicker()

    @property
    def scorers(self) -> list[tuple[BaseScorer, float]]:
        return self._scorers

    @scorers.setter
    def scorers(self, scorers: list[tuple[BaseScorer, float]]) -> None:
        """Also resolves, once, each scorer's normalized weight and its array method (None: dict only)."""
        self._scorers = scorers
        weight_sum = sum(w for _, w in scorers) or 1.0
        self._plan = [(s.name, weight / weight_sum, getattr(s, "score_array", None), s) for s, weight in scorers]

    def run(self, ctx: RoutingContext, workers: list[WorkerState]) -> ProfileResult:
        cands = workers
        for f in self.filters:
            kept = f.filter(ctx, cands)
            assert len(kept) <= len(cands), f"filter {f.name} invented candidates"
            cands = kept
        removed = _removed(workers, cands) if len(cands) < len(workers) else None
        if not cands:
            return ProfileResult([], {}, {}, removed)
        ids = ctx.worker_ids(cands)
        n = len(ids)
        totals = None
        per: dict[str, np.ndarray] = {}
        checked: list[np.ndarray] = []  # every scorer's values, for the range check
        for name, weight, fast, scorer in self._plan:
            if fast is not None:
                vals = fast(ctx, cands)
                assert vals.shape == (n,), f"scorer {name} returned shape {vals.shape} for {n} workers"
            else:
                s = scorer.score(ctx, cands)
                vals = np.fromiter(map(s.get, ids, repeat(0.0)), np.float64, n)
            totals = weight * vals if totals is None else totals + weight * vals
            per[name] = vals
            checked.append(vals)
        if checked:  # the range check, once over every scorer's values
            every = np.concatenate(checked)
            if not (np.minimum.reduce(every) >= 0.0 and np.maximum.reduce(every) <= 1.0):
                name, vals = next((p[0], v) for p, v in zip(self._plan, checked, strict=True)
                                  if not (v.min() >= 0.0 and v.max() <= 1.0))
                bad = next(i for i, v in enumerate(vals.tolist()) if not 0.0 <= v <= 1.0)
                raise AssertionError(f"scorer {name} returned {vals[bad]} for {ids[bad]}")
        if totals is None:
            totals = np.zeros(n)
        total = dict(zip(ids, totals.tolist(), strict=True))
        picker = self.picker
        if isinstance(picker, MaxScorePicker) and picker.epsilon == 0:  # deterministic: rank on demand
            def ranked() -> list[str]:
                return picker.rank_array(totals, ids)

            return ProfileResult(ranked, total, per, removed, picked=ids[int(np.argmax(totals))])  # first max
        rank_array = getattr(picker, "rank_array", None)
        ranked_now = rank_array(totals, ids) if rank_array is not None else picker.pick(total, ids)
        return ProfileResult(ranked_now, total, per, removed)
