"""Per-trace statistics: the shape numbers that describe an agentic trace.

Definitions (``bs`` = block size, ``L_k`` = input length of turn ``k``):

- consecutive-turn reuse of turn ``k+1`` =
  ``min(common_prefix_blocks(k, k+1) * bs, L_k, L_{k+1}) / L_{k+1}``
  (the share of the new prompt already sent by the previous turn);
- theoretical (infinite-cache) hit rate = prompt blocks whose hash id appeared
  in any earlier request (by timestamp) / all prompt blocks;
- think time = ``delay`` of turns after the first;
- shared prefix = longest hash-id prefix common to the first turns of all
  top-level sessions, in tokens;
- turns per session and first/last-turn input count top-level sessions only
  (subagents have ``parent_session`` set).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from disagg.tools.bench.trace import DEFAULT_BLOCK_SIZE, TraceRecord, group_sessions


@dataclass(slots=True)
class Dist:
    """Summary of one distribution."""

    count: int = 0
    mean: float = float("nan")
    p50: float = float("nan")
    p90: float = float("nan")
    p99: float = float("nan")
    max: float = float("nan")

    @classmethod
    def of(cls, values: Sequence[float] | np.ndarray) -> Dist:
        arr = np.asarray(values, dtype=np.float64)
        if arr.size == 0:
            return cls()
        p50, p90, p99 = np.percentile(arr, [50, 90, 99])
        return cls(
            int(arr.size), float(arr.mean()), float(p50), float(p90), float(p99), float(arr.max())
        )


@dataclass(slots=True)
class TraceStats:
    """Statistics of a trace (see the module docstring for definitions)."""

    num_requests: int
    num_sessions: int  # top-level sessions
    num_subagent_sessions: int
    duration_s: float  # last timestamp - first timestamp
    input_length: Dist
    output_length: Dist
    first_turn_input: Dist
    last_turn_input: Dist
    turns_per_session: Dist
    think_time_ms: Dist
    reuse: Dist  # consecutive-turn reuse fraction
    theoretical_hit_rate: float
    shared_prefix_tokens: int
    block_sizes: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def consecutive_reuse(
    prev: TraceRecord, cur: TraceRecord, default_bs: int = DEFAULT_BLOCK_SIZE
) -> float:
    bs = cur.effective_block_size(default_bs)
    common = common_prefix_len(prev.hash_ids, cur.hash_ids) * bs
    return min(common, prev.input_length, cur.input_length) / cur.input_length


def theoretical_hit_rate(records: Iterable[TraceRecord]) -> float:
    """Fraction of prompt blocks seen in an earlier request (records in send order)."""
    seen: set[int] = set()
    hits = total = 0
    for rec in records:
        ids = rec.hash_ids
        hits += sum(1 for h in ids if h in seen)
        total += len(ids)
        seen.update(ids)
    return hits / total if total else float("nan")


def compute_stats(
    records: Sequence[TraceRecord], default_block_size: int = DEFAULT_BLOCK_SIZE
) -> TraceStats:
    """Compute :class:`TraceStats` for a trace."""
    if not records:
        raise ValueError("no records")
    ordered = sorted(records, key=lambda r: r.timestamp)
    sessions = group_sessions(ordered)
    roots = [turns for turns in sessions.values() if turns[0].parent_session is None]
    reuse: list[float] = []
    think: list[float] = []
    for turns in sessions.values():
        for prev, cur in zip(turns, turns[1:], strict=False):
            reuse.append(consecutive_reuse(prev, cur, default_block_size))
            think.append(cur.delay)
    shared = 0
    if roots:
        first = roots[0][0]
        shared = len(first.hash_ids)
        for turns in roots[1:]:
            shared = min(shared, common_prefix_len(first.hash_ids, turns[0].hash_ids))
            if shared == 0:
                break
        bs = first.effective_block_size(default_block_size)
        shared = min(shared * bs, min(t[0].input_length for t in roots)) if len(roots) > 1 else 0
    ts = [r.timestamp for r in ordered]
    return TraceStats(
        num_requests=len(records),
        num_sessions=len(roots),
        num_subagent_sessions=len(sessions) - len(roots),
        duration_s=(max(ts) - min(ts)) / 1000.0,
        input_length=Dist.of([r.input_length for r in records]),
        output_length=Dist.of([r.output_length for r in records]),
        first_turn_input=Dist.of([t[0].input_length for t in roots]),
        last_turn_input=Dist.of([t[-1].input_length for t in roots]),
        turns_per_session=Dist.of([len(t) for t in roots]),
        think_time_ms=Dist.of(think),
        reuse=Dist.of(reuse),
        theoretical_hit_rate=theoretical_hit_rate(ordered),
        shared_prefix_tokens=int(shared),
        block_sizes=sorted({r.effective_block_size(default_block_size) for r in records}),
    )


def format_stats(stats: TraceStats) -> str:
    """Human-readable table of a trace's statistics."""
    lines = [
        f"requests              {stats.num_requests}",
        f"sessions              {stats.num_sessions} (+{stats.num_subagent_sessions} subagent)",
        f"span                  {stats.duration_s:,.1f} s",
        f"block sizes           {stats.block_sizes}",
        f"shared prefix         {stats.shared_prefix_tokens:,} tokens",
        f"theoretical hit rate  {stats.theoretical_hit_rate:.2%} (infinite cache, per block)",
        "",
        f"{'':22}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}",
    ]
    rows = [
        ("input tokens", stats.input_length, 0),
        ("output tokens", stats.output_length, 0),
        ("first-turn input", stats.first_turn_input, 0),
        ("last-turn input", stats.last_turn_input, 0),
        ("turns / session", stats.turns_per_session, 1),
        ("think time (s)", _div(stats.think_time_ms, 1000.0), 1),
        ("turn reuse (%)", _div(stats.reuse, 0.01), 1),
    ]
    for name, d, digits in rows:
        cells = "".join(f"{v:>10,.{digits}f}" for v in (d.mean, d.p50, d.p90, d.p99, d.max))
        lines.append(f"{name:22}{cells}")
    return "\n".join(lines)


def _div(d: Dist, by: float) -> Dist:
    return Dist(d.count, d.mean / by, d.p50 / by, d.p90 / by, d.p99 / by, d.max / by)
