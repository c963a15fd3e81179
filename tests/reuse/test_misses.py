"""Miss classification (disagg.reuse.misses): one reason per token, and the reasons add up."""

from __future__ import annotations

import random

import pytest

from disagg.reuse.misses import REASONS, MissInputs, classify


@pytest.mark.parametrize(("inputs", "expected"), [
    (MissInputs(1000, 640, 640, 640), {}),  # reused all it could
    (MissInputs(1000, 700, 640, 640), {}),  # reused more than the ledger saw (forgotten): no miss
    (MissInputs(1000, 0, 640, 640, published=(512,), still_held=False), {"evicted": 512, "no_checkpoint": 128}),
    (MissInputs(1000, 0, 640, 640, published=(512,)), {"not_looked_up": 512, "no_checkpoint": 128}),
    (MissInputs(1000, 0, 640, 640, published=(512,), failure="load_deadline"),
     {"load_deadline": 512, "no_checkpoint": 128}),
    (MissInputs(1000, 0, 640, 640, published=(512,), failure="load_failed"), {"load_failed": 512, "no_checkpoint": 128}),
    (MissInputs(1000, 256, 640, 640, pending=(640,)), {"in_flight": 384}),
    (MissInputs(1000, 256, 640, 640, raced=(576,)), {"raced_publish": 320, "no_checkpoint": 64}),
    (MissInputs(1000, 256, 640, 640, published=(384,), pending=(512,), raced=(576,)),
     {"not_looked_up": 128, "in_flight": 128, "raced_publish": 64, "no_checkpoint": 64}),
    (MissInputs(1000, 0, 0, 256), {"tenant_salt": 256}),
    (MissInputs(1000, 64, 128, 512), {"no_checkpoint": 64, "tenant_salt": 384}),
    (MissInputs(1000, 256, 640, 640, published=(128,)), {"no_checkpoint": 384}),  # a point below r is no help
])
def test_each_range_gets_its_reason(inputs, expected):
    assert classify(inputs) == expected


def test_reasons_add_up_to_bound_minus_realized():
    rng = random.Random(0)
    for _ in range(2000):
        bound = rng.randrange(0, 4000)
        any_bound = bound + rng.choice([0, 0, rng.randrange(0, 500)])
        pts = lambda b=bound: tuple(rng.randrange(1, b + 1) for _ in range(rng.randrange(3))) if b else ()  # noqa: E731
        m = MissInputs(any_bound + 1, rng.randrange(0, any_bound + 64), bound, any_bound, pts(), pts(), pts(),
                       rng.random() < 0.5, rng.choice(["", "load_deadline", "load_failed"]))
        out = classify(m)
        assert sum(out.values()) == max(0, m.bound_any_salt - m.realized)
        assert set(out) <= set(REASONS) and all(n > 0 for n in out.values())


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="failure"):
        MissInputs(10, 0, 5, 5, failure="timeout")
    with pytest.raises(ValueError, match="bound"):
        MissInputs(10, 0, 6, 5)
