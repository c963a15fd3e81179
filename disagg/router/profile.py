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
    per_scorer: dict[str, dict[str, float]] = field(default_factory=dict)  # scorer -> worker -> [0,1]
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
        kept_ids = {c.worker_id for c in cands}
        removed = [w.worker_id for w in workers if w.worker_id not in kept_ids]
        if not cands:
            return ProfileResult([], {}, {}, removed)
        ids = [w.worker_id for w in cands]
        totals = dict.fromkeys(ids, 0.0)
        per: dict[str, dict[str, float]] = {}
        weight_sum = sum(w for _, w in self.scorers) or 1.0
        for scorer, weight in self.scorers:
            s = scorer.score(ctx, cands)
            for wid in ids:
                v = s.get(wid, 0.0)
                assert 0.0 <= v <= 1.0, f"scorer {scorer.name} returned {v} for {wid}"
                totals[wid] += weight * v / weight_sum
            per[scorer.name] = s
        return ProfileResult(self.picker.pick(totals, ids), totals, per, removed)
