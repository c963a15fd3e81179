"""The router's fast paths against a slow reference: identical decisions over random traces.

The fast paths are the walk's numpy columns (``MatchResult.columns``), the
candidate views shared by identity (``RoutingContext.view`` / ``subset``) and
the scorers' ``score_array``. The reference runs the same router with those
replaced by per-worker lookups: every view is built from ``ctx.prefix(w)`` and
``ctx.load(w)`` one worker at a time, filters return plain list comprehensions,
and the profile runner takes each scorer's ``{worker: score}`` dict. Both
routers see the same index, worker stats, sessions and clock; every field of
every decision (scores included) must match.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from disagg.router import context as context_mod
from disagg.router.context import LOAD_FIELDS, CandidateView, RoutingContext
from disagg.router.index import PrefixIndex
from disagg.router.router import StateAwareRouter
from disagg.router.types import TIER_INDEX, RouteRequest, WorkerState
from tests.router.helpers import chain, store

BS = 4


class _DictOnly:
    """A scorer seen through its dict interface only (the runner's slow path)."""

    def __init__(self, scorer):
        self.name, self._scorer = scorer.name, scorer

    def score(self, ctx, workers):
        return self._scorer.score(ctx, workers)


def _slow_view(self: RoutingContext, workers: list[WorkerState]) -> CandidateView:
    loads = [self.load(w) for w in workers]
    per = [self.prefix(w.worker_id) for w in workers]
    return CandidateView(
        [w.worker_id for w in workers],
        np.array([[getattr(x, f) for x in loads] for f in LOAD_FIELDS], np.float64).reshape(len(LOAD_FIELDS), -1),
        np.array([float(m.resumable_tokens) for m in per]),
        np.array([TIER_INDEX[m.tier] if m.tier else -1 for m in per], np.int64),
    )


def _slow_subset(self: RoutingContext, workers, view, keep) -> list[WorkerState]:
    return [w for w, k in zip(workers, keep.tolist(), strict=True) if k]


def _reference_router(idx: PrefixIndex, clock) -> StateAwareRouter:
    r = StateAwareRouter(idx, clock=clock)
    for prof in r.profiles.values():
        prof.scorers = [(_DictOnly(s), w) for s, w in prof.scorers]
    return r


def _trace(seed: int, roles: list[str]):
    rng = random.Random(seed)
    prefixes = [chain(rng.randint(4, 40), f"{seed}-{k}") for k in range(12)]
    shared = chain(6, f"sys{seed}")
    ws = [WorkerState(f"w{i}", roles[i % len(roles)], f"n{i // 4}") for i in range(rng.choice([5, 16, 70]))]
    for step in range(120):
        events = []
        for _ in range(rng.randint(0, 6)):
            p = rng.choice(prefixes)
            k = rng.randrange(len(p))
            w = rng.choice(ws).worker_id
            tier = rng.choice(["device", "device", "host", "disk", "remote"])
            op = "evicted" if rng.random() < 0.2 else "stored"
            events += [("mla", h, tier, w, op) for h in (shared + p)[: len(shared) + k + 1]]
            if rng.random() < 0.7:
                events.append(("kda", (shared + p)[len(shared) + k], tier, w, op))
        for w in ws:
            w.queued_prefill_tokens = rng.choice([0, 0, rng.randrange(60_000)])
            w.running_decode_tokens = rng.randrange(200_000)
            w.healthy = rng.random() > 0.05
            w.updated_at = step * 0.5 - rng.random()
        p = rng.choice(prefixes)
        hashes = shared + p + chain(rng.randint(0, 3), f"new{seed}-{step}")
        sid = f"s{rng.randrange(8)}" if rng.random() < 0.8 else ""
        yield step * 0.5, events, RouteRequest(f"q{step}", sid, hashes, len(hashes) * BS + rng.randint(1, 3), BS), ws


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("roles", [["both"], ["prefill", "decode", "decode"]], ids=["aggregated", "pd"])
def test_fast_path_decisions_equal_the_slow_reference(seed, roles, monkeypatch):
    now = [0.0]
    fast_idx, slow_idx = PrefixIndex(), PrefixIndex()
    fast, slow = StateAwareRouter(fast_idx, clock=lambda: now[0]), _reference_router(slow_idx, lambda: now[0])
    decisions = []
    for t, events, rr, ws in _trace(seed, roles):
        now[0] = t
        for kind, h, tier, w, op in events:
            store(fast_idx, kind, h, tier, w, op)
            store(slow_idx, kind, h, tier, w, op)
        d_fast = fast.route(rr, ws)
        with monkeypatch.context() as m:
            m.setattr(context_mod.RoutingContext, "view", _slow_view)
            m.setattr(context_mod.RoutingContext, "subset", _slow_subset)
            d_slow = slow.route(rr, ws)
        assert d_fast == d_slow, f"step {rr.request_id}"
        fast.on_routed(rr, d_fast)
        slow.on_routed(rr, d_slow)
        decisions.append(d_fast.reason)
    assert len({r.split("/")[1] for r in decisions}) >= 2  # the trace reaches more than one kind of decision
