"""Synthetic agentic traces: statistics within 5% of their targets, determinism, structure."""

from __future__ import annotations

import math

import pytest

from disagg.tools.bench.stats import compute_stats, consecutive_reuse, theoretical_hit_rate
from disagg.tools.bench.synth import synthesize
from disagg.tools.bench.tokens import TokenFactory
from disagg.tools.bench.trace import TraceRecord, group_sessions

SCALE = 0.25


@pytest.fixture(scope="module")
def trace() -> list[TraceRecord]:
    return synthesize(150, seed=7, scale=SCALE, block_size=256)


@pytest.fixture(scope="module")
def stats(trace: list[TraceRecord]):
    return compute_stats(trace)


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("turns_per_session.p50", 48),
        ("output_length.p50", 218 * SCALE),
        ("output_length.p90", 937 * SCALE),
        ("think_time_ms.p50", 10_000),
        ("reuse.p50", 0.96),
        ("reuse.mean", 0.93),
        ("shared_prefix_tokens", 15_000 * SCALE),
        ("first_turn_input.p50", 25_000 * SCALE),
    ],
)
def test_statistics_match_targets_within_5_percent(stats, name: str, target: float) -> None:
    value = stats
    for part in name.split("."):
        value = getattr(value, part)
    assert value == pytest.approx(target, rel=0.05), f"{name}: {value} vs {target}"


def test_context_grows_and_hit_rate_is_high(stats) -> None:
    assert stats.last_turn_input.p50 > 4 * stats.first_turn_input.p50
    assert 0.9 < stats.theoretical_hit_rate < 0.99
    assert stats.num_subagent_sessions > 0
    assert stats.think_time_ms.max <= 120_000


def test_same_seed_same_trace_other_seed_differs() -> None:
    a = synthesize(5, seed=3, scale=0.05)
    assert a == synthesize(5, seed=3, scale=0.05)
    assert a != synthesize(5, seed=4, scale=0.05)


def test_records_are_consistent(trace: list[TraceRecord]) -> None:
    assert [r.timestamp for r in trace] == sorted(r.timestamp for r in trace)
    for turns in group_sessions(trace).values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        assert turns[0].delay == 0
        for r in turns:
            assert len(r.hash_ids) == math.ceil(r.input_length / 256)
            assert r.input_length <= 256_000 * SCALE
        parent = turns[0].parent_session
        if parent is not None:  # subagents share the global prefix, nothing else of the parent
            assert parent in {t.session_id for t in trace}
            assert turns[0].hash_ids[:15] == list(range(15))


def test_turn_prompt_is_a_token_prefix_of_the_next() -> None:
    recs = synthesize(3, seed=1, scale=0.02, block_size=16, config=None)
    factory = TokenFactory(block_size=16)
    prefix_pairs = 0
    for turns in group_sessions(recs).values():
        for prev, cur in zip(turns, turns[1:], strict=False):
            a, b = factory.prompt_ids(prev), factory.prompt_ids(cur)
            reuse = consecutive_reuse(prev, cur)
            shared = int(reuse * cur.input_length)
            assert (a[:shared] == b[:shared]).all()
            prefix_pairs += shared > 0
    assert prefix_pairs > 0


def test_scale_and_caps() -> None:
    recs = synthesize(4, seed=0, scale=0.05, block_size=64, max_input=3000, turn_scale=0.25)
    assert max(r.input_length for r in recs) <= 3000
    assert all(r.block_size == 64 for r in recs)
    with pytest.raises(ValueError):
        synthesize(0)
    with pytest.raises(ValueError, match="leaves no room"):
        synthesize(1, scale=1.0, max_input=1000)


def test_theoretical_hit_rate_by_hand() -> None:
    recs = [
        TraceRecord("a", 0, 0, 0, 3, 1, [1, 2, 3], block_size=1),
        TraceRecord("b", 0, 1, 0, 2, 1, [1, 4], block_size=1),
        TraceRecord("a", 1, 2, 0, 4, 1, [1, 2, 3, 5], block_size=1),
    ]
    assert theoretical_hit_rate(recs) == pytest.approx(4 / 9)  # 0 + 1 + 3 hits of 3 + 2 + 4
    s = compute_stats(recs)
    assert s.reuse.p50 == pytest.approx(3 / 4)
    assert s.shared_prefix_tokens == 1
