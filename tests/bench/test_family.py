"""The trace family: members are reproducible, valid and have their stated shapes."""

from __future__ import annotations

import pytest

from disagg.tools.bench.family import SUITE, FamilyMember, member_trace
from disagg.tools.bench.stats import compute_stats
from disagg.tools.bench.trace import group_sessions


def test_suite_has_at_least_six_named_members() -> None:
    assert len(SUITE) >= 6
    assert all(name == m.name for name, m in SUITE.items())
    assert len({m.seed for m in SUITE.values()}) == len(SUITE)


@pytest.mark.parametrize("name", sorted(SUITE))
def test_member_is_reproducible_and_seeded(name: str) -> None:
    m = SUITE[name]
    a = member_trace(m, 8, scale=0.25)
    b = member_trace(m, 8, scale=0.25)
    assert [r.to_dict() for r in a] == [r.to_dict() for r in b]
    other = FamilyMember(m.name, m.description, m.seed + 1, m.synth)
    assert [r.hash_ids for r in member_trace(other, 8, scale=0.25)] != [r.hash_ids for r in a]


@pytest.mark.parametrize("name", sorted(SUITE))
def test_member_respects_its_cap_and_block_size(name: str) -> None:
    m = SUITE[name]
    recs = member_trace(m, 12, block_size=64, scale=0.25)
    cap = round(m.config().max_input * 0.25)
    assert max(r.input_length for r in recs) <= cap
    for r in recs:
        assert r.block_size == 64 and len(r.hash_ids) == -(-r.input_length // 64)


def test_long_agentic_has_the_issue_shape() -> None:
    """12K shared prompt, contexts up to 128K, ~24 turns per session."""
    recs = member_trace(SUITE["long_agentic"], 96, block_size=64)
    stats = compute_stats(recs)
    assert 11_900 <= stats.shared_prefix_tokens <= 12_100
    assert stats.turns_per_session.p50 == pytest.approx(24, abs=2)
    assert max(r.input_length for r in recs) == 131_072
    unique_first = [s[0].input_length - stats.shared_prefix_tokens for s in group_sessions(recs).values()]
    inside = sum(2_000 <= n <= 16_000 for n in unique_first) / len(unique_first)
    assert inside >= 0.9


def test_members_differ_in_shape() -> None:
    stats = {n: compute_stats(member_trace(m, 24, scale=0.25)) for n, m in SUITE.items()}
    prefixes = {s.shared_prefix_tokens for s in stats.values()}
    turns = {round(s.turns_per_session.p50) for s in stats.values()}
    assert len(prefixes) >= 4 and len(turns) >= 4


def test_unknown_override_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown SynthConfig fields"):
        FamilyMember("bad", "", 0, {"no_such_knob": 1})
