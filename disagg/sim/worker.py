"""A simulated engine replica: chunked prefill + continuous-batching decode.

Each step the worker takes up to ``max_prefill_tokens_per_step`` prompt
tokens from its prefill queue (FIFO, several jobs may share a step) and one
decode token for every running sequence:

    step = [prefill part: a + sum_j cost(n_j, ctx_j) + loads of jobs starting]
         + k * decode_step(batch, sum context)

With no prefill work the worker runs k > 1 decode steps as one event (k up
to the first sequence that finishes, at most ``macro_steps``); new work
cuts such a macro step at the next step boundary, so arrivals wait at most
one decode step, as in a real engine.

    time ->  |prefill+dec|dec|dec|dec|dec|     (one macro event of 4 decode steps)
                               ^ arrival: macro cut after the current step

NOTES
1. ``queued_prefill_tokens`` == sum over queued jobs of (prompt_len - computed).
2. A job's resume point is fixed when it is admitted (its state is pinned).
3. A decode sequence leaves the batch the step its last token is produced.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from disagg.sim.cache import LRUTier
from disagg.sim.cost_model import CostModel

if TYPE_CHECKING:
    from disagg.sim.simulator import Simulator


@dataclass(slots=True, repr=False)
class SimJob:
    """One request's life on the workers."""

    rid: str  # request id
    prompt_len: int  # prompt tokens
    output_len: int  # tokens to generate
    digests: list[bytes]  # chained digests of the full blocks
    record: object  # RequestRecord (filled as the job progresses)
    cached: int = 0  # resumed tokens
    computed: int = 0  # prompt tokens processed (starts at cached)
    load_s: float = 0.0  # transfer time paid in the first prefill step
    decode_worker: SimWorker | None = None  # None: decode where it was prefilled
    decoded: int = 0  # tokens produced
    context: int = 0  # tokens in the sequence

    def __repr__(self) -> str:
        return f"SimJob({self.rid}, prompt={self.prompt_len}, cached={self.cached}, computed={self.computed})"


@dataclass(slots=True, repr=False)
class SimWorker:
    worker_id: str  # stable id
    node_id: str  # node (host/disk tiers shared per node)
    role: str  # "prefill" | "decode" | "both"
    cost: CostModel  # engine cost model
    device: LRUTier  # device cache (blocks)
    sim: Simulator  # owner (events, caches, finishing)
    macro_steps: int = 16  # max decode steps per event
    prefill_q: deque = field(default_factory=deque)  # SimJob awaiting/in prefill
    decode_wait: deque = field(default_factory=deque)  # SimJob awaiting a decode slot
    decode_run: list = field(default_factory=list)  # SimJob in the decode batch
    queued_prefill_tokens: int = 0  # see NOTE 1
    busy: bool = False
    version: int = 0  # invalidates superseded step-end events
    step_start: float = 0.0
    step_dt: float = 0.0  # one decode step in the current step
    step_n: int = 0  # decode steps in the current step
    step_prefill: list = field(default_factory=list)  # (job, tokens) in the current step
    q_area: float = 0.0  # integral of queued_prefill_tokens over time
    q_last_t: float = 0.0
    prefill_tokens_done: int = 0  # prompt tokens computed here
    busy_s: float = 0.0  # time spent in steps

    # ---- accounting --------------------------------------------------------
    def _account(self, now: float) -> None:
        self.q_area += self.queued_prefill_tokens * (now - self.q_last_t)
        self.q_last_t = now

    def decode_tokens(self) -> int:
        return sum(j.context for j in self.decode_run) + sum(j.context for j in self.decode_wait)

    # ---- work intake ---------------------------------------------------------
    def enqueue_prefill(self, job: SimJob, now: float) -> None:
        self._account(now)
        self.prefill_q.append(job)
        self.queued_prefill_tokens += job.prompt_len - job.computed
        self.kick(now)

    def enqueue_decode(self, job: SimJob, now: float) -> None:
        self.decode_wait.append(job)
        self.kick(now)

    def kick(self, now: float) -> None:
        """New work: start a step, or cut a running macro decode step."""
        if not self.busy:
            self._start_step(now)
            return
        if self.step_prefill or self.step_n <= 1:
            return
        done = math.floor((now - self.step_start) / self.step_dt + 1e-9) + 1
        if done < self.step_n:
            self.step_n = done
            self.version += 1
            self.sim.schedule(self.step_start + done * self.step_dt, self._end_step, self.version)

    # ---- steps -------------------------------------------------------------------
    def _start_step(self, now: float) -> None:
        cost = self.cost
        while self.decode_wait and len(self.decode_run) < cost.max_decode_batch:
            self.decode_run.append(self.decode_wait.popleft())
        budget = cost.max_prefill_tokens_per_step
        chunks: list[tuple[SimJob, int]] = []
        prefill_s = 0.0
        for job in self.prefill_q:
            if budget <= 0:
                break
            n = min(job.prompt_len - job.computed, budget)
            if job.computed == job.cached:
                prefill_s += job.load_s
            prefill_s += cost.prefill_job_time(n, job.computed)
            chunks.append((job, n))
            budget -= n
        if chunks:
            prefill_s += cost.prefill_base_s
        batch = len(self.decode_run)
        dt = cost.decode_step_time(batch, sum(j.context for j in self.decode_run)) if batch else 0.0
        if not chunks and not batch:
            self.busy = False
            return
        if chunks:
            n_steps = 1 if batch else 0
        else:
            n_steps = min(self.macro_steps, min(j.output_len - j.decoded for j in self.decode_run))
        self.busy = True
        self.step_start = now
        self.step_dt = dt
        self.step_n = n_steps
        self.step_prefill = chunks
        self.version += 1
        self.sim.schedule(now + prefill_s + n_steps * dt, self._end_step, self.version)

    def _end_step(self, now: float, version: int) -> None:
        if version != self.version:
            return
        self.busy_s += now - self.step_start
        if self.step_n:
            for job in list(self.decode_run):
                job.decoded += self.step_n
                job.context += self.step_n
                if job.decoded >= job.output_len:
                    self.decode_run.remove(job)
                    self.sim.finish(job, self, now)
        if self.step_prefill:
            self._account(now)
            for job, n in self.step_prefill:
                job.computed += n
                self.queued_prefill_tokens -= n
                self.prefill_tokens_done += n
                assert self.queued_prefill_tokens >= 0, "negative prefill queue"
                if job.computed >= job.prompt_len:
                    self.prefill_q.remove(job)
                    self.sim.prefill_done(job, self, now)
        self.busy = False
        self._start_step(now)
