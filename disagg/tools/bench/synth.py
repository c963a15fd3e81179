"""Seeded synthetic agentic coding sessions.

Each session models a coding agent talking to the model::

    turn 0   [ shared tool+system prefix | task + repo context ]
    turn 1   [ shared tool+system prefix | task + repo context | out0 + tool0 ]
    turn k+1 [ ...everything of turn k...                      | outk + toolk ]

- The shared prefix (~15K tokens at full scale) uses *global* hash ids
  ``0 .. P-1``; everything else uses session-unique ids.
- The context grows by the previous output plus a tool result each turn, and
  each prompt ends with a short ephemeral tail (reminders) that the next turn
  drops, so consecutive-turn reuse is high (median ~96%). Occasionally the agent edits
  its context in place (a rewrite from a random point: lower reuse), and a
  context that outgrows ``max_input`` is compacted to prefix + summary.
- Turns per session are lognormal (median 48), drawn by stratified sampling
  so small traces already match the target distribution; outputs are
  lognormal (median 218, P90 937); think time is lognormal (median 10 s,
  capped).
- Subagents: a parent turn may spawn a child session (``parent_session``)
  that shares only the global prefix.
- ``timestamp`` (open loop): session starts form a Poisson process at
  ``session_rate`` per second; later turns add an estimated service time and
  the think time.

Block ids and the partial last block: a session keeps one id per block of
its growing context; a partial block keeps its id when the context grows,
because token blocks are generated per id (see ``tokens.py``), so turn k's
prompt is an exact token prefix of turn k+1's.

``scale`` multiplies every token length and ``max_input``; turn counts are
kept, so per-turn ratios (reuse, growth, hit rate) are kept and
``scale=0.05`` gives a CPU-sized trace of the same shape. ``turn_scale``
shortens sessions too; reuse then drops a little, because how deep a turn
sits in its session sets how much of its prompt is old.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from disagg.tools.bench.trace import TraceRecord

_NORMAL = NormalDist()
_Z90 = _NORMAL.inv_cdf(0.9)


@dataclass(slots=True)
class SynthConfig:
    """Full-scale shape targets of a synthetic agentic trace (lengths in tokens)."""

    prefix_tokens: int = 15_000  # shared tool + system prefix (global hash ids)
    context_median: float = 8_500  # first turn's session-unique context
    context_sigma: float = 0.5
    turns_median: float = 48  # turns per top-level session (lognormal)
    turns_sigma: float = 0.9
    max_turns: int = 400
    output_median: float = 218  # output tokens per request
    output_p90: float = 937
    tool_median: float = 1_700  # tool result tokens appended after each turn
    tool_sigma: float = 1.25
    ephemeral_median: float = 1_300  # per-prompt tail (reminders) dropped by the next turn
    ephemeral_sigma: float = 0.5
    think_median_ms: float = 10_000  # think time between turns
    think_sigma: float = 1.0
    think_cap_ms: float = 120_000
    rewrite_prob: float = 0.025  # per turn: context edited in place from a random point
    max_input: int = 256_000  # compaction threshold
    summary_median: float = 8_000  # context after compaction (plus the prefix)
    subagent_prob: float = 0.01  # per parent turn: spawn a subagent session
    subagent_turns_median: float = 8
    subagent_context_median: float = 3_000
    session_rate: float = 0.5  # sessions started per second (open loop)
    est_ms_per_output_token: float = 20.0  # service-time model for timestamps
    est_prefill_tokens_per_s: float = 20_000.0

    def __post_init__(self) -> None:
        if self.output_p90 <= self.output_median:
            raise ValueError("output_p90 must exceed output_median")
        if self.prefix_tokens < 1 or self.turns_median < 1:
            raise ValueError("prefix_tokens and turns_median must be >= 1")
        if not 0 <= self.rewrite_prob < 1 or not 0 <= self.subagent_prob < 1:
            raise ValueError("probabilities must be in [0, 1)")

    @property
    def output_sigma(self) -> float:
        return math.log(self.output_p90 / self.output_median) / _Z90


class _Stratified:
    """Lognormal draws taken from shuffled stratified pools of ``pool`` values.

    Every full pool holds exactly one draw per equal-probability stratum, so
    even a few thousand draws match the target quantiles closely.
    """

    def __init__(
        self, rng: np.random.Generator, median: float, sigma: float, pool: int = 1024
    ) -> None:
        self.rng, self.median, self.sigma, self.pool = rng, median, sigma, pool
        self.values: list[float] = []

    def __call__(self) -> float:
        if not self.values:
            u = (self.rng.permutation(self.pool) + self.rng.random(self.pool)) / self.pool
            z = np.array([_NORMAL.inv_cdf(float(x)) for x in u])
            self.values = list(self.median * np.exp(self.sigma * z))
        return self.values.pop()


class _Builder:
    """Grows sessions and allocates session-unique block ids."""

    def __init__(
        self,
        cfg: SynthConfig,
        rng: np.random.Generator,
        block_size: int,
        scale: float,
        turn_scale: float,
        max_input: int,
    ) -> None:
        self.cfg, self.rng, self.bs = cfg, rng, block_size
        self.scale, self.turn_scale = scale, turn_scale
        self.max_input = max_input
        self.prefix_blocks = max(1, round(cfg.prefix_tokens * scale / block_size))
        self.prefix_len = self.prefix_blocks * block_size
        self.next_id = self.prefix_blocks
        self.output = _Stratified(rng, cfg.output_median * scale, cfg.output_sigma)
        self.tool = _Stratified(rng, cfg.tool_median * scale, cfg.tool_sigma)
        self.ephemeral = _Stratified(rng, cfg.ephemeral_median * scale, cfg.ephemeral_sigma)
        self.think_ms = _Stratified(rng, cfg.think_median_ms, cfg.think_sigma)
        self.records: list[TraceRecord] = []
        self.pending: list[tuple[str, float, int]] = []  # subagents: (parent, start ts, turns)

    def tokens(self, median: float, sigma: float) -> int:
        return max(1, round(median * self.scale * math.exp(sigma * self.rng.standard_normal())))

    def fresh(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def extend(self, ids: list[int], old_len: int, new_len: int) -> None:
        """Append ids for the blocks of ``(old_len, new_len]`` (partial block keeps its id)."""
        assert len(ids) == math.ceil(old_len / self.bs), "ids must cover the context"
        need = math.ceil(new_len / self.bs) - len(ids)
        if need > 0:
            ids.extend(self.fresh(need))

    def turn_count(self, median: float, sigma: float, u: float | None = None) -> int:
        z = self.rng.standard_normal() if u is None else _NORMAL.inv_cdf(u)
        turns = round(median * self.turn_scale * math.exp(sigma * z))
        return int(min(self.cfg.max_turns, max(1, turns)))

    def session(
        self,
        session_id: str,
        num_turns: int,
        start_ms: float,
        context_median: float,
        parent: str | None,
    ) -> None:
        """Append one session's records.

        ``ids`` / ``length`` describe the persistent context; each prompt adds
        an ephemeral tail (fresh ids) that the next turn drops.
        """
        cfg, bs = self.cfg, self.bs
        length = self.prefix_len + self.tokens(context_median, cfg.context_sigma)
        length = min(length, self.max_input - 1)
        ids = list(range(self.prefix_blocks))
        self.extend(ids, self.prefix_len, length)
        ts, delay, prev_len = start_ms, 0.0, 0
        for turn in range(num_turns):
            prompt_len = min(self.max_input, length + max(1, round(self.ephemeral())))
            prompt_ids = ids.copy()
            self.extend(prompt_ids, length, prompt_len)
            out = max(1, round(self.output()))
            self.records.append(
                TraceRecord(
                    session_id,
                    turn,
                    float(round(ts)),
                    delay,
                    prompt_len,
                    out,
                    prompt_ids,
                    parent,
                    bs,
                )
            )
            service = (
                prompt_len - min(prev_len, prompt_len)
            ) / cfg.est_prefill_tokens_per_s * 1000.0 + out * cfg.est_ms_per_output_token
            if parent is None and self.rng.random() < cfg.subagent_prob:
                sub_turns = self.turn_count(cfg.subagent_turns_median, 0.7)
                self.pending.append((session_id, ts + service, sub_turns))
            prev_len = length
            # Next turn: previous output + a tool result; maybe an in-place edit or compaction.
            grown = length + out + max(1, round(self.tool()))
            if self.rng.random() < cfg.rewrite_prob and length > self.prefix_len + bs:
                keep = int(self.rng.integers(self.prefix_len, length)) // bs
                ids = ids[:keep]
                self.extend(ids, keep * bs, length)
                prev_len = keep * bs
            if grown >= self.max_input:
                ids = list(range(self.prefix_blocks))
                length = self.prefix_len
                grown = min(self.max_input - 1, length + self.tokens(cfg.summary_median, 0.5))
                prev_len = 0
            self.extend(ids, length, grown)
            length = grown
            delay = float(round(min(self.think_ms(), cfg.think_cap_ms)))
            ts += service + delay


def synthesize(
    num_sessions: int,
    seed: int = 0,
    *,
    block_size: int = 256,
    scale: float = 1.0,
    turn_scale: float = 1.0,
    max_input: int | None = None,
    subagents: bool = True,
    config: SynthConfig | None = None,
) -> list[TraceRecord]:
    """Generate a seeded synthetic agentic trace.

    Args:
        num_sessions: top-level sessions (subagent sessions come in addition).
        seed: RNG seed; the same arguments give the same trace.
        block_size: tokens per hash block.
        scale: multiplies token lengths and the input cap.
        turn_scale: multiplies the turn-count medians (shorter sessions also
            mean shallower contexts, so reuse and hit rate drop a little).
        max_input: prompt cap in tokens (absolute); default ``config.max_input * scale``.
        subagents: allow subagent sessions.
        config: shape targets; defaults to :class:`SynthConfig`.

    Returns:
        Records sorted by timestamp (ties by session and turn).
    """
    if num_sessions < 1:
        raise ValueError("num_sessions must be >= 1")
    if not 0 < scale <= 4 or not 0 < turn_scale <= 4:
        raise ValueError("scale and turn_scale must be in (0, 4]")
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    cfg = config or SynthConfig()
    if not subagents:
        cfg = SynthConfig(**{**{f: getattr(cfg, f) for f in cfg.__slots__}, "subagent_prob": 0.0})
    cap = int(max_input if max_input is not None else max(1, round(cfg.max_input * scale)))
    rng = np.random.default_rng(seed)
    b = _Builder(cfg, rng, block_size, scale, turn_scale, cap)
    if cap <= b.prefix_len:
        raise ValueError(f"max_input {cap} leaves no room after the {b.prefix_len}-token prefix")
    # Stratified quantiles: one draw per equal-probability stratum, shuffled.
    strata = (rng.permutation(num_sessions) + rng.random(num_sessions)) / num_sessions
    width = len(str(num_sessions - 1))
    start = 0.0
    for i in range(num_sessions):
        turns = b.turn_count(cfg.turns_median, cfg.turns_sigma, float(strata[i]))
        b.session(f"s{i:0{width}d}", turns, start, cfg.context_median, None)
        start += float(rng.exponential(1000.0 / cfg.session_rate))
    sub_index: dict[str, int] = {}
    for parent, ts, turns in b.pending:
        j = sub_index.get(parent, 0)
        sub_index[parent] = j + 1
        b.session(f"{parent}.sub{j}", turns, ts, cfg.subagent_context_median, parent)
    b.records.sort(key=lambda r: (r.timestamp, r.session_id, r.turn))
    return b.records
