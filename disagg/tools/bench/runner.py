"""Trace replay: closed-loop lanes, open-loop timestamps, concurrency sweeps.

Closed loop (concurrency C): C lanes each replay one session turn by turn.
The next turn is sent ``min(delay, think_cap_ms) * think_scale`` after the
previous response ended; the prompt always comes from the trace (the
server's own output is discarded). A lane whose session ends takes the next
unstarted session; when all have been taken, sessions are replayed again
with a new cache-busting salt (``recycle``)::

    lane 0  [s0 t0]--think--[s0 t1]--think--[s0 t2] [s3 t0]--think-- ...
    lane 1  [s1 t0]--think--[s1 t1] [s2 t0]--think--[s2 t1] ...
            |<- warm-up ->|<---------- measured window ---------->|

Warm-up: requests sent before ``warmup_s`` or among the first
``warmup_requests`` are flagged and excluded from metrics. With
``sample_start_turn`` each lane's first session starts at a random turn (its
whole context is cold), and that first request is warm-up too.
Bounds: ``duration_s`` of measurement after warm-up and/or ``max_requests``
measured requests; then lanes stop starting new requests and in-flight ones
finish.

Open loop: every record is sent at ``timestamp / speedup`` after the start,
whatever the state of earlier requests.

``session_end``: each session's last turn in the trace says so (the server's
``session_end`` extension, which evicts the session's state first once it is
answered), as a client that knows its task is done would. ``delete_sessions``:
once a session's last turn is answered, the client ends it with ``DELETE
/v1/sessions/{id}`` (the same extension after the fact), as one that learns of
the end only then would; a refused delete is counted (``sessions_delete_failed``).

Salts: a replay's salt is ``run_salt << 16 | replay_number``; salt 0 is the
trace as written (see ``tokens.py`` for what a salt changes).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

from tqdm.auto import tqdm

from disagg.tools.bench.client import OpenAIClient, RequestResult
from disagg.tools.bench.tokens import TokenFactory
from disagg.tools.bench.trace import TraceRecord, group_sessions

_INLINE_TOKENS = 8192  # build bodies of longer prompts in a worker thread


@dataclass(slots=True)
class RunConfig:
    """How to replay a trace once."""

    mode: Literal["closed", "open"] = "closed"
    concurrency: int = 1  # closed-loop lanes
    duration_s: float | None = None  # measured seconds after warm-up (None: no time bound)
    max_requests: int | None = None  # measured requests to send (None: no count bound)
    warmup_s: float = 0.0  # requests sent before this are warm-up
    warmup_requests: int = 0  # the first N requests are warm-up
    think_cap_ms: float = 30_000.0  # closed loop: cap on a turn's think time
    think_scale: float = 1.0  # closed loop: multiplies think time (0: back-to-back)
    speedup: float = 1.0  # open loop: timestamps are divided by this
    recycle: bool = True  # closed loop: replay sessions again (new salt) when they run out
    sample_start_turn: bool = False  # closed loop: each lane's first session starts mid-way
    ramp_s: float = 0.0  # closed loop: lane i starts at i * ramp_s / C
    run_salt: int = 0  # cache-busting salt base of this run
    seed: int = 0  # sampled start turns
    progress: bool = True  # show a tqdm bar
    label: str = ""  # name of the run in reports
    session_end: bool = False  # each session's last turn sends session_end (module docstring)
    delete_sessions: bool = False  # after each session's last turn, DELETE /v1/sessions/{id} (module docstring)

    def __post_init__(self) -> None:
        if self.mode not in ("closed", "open"):
            raise ValueError(f"mode must be 'closed' or 'open', got {self.mode!r}")
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.speedup <= 0 or self.think_scale < 0:
            raise ValueError("speedup must be > 0 and think_scale >= 0")
        if (
            self.mode == "closed"
            and self.recycle
            and self.duration_s is None
            and self.max_requests is None
        ):
            raise ValueError("recycling sessions needs duration_s or max_requests")


@dataclass(slots=True)
class RunOutput:
    """Results of one replay."""

    config: RunConfig
    results: list[RequestResult]
    started_ns: int  # perf_counter_ns at the start
    theoretical_hit: float | None = None  # infinite-cache hit rate of the replayed prompts
    theoretical_tokens_all: int = 0  # infinite-cache hit tokens over every successful request (warm-up too)
    sessions_deleted: int = 0  # DELETE /v1/sessions/{id} sent (delete_sessions)
    sessions_delete_failed: int = 0  # ... of which the server did not take

    def config_dict(self) -> dict:
        return asdict(self.config)


class _Sessions:
    """Hands out sessions in trace order; recycles them with a new salt."""

    def __init__(self, records: Sequence[TraceRecord], recycle: bool, run_salt: int) -> None:
        self.sessions = list(group_sessions(sorted(records, key=lambda r: r.timestamp)).values())
        self.recycle, self.run_salt = recycle, run_salt
        self.index = self.replay = 0

    def next(self) -> tuple[list[TraceRecord], int] | None:
        if self.index == len(self.sessions):
            if not self.recycle:
                return None
            self.index, self.replay = 0, self.replay + 1
        turns = self.sessions[self.index]
        self.index += 1
        return turns, (self.run_salt << 16) | self.replay


class Replayer:
    """Replays a trace against one client (one run)."""

    def __init__(self, client: OpenAIClient, tokens: TokenFactory, config: RunConfig,
                 seen: dict[int, int] | None = None) -> None:
        self.client, self.tokens, self.cfg = client, tokens, config
        self.results: list[RequestResult] = []
        # salted block key -> most tokens of it sent so far (the infinite cache). A sweep shares one
        # across its runs: each run's salt renames session blocks, so only the shared prefix carries
        # over, as it does in the server's cache.
        self._seen: dict[int, int] = {} if seen is None else seen
        self._hits = self._blocks = 0  # over measured requests
        self._all_hits = 0  # over every successful request (the server's counters see them all)
        self._count = 0
        self._measured = 0
        self.sessions_deleted = self.sessions_delete_failed = 0  # delete_sessions (module docstring)
        self._t0 = 0
        self._bar: tqdm | None = None

    # -- shared pieces -------------------------------------------------------
    def _now_s(self) -> float:
        return (time.perf_counter_ns() - self._t0) / 1e9

    def _deadline_s(self) -> float:
        return (
            self.cfg.warmup_s + self.cfg.duration_s
            if self.cfg.duration_s is not None
            else float("inf")
        )

    def _may_start(self) -> bool:
        if self._now_s() >= self._deadline_s():
            return False
        return self.cfg.max_requests is None or self._measured < self.cfg.max_requests

    def _claim(self, force_warmup: bool = False) -> tuple[int, bool]:
        """Count a request the moment it is decided (before any await, so concurrent lanes and
        open-loop tasks see the bounds at once): (its number, whether it is warm-up)."""
        self._count += 1
        warmup = (
            force_warmup
            or self._count <= self.cfg.warmup_requests
            or self._now_s() < self.cfg.warmup_s
        )
        if not warmup:
            self._measured += 1
        return self._count, warmup

    async def _body(self, rec: TraceRecord, salt: int, last: bool = False) -> bytes:
        def build() -> bytes:
            if self.client.prompt_mode == "text":
                prompt = self.tokens.prompt_text(rec, salt)
            else:
                prompt = self.tokens.prompt_ids(rec, salt)
            return self.client.build_body(
                prompt, rec.output_length, f"{rec.session_id}#{salt}", last and self.cfg.session_end
            )

        if rec.input_length > _INLINE_TOKENS:
            return await asyncio.to_thread(build)
        return build()

    async def _send(
        self, rec: TraceRecord, salt: int, lane: int, claim: tuple[int, bool], last: bool = False
    ) -> None:
        number, warmup = claim
        rid = f"{self.cfg.label or 'run'}-{number}"
        keys = self.tokens.block_keys(rec.hash_ids, salt).tolist()
        hits = self._infinite_cache_hit(keys, rec)  # tokens, as the request is sent
        body = await self._body(rec, salt, last)
        result = await self.client.send(body, rid)
        if result.ok:
            self._all_hits += hits
        if not warmup and result.ok:  # over the requests the usage hit rate covers too
            self._hits += hits
            self._blocks += rec.input_length  # prompt tokens (the usage hit's unit)
        result.session_id, result.turn, result.lane, result.salt = (
            rec.session_id,
            rec.turn,
            lane,
            salt,
        )
        result.input_length, result.expected_output, result.warmup = (
            rec.input_length,
            rec.output_length,
            warmup,
        )
        self.results.append(result)
        if last and self.cfg.delete_sessions and result.ok:  # after the turn's figures are taken
            self.sessions_deleted += 1
            if not await self.client.end_session(f"{rec.session_id}#{salt}"):
                self.sessions_delete_failed += 1
        if self._bar is not None:
            self._bar.update(1)
            if result.error:
                self._bar.set_postfix(failed=sum(1 for r in self.results if r.error), refresh=False)

    def _infinite_cache_hit(self, keys: list[int], rec: TraceRecord) -> int:
        """Prompt tokens an infinite prefix cache would reuse, in tokens like the usage hit: the
        leading blocks seen before, a partial block counting the tokens of it seen, never the
        prompt's last token (its logits give the first output token). Records this prompt."""
        bs = rec.effective_block_size(self.tokens.block_size)
        hit, prefix = 0, True
        for i, k in enumerate(keys):
            n = min(bs, rec.input_length - i * bs)
            if prefix:
                got = min(n, self._seen.get(k, 0))
                hit += got
                prefix = got == n
            self._seen[k] = max(n, self._seen.get(k, 0))
        return min(hit, rec.input_length - 1)

    # -- closed loop ----------------------------------------------------------
    async def _lane(self, lane: int, sessions: _Sessions) -> None:
        cfg = self.cfg
        if cfg.ramp_s > 0:
            await asyncio.sleep(lane * cfg.ramp_s / cfg.concurrency)
        rng = random.Random(cfg.seed * 1_000_003 + lane)
        first = True
        while self._may_start():
            item = sessions.next()
            if item is None:
                return
            turns, salt = item
            start = rng.randrange(len(turns)) if first and cfg.sample_start_turn else 0
            todo = turns[start:]
            for k, rec in enumerate(todo):
                if k > 0:
                    think = min(rec.delay, cfg.think_cap_ms) * cfg.think_scale / 1000.0
                    wait = min(think, self._deadline_s() - self._now_s())
                    if wait > 0:
                        await asyncio.sleep(wait)
                if not self._may_start():
                    return
                await self._send(
                    rec, salt, lane, self._claim(first and cfg.sample_start_turn), k == len(todo) - 1
                )
                first = False

    # -- open loop --------------------------------------------------------------
    async def _open(self, records: Sequence[TraceRecord]) -> None:
        ordered = sorted(records, key=lambda r: r.timestamp)
        last_turn: dict[str, int] = {}
        for rec in ordered:
            last_turn[rec.session_id] = max(rec.turn, last_turn.get(rec.session_id, rec.turn))
        t_first = ordered[0].timestamp
        tasks: set[asyncio.Task] = set()
        for rec in ordered:
            at = (rec.timestamp - t_first) / 1000.0 / self.cfg.speedup
            delay = at - self._now_s()
            if delay > 0:
                await asyncio.sleep(delay)
            if not self._may_start():
                break
            last = rec.turn == last_turn[rec.session_id]
            task = asyncio.create_task(
                self._send(rec, self.cfg.run_salt << 16, -1, self._claim(), last)
            )
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    async def run(self, records: Sequence[TraceRecord]) -> RunOutput:
        if not records:
            raise ValueError("empty trace")
        cfg = self.cfg
        total = None
        if cfg.max_requests is not None:
            total = cfg.max_requests + cfg.warmup_requests
        elif cfg.mode == "open" or not cfg.recycle:
            total = len(records)
        self._bar = tqdm(
            total=total,
            unit="req",
            desc=cfg.label or cfg.mode,
            leave=False,
            disable=not cfg.progress,
            dynamic_ncols=True,
        )
        self._t0 = time.perf_counter_ns()
        try:
            if cfg.mode == "open":
                await self._open(records)
            else:
                sessions = _Sessions(records, cfg.recycle, cfg.run_salt)
                await asyncio.gather(*(self._lane(i, sessions) for i in range(cfg.concurrency)))
        finally:
            self._bar.close()
            self._bar = None
        hit = self._hits / self._blocks if self._blocks else None
        return RunOutput(cfg, self.results, self._t0, hit, self._all_hits, self.sessions_deleted,
                         self.sessions_delete_failed)


async def replay(
    client: OpenAIClient,
    tokens: TokenFactory,
    records: Sequence[TraceRecord],
    config: RunConfig,
    seen: dict[int, int] | None = None,
) -> RunOutput:
    """Run one replay with an open client (``seen``: the sweep's infinite cache, see ``Replayer``)."""
    return await Replayer(client, tokens, config, seen).run(records)
