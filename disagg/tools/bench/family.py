"""A family of agentic traces: named, seeded members of different shapes.

One synthesizer (``disagg.tools.bench.synth``) with the knobs that decide how a
router fares, set per member::

    knob                      SynthConfig field(s)
    shared-prefix size        prefix_tokens
    first turn                context_median, context_sigma
    per-turn growth           tool_median, tool_sigma (+ the previous output)
    context cap (compaction)  max_input
    turns per session         turns_median, turns_sigma
    think time                think_median_ms, think_sigma, think_cap_ms
    session arrival rate      session_rate (open loop; closed loop: lanes)
    subagent fan-out          subagent_prob, subagent_turns_median, subagent_context_median

``SUITE`` is the fixed benchmark suite (``benchmarks/router_suite.py``). A
member is generated at full scale (its lengths as listed) or scaled: ``scale``
multiplies every token length (and the context cap), ``turn_scale`` the turn
counts; the suite's runner scales cache capacities and think times with the
same factor so that capacity pressure and load keep their full-scale shape.

    >>> from disagg.tools.bench.family import SUITE, member_trace
    >>> recs = member_trace(SUITE["long_agentic"], num_sessions=96)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from disagg.tools.bench.synth import SynthConfig, synthesize
from disagg.tools.bench.trace import TraceRecord


@dataclass(frozen=True, slots=True)
class FamilyMember:
    """One named, seeded shape of the family (full-scale lengths in tokens)."""

    name: str  # registry key
    description: str  # one line for tables and docs
    seed: int  # RNG seed of the trace
    synth: dict[str, Any] = field(default_factory=dict)  # SynthConfig overrides

    def __post_init__(self) -> None:
        self.config()  # validates the overrides

    def config(self) -> SynthConfig:
        unknown = set(self.synth) - set(SynthConfig.__slots__)
        if unknown:
            raise ValueError(f"member {self.name!r}: unknown SynthConfig fields {sorted(unknown)}")
        return SynthConfig(**self.synth)


def _member(name: str, description: str, seed: int, **synth: Any) -> FamilyMember:
    return FamilyMember(name, description, seed, synth)


SUITE: dict[str, FamilyMember] = {m.name: m for m in (
    _member("long_agentic",
            "12K shared prompt, first turns 2K-16K, growth ~4K/turn to 128K, ~24 turns, think ~3 s",
            23, prefix_tokens=12_000, context_median=5_500, context_sigma=0.55, turns_median=24,
            turns_sigma=0.35, max_turns=64, tool_median=3_000, tool_sigma=0.9, ephemeral_median=600,
            think_median_ms=3_000, think_sigma=0.8, think_cap_ms=30_000, max_input=131_072,
            summary_median=12_000, subagent_prob=0.0),
    _member("long_agentic_b", "long_agentic, another seed", 24,
            prefix_tokens=12_000, context_median=5_500, context_sigma=0.55, turns_median=24,
            turns_sigma=0.35, max_turns=64, tool_median=3_000, tool_sigma=0.9, ephemeral_median=600,
            think_median_ms=3_000, think_sigma=0.8, think_cap_ms=30_000, max_input=131_072,
            summary_median=12_000, subagent_prob=0.0),
    _member("agentx", "AgentX-style coding sessions: 15K prefix, 8.5K first turn, 48 turns, think 10 s",
            7, subagent_prob=0.01),
    _member("fanout", "32K shared prompt, subagents fanned out (15% of turns), 16 turns, think 2 s",
            11, prefix_tokens=32_000, context_median=4_000, turns_median=16, turns_sigma=0.5,
            tool_median=1_200, think_median_ms=2_000, subagent_prob=0.15, subagent_turns_median=6,
            subagent_context_median=3_000, max_input=131_072),
    _member("deep_context", "4K prefix, 32K first turn, growth ~6K/turn to 192K, 20 turns, think 20 s",
            13, prefix_tokens=4_000, context_median=32_000, context_sigma=0.3, turns_median=20,
            turns_sigma=0.4, tool_median=5_000, tool_sigma=0.6, think_median_ms=20_000,
            think_cap_ms=60_000, max_input=196_608, summary_median=16_000, subagent_prob=0.0),
    _member("chat_burst", "2K prefix, short turns (1K, +300/turn), 8 turns, think 0.5 s",
            17, prefix_tokens=2_000, context_median=1_000, turns_median=8, turns_sigma=0.5,
            tool_median=300, tool_sigma=0.7, ephemeral_median=100, output_median=150, output_p90=600,
            think_median_ms=500, think_sigma=0.6, think_cap_ms=5_000, max_input=32_768,
            summary_median=2_000, subagent_prob=0.0),
)}


def member_trace(member: FamilyMember, num_sessions: int, *, block_size: int = 64, scale: float = 1.0,
                 turn_scale: float = 1.0) -> list[TraceRecord]:
    """The member's trace: ``num_sessions`` top-level sessions, seeded by the member.

    Args:
        member: the family member.
        num_sessions: top-level sessions (subagents come in addition).
        block_size: tokens per hash block.
        scale: multiplies every token length and the context cap.
        turn_scale: multiplies the turn-count medians.
    """
    return synthesize(num_sessions, member.seed, block_size=block_size, scale=scale, turn_scale=turn_scale,
                      config=member.config())
