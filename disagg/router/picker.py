"""Picker: the highest total score wins.

    ranked = sort by (-score, position in the candidate list)
    pick   = ranked[0]                                     (epsilon == 0)
           = uniform among {w : score_w >= top - epsilon}   (epsilon > 0, seeded)

Ties go to the earlier candidate, so a decision is reproducible from its
inputs. The full ranking is returned: a caller that cannot use the first
choice (replica died between decision and dispatch) falls back to the next
one, which is the next-best *cached* worker, not a random one.

Config example (YAML)::

    picker: {max_score: {epsilon: 0.02, seed: 0}}
"""

from __future__ import annotations

import random
from itertools import repeat

import numpy as np


class MaxScorePicker:
    name = "max_score"

    def __init__(self, epsilon: float = 0.0, seed: int = 0):
        if epsilon < 0:
            raise ValueError("epsilon must be >= 0")
        self.epsilon = epsilon
        self._rng = random.Random(seed)

    def rank(self, scores: dict[str, float], order: list[str]) -> list[str]:
        """Candidates best first; ``order`` breaks ties."""
        vals = np.fromiter(map(scores.get, order, repeat(0.0)), np.float64, len(order))
        return [order[i] for i in np.argsort(-vals, kind="stable").tolist()]

    def pick(self, scores: dict[str, float], order: list[str]) -> list[str]:
        """The ranking with the chosen worker first."""
        assert order, "picker needs at least one candidate"
        return self._choose(self.rank(scores, order), scores)

    def rank_array(self, totals: np.ndarray, order: list[str]) -> list[str]:
        """``pick`` for totals given as an array aligned with ``order``."""
        assert order, "picker needs at least one candidate"
        ranked = list(map(order.__getitem__, np.argsort(-totals, kind="stable").tolist()))
        if self.epsilon > 0 and len(ranked) > 1:
            return self._choose(ranked, dict(zip(order, totals.tolist(), strict=True)))
        return ranked

    def _choose(self, ranked: list[str], scores: dict[str, float]) -> list[str]:
        if self.epsilon > 0 and len(ranked) > 1:
            top = scores.get(ranked[0], 0.0)
            near = [w for w in ranked if scores.get(w, 0.0) >= top - self.epsilon]
            if len(near) > 1:
                chosen = self._rng.choice(near)
                ranked.remove(chosen)
                ranked.insert(0, chosen)
        return ranked
