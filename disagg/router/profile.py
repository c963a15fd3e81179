"""Scheduling profile: filters -> weighted scorers -> picker.

    candidates = f_k(... f_1(workers))
    total_w    = sum_j weight_j * s_j(w) / sum_j weight_j       s_j(w) in [0, 1]
    ranked     = picker(total)

The runner checks every scorer's output range and that filters return a
subset; plugins are built from config by ``disagg.router.registry`` (the one
table that names them), never imported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from disagg.router.context import RoutingContext
from disagg.router.filters.base import BaseFilter
from disagg.router.picker import MaxScorePicker
from disagg.router.scorers.base import BaseScorer
from disagg.router.types import WorkerState


@dataclass(slots=True)
class ProfileResult:
    """Outcome of one profile run."""

    ranked: list[str]  # candidates best first (ranked[0] is the pick)
    totals: dict[str, float]  # weighted total per candidate
    per_scorer: dict[str, np.ndarray] = field(default_factory=dict)  # scorer -> [0, 1] per ranked-input candidate
    filtered_out: list[str] = field(default_factory=list)  # dropped by filters

    @property
    def picked(self) -> str | None:
        return self.ranked[0] if self.ranked else None


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

    def run(self, ctx: RoutingContext, workers: list[WorkerState]) -> ProfileResult:
        cands = list(workers)
        for f in self.filters:
            kept = f.filter(ctx, cands)
            assert len(kept) <= len(cands), f"filter {f.name} invented candidates"
            cands = kept
        if len(cands) < len(workers):
            kept_ids = {c.worker_id for c in cands}
            removed = [w.worker_id for w in workers if w.worker_id not in kept_ids]
        else:
            removed = []
        if not cands:
            return ProfileResult([], {}, {}, removed)
        ids = [w.worker_id for w in cands]
        n = len(ids)
        totals = np.zeros(n)
        per: dict[str, np.ndarray] = {}
        checked: list[tuple[str, np.ndarray]] = []  # (scorer, values) for the range check
        weight_sum = sum(w for _, w in self.scorers) or 1.0
        for scorer, weight in self.scorers:
            fast = getattr(scorer, "score_array", None)
            if fast is not None:
                vals = fast(ctx, cands)
                assert vals.shape == (n,), f"scorer {scorer.name} returned shape {vals.shape} for {n} workers"
            else:
                s = scorer.score(ctx, cands)
                vals = np.fromiter(map(s.get, ids, repeat(0.0)), np.float64, n)
            totals += (weight / weight_sum) * vals
            per[scorer.name] = vals
            checked.append((scorer.name, vals))
        if checked:  # the range check, once over every scorer's values
            every = np.concatenate([v for _, v in checked])
            if not (every.min() >= 0.0 and every.max() <= 1.0):
                name, vals = next((k, v) for k, v in checked if not (v.min() >= 0.0 and v.max() <= 1.0))
                bad = next(i for i, v in enumerate(vals.tolist()) if not 0.0 <= v <= 1.0)
                raise AssertionError(f"scorer {name} returned {vals[bad]} for {ids[bad]}")
        total = dict(zip(ids, totals.tolist(), strict=True))
        rank_array = getattr(self.picker, "rank_array", None)
        ranked = rank_array(totals, ids) if rank_array is not None else self.picker.pick(total, ids)
        return ProfileResult(ranked, total, per, removed)
