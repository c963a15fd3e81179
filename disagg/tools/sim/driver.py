"""Workload drivers: when each request of a trace is sent, in simulated time.

Closed loop (the benchmark's semantics, ``disagg.tools.bench.runner``): C lanes
each replay one session turn by turn; the next turn is sent
``min(delay, think_cap_ms) * think_scale`` after the previous response
ended; a lane whose session ends takes the next session (no think time in
between); when every session has been taken, sessions are replayed again
with a new salt (``recycle``)::

    lane 0  [s0 t0]--think--[s0 t1]--think--[s0 t2] [s3 t0]--think-- ...
    lane 1  [s1 t0]--think--[s1 t1] [s2 t0]--think--[s2 t1] ...

Warm-up, sample-start turns (the same seeded ``random.Random`` draws as
the benchmark, so both start the same turns), measured-request and time
bounds behave as in the benchmark. ``ReplayConfig.from_run_config`` copies
a benchmark ``RunConfig``.

Open loop: every request is sent at ``timestamp / speedup`` after the first.

Salts: a replay's salt is ``run_salt << 16 | replay_number``, as in the
benchmark; salt 0 is the trace as written.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from disagg.tools.sim.workload import SimRequest


class Simulator(Protocol):
    """What the driver needs of ``disagg.tools.sim.simulator.Simulator``: a clock to schedule on,
    a door for requests, and word of finished sessions."""

    def schedule(self, t: float, fn: Callable[..., None], *args: Any) -> None: ...

    def send(self, now: float, req: SimRequest, salt: int = 0, lane: int = -1, warmup: bool = False,
             last: bool = False) -> None: ...

    def session_done(self, session_id: str, salt: int) -> None: ...


@dataclass(slots=True)
class ReplayConfig:
    """How the simulator sends a trace (mirrors ``disagg.tools.bench.runner.RunConfig``)."""

    mode: str = "closed"  # closed | open
    concurrency: int = 8  # closed-loop lanes
    think_cap_ms: float = float("inf")  # cap on a turn's think time
    think_scale: float = 1.0  # multiplies think time
    ramp_s: float = 0.0  # lane i starts at i * ramp_s / concurrency (benchmark)
    lane_stagger_s: float = 0.0  # lane i starts at i * lane_stagger_s (earlier simulator runs)
    sample_start_turn: bool = False  # each lane's first session starts at a random turn (warm-up)
    recycle: bool = False  # replay sessions again with a new salt when they run out
    max_requests: int | None = None  # measured requests to send
    duration_s: float | None = None  # measured seconds after warm-up
    warmup_requests: int = 0  # the first N requests are warm-up
    warmup_s: float = 0.0  # requests sent before this are warm-up
    run_salt: int = 0  # cache-busting salt base
    seed: int = 0  # sampled start turns
    speedup: float = 1.0  # open loop: timestamps are divided by this
    session_order: str = "timestamp"  # closed loop: "timestamp" (benchmark) or "session_id"

    def __post_init__(self) -> None:
        if self.mode not in ("closed", "open"):
            raise ValueError(f"mode must be 'closed' or 'open', got {self.mode!r}")
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.speedup <= 0 or self.think_scale < 0 or self.think_cap_ms < 0:
            raise ValueError("speedup must be > 0, think_scale and think_cap_ms >= 0")
        if self.session_order not in ("timestamp", "session_id"):
            raise ValueError("session_order must be 'timestamp' or 'session_id'")
        if self.recycle and self.max_requests is None and self.duration_s is None:
            raise ValueError("recycling sessions needs max_requests or duration_s")

    @classmethod
    def from_run_config(cls, rc: Any) -> ReplayConfig:
        """The replay a benchmark ``RunConfig`` describes."""
        return cls(mode=rc.mode, concurrency=rc.concurrency, think_cap_ms=rc.think_cap_ms,
                   think_scale=rc.think_scale, ramp_s=rc.ramp_s, sample_start_turn=rc.sample_start_turn,
                   recycle=rc.recycle, max_requests=rc.max_requests, duration_s=rc.duration_s,
                   warmup_requests=rc.warmup_requests, warmup_s=rc.warmup_s, run_salt=rc.run_salt,
                   seed=rc.seed, speedup=rc.speedup)


def group_sessions(requests: list[SimRequest], order: str = "timestamp") -> list[list[SimRequest]]:
    """Sessions in order of first appearance (by timestamp or by id), each sorted by turn."""
    key = (lambda r: r.timestamp_ms) if order == "timestamp" else (lambda r: (r.session_id, r.turn))
    sessions: dict[str, list[SimRequest]] = {}
    for r in sorted(requests, key=key):
        sessions.setdefault(r.session_id, []).append(r)
    out = list(sessions.values())
    for turns in out:
        turns.sort(key=lambda r: r.turn)
    return out


class _Lane:
    __slots__ = ("lane", "seed", "_rng", "first", "turns", "pos", "salt")

    def __init__(self, lane: int, seed: int):
        self.lane = lane
        self.seed = seed * 1_000_003 + lane
        self._rng: random.Random | None = None  # seeded on first use (only sampled start turns draw)
        self.first = True
        self.turns: list[SimRequest] = []
        self.pos = 0
        self.salt = 0

    @property
    def rng(self) -> random.Random:
        if self._rng is None:
            self._rng = random.Random(self.seed)
        return self._rng


class Driver:
    """Sends requests into a simulator according to a ``ReplayConfig``."""

    def __init__(self, sim: Simulator, requests: list[SimRequest], cfg: ReplayConfig):
        if not requests:
            raise ValueError("empty trace")
        self.sim = sim
        self.cfg = cfg
        self.requests = requests
        self.count = 0  # requests sent
        self.measured = 0  # measured requests sent
        self._sessions: list[list[SimRequest]] = []
        self._next = 0
        self._replay = 0
        self._lanes: list[_Lane] = []

    # ---- bounds ------------------------------------------------------------------
    def deadline(self) -> float:
        c = self.cfg
        return c.warmup_s + c.duration_s if c.duration_s is not None else float("inf")

    def may_start(self, now: float) -> bool:
        if now >= self.deadline():
            return False
        return self.cfg.max_requests is None or self.measured < self.cfg.max_requests

    def _send(self, now: float, req: SimRequest, salt: int, lane: int, force_warmup: bool = False,
              last: bool = False) -> None:
        self.count += 1
        c = self.cfg
        warmup = force_warmup or self.count <= c.warmup_requests or now < c.warmup_s
        if not warmup:
            self.measured += 1
        self.sim.send(now, req, salt, lane, warmup, last)

    # ---- start -------------------------------------------------------------------------
    def start(self) -> None:
        c = self.cfg
        if c.mode == "open":
            ordered = sorted(self.requests, key=lambda r: r.timestamp_ms)
            t0 = ordered[0].timestamp_ms
            salt = c.run_salt << 16
            for r in ordered:
                self.sim.schedule((r.timestamp_ms - t0) / 1000.0 / c.speedup, self._open_send, r, salt)
            return
        self._sessions = group_sessions(self.requests, c.session_order)
        for i in range(c.concurrency):
            lane = _Lane(i, c.seed)
            self._lanes.append(lane)
            t = i * c.ramp_s / c.concurrency + i * c.lane_stagger_s
            self.sim.schedule(t, self._lane_next_session, lane)

    def _open_send(self, now: float, req: SimRequest, salt: int) -> None:
        if self.may_start(now):
            self._send(now, req, salt, -1)

    # ---- closed loop -------------------------------------------------------------------------
    def _take_session(self) -> tuple[list[SimRequest], int] | None:
        if self._next == len(self._sessions):
            if not self.cfg.recycle:
                return None
            self._next, self._replay = 0, self._replay + 1
        turns = self._sessions[self._next]
        self._next += 1
        return turns, (self.cfg.run_salt << 16) | self._replay

    def _lane_next_session(self, now: float, lane: _Lane) -> None:
        if not self.may_start(now):
            return
        item = self._take_session()
        if item is None:
            return
        turns, salt = item
        start = lane.rng.randrange(len(turns)) if lane.first and self.cfg.sample_start_turn else 0
        lane.turns, lane.pos, lane.salt = turns, start, salt
        self._lane_send(now, lane)

    def _lane_send(self, now: float, lane: _Lane) -> None:
        if not self.may_start(now):
            return
        req = lane.turns[lane.pos]
        force = lane.first and self.cfg.sample_start_turn
        lane.first = False
        self._send(now, req, lane.salt, lane.lane, force, last=lane.pos == len(lane.turns) - 1)

    def on_finished(self, now: float, lane_id: int) -> None:
        """A closed-loop lane's request ended: its next turn, or its next session."""
        if lane_id < 0 or not self._lanes:
            return
        lane = self._lanes[lane_id]
        lane.pos += 1
        if lane.pos >= len(lane.turns):
            self.sim.session_done(lane.turns[0].session_id, lane.salt)
            self._lane_next_session(now, lane)
            return
        c = self.cfg
        req = lane.turns[lane.pos]
        think = min(req.delay_ms, c.think_cap_ms) * c.think_scale / 1000.0
        wait = min(think, self.deadline() - now)
        if wait > 0:
            self.sim.schedule(now + wait, self._lane_send, lane)
        else:
            self._lane_send(now, lane)
