"""LRUTier.put_many against one put per key (same order, contents and events)."""

from __future__ import annotations

import random

from disagg.tools.sim.cache import LRUTier


def _pair(capacity: int):
    logs: tuple[list, list] = ([], [])
    return (LRUTier("t", capacity, lambda op, k: logs[0].append((op, k))),
            LRUTier("t", capacity, lambda op, k: logs[1].append((op, k))), logs)


def test_put_many_is_put_per_key():
    rng = random.Random(1)
    for capacity in (0, 1, 3, 8, 40):
        bulk, single, (log_b, log_s) = _pair(capacity)
        for _ in range(300):
            start = rng.randrange(60)
            keys = list(range(start, start + rng.randrange(0, 20)))
            if rng.random() < 0.3:
                rng.shuffle(keys)
            size = rng.choice((1, 1, 2, 50))
            bulk.put_many(keys, size)
            for k in keys:
                single.put(k, size)
            assert bulk.keys() == single.keys() and bulk.used == single.used
            assert bulk.num_evictions == single.num_evictions
        assert log_b == log_s


def test_put_many_touches_the_resident_run_then_inserts():
    t, _, (log, _) = _pair(4)
    t.put_many([1, 2, 3])
    t.put_many([2, 1, 9, 3])  # 2, 1 refreshed; 9 evicts nothing (room for one); 3 refreshed
    assert t.keys() == [2, 1, 9, 3] and log == [("stored", 1), ("stored", 2), ("stored", 3), ("stored", 9)]
    t.put_many([5, 6])  # evicts the two oldest
    assert t.keys() == [9, 3, 5, 6] and log[-4:] == [("evicted", 2), ("stored", 5), ("evicted", 1), ("stored", 6)]
