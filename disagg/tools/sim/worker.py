"""A simulated engine replica: chunked prefill + continuous-batching decode.

Each step packs one decode token for every running sequence and prefill
chunks (FIFO, several jobs may share a step) into the step's token budget,
as the reference engine and vLLM do::

    budget = max_prefill_tokens_per_step - batch          decodes count one token each
    chunk  = min(left, budget), cut to a block boundary when it does not finish the prompt
    step   = [a + sum_j cost(n_j, ctx_j)]  +  k * decode_step(batch, sum context)

With no prefill work the worker runs k > 1 decode steps as one event (k up
to the first sequence that finishes, at most ``macro_steps``); new work cuts
such a macro step at the next step boundary, so arrivals wait at most one
decode step, as in a real engine::

    time ->  |prefill+dec|dec|dec|dec|dec|     (one macro event of 4 decode steps)
                               ^ arrival: macro cut after the current step

Decode bookkeeping is O(log batch) per event: a sequence that joins the
batch when the worker has run S0 decode steps, with context c0 and r tokens
to go, has context c0 + (S - S0) at step count S and finishes at step
S0 + r (a heap keyed by that step). Over k steps from S with batch B::

    sum context(S) = sum_j (c0_j - S0_j) + B * S
    time(k)        = k * decode_step(B, sum context(S)) + f * B * k * (k - 1) / 2

(f: the cost model's per-context-token decode cost), exactly the sum of the
k single steps.

NOTES
1. ``queued_prefill_tokens`` == sum over queued jobs of (prompt_len - computed).
2. A job's resume point is fixed when it is admitted (its state is pinned).
3. A decode sequence leaves the batch the step its last token is produced.
4. ``state`` (the ``WorkerState`` the router reads) is updated in place after
   every change of this worker; ``running_decode_tokens`` is exact at step
   boundaries.
5. Engines of one node may share its compute (``node_compute_slots``, e.g. CPU
   replicas on one machine), as processor sharing: while n engines of the node
   are busy (in a step), each progresses through its step's cost at rate
   1 / max(1, n / slots); n = 1 runs at its cost (an engine alone is what the
   profile timed). A step's cost is in seconds of the engine alone; when n
   changes (an engine of the node starts or ends its work) every busy engine's
   step end is re-timed from the cost it has left::

       engine A  |=========== long prefill step ===========|
       engine B        |== short ==|                          n = 2 in between:
       A's rate  1      1/s'        1                         both at 1 / s'

   (Fixing each step's factor when it starts charged the whole overlap to the
   step that started second: a short step started under a long one paid for
   all of it, the long one for none.) A macro decode step cut by new work is
   cut by the cost done so far.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from disagg.costs.model import CostModel
from disagg.router.types import WorkerState
from disagg.tools.sim.cache import LRUTier

if TYPE_CHECKING:
    from disagg.tools.sim.state import PromptState


class Simulator(Protocol):
    """What a worker needs of ``disagg.tools.sim.simulator.Simulator``: its clock, and where to report."""

    now: float  # the simulated time

    def schedule(self, t: float, fn: Callable[..., None], *args: Any) -> None: ...

    def busy_changed(self, w: SimWorker, now: float) -> None: ...

    def node_slowdown(self, w: SimWorker) -> float: ...

    def admit(self, job: SimJob, w: SimWorker, now: float) -> int: ...

    def chunk_done(self, job: SimJob, w: SimWorker, now: float) -> None: ...

    def prefill_done(self, job: SimJob, w: SimWorker, now: float) -> None: ...

    def finish(self, job: SimJob, w: SimWorker, now: float) -> None: ...


@dataclass(slots=True, repr=False)
class SimJob:
    """One request's life on the workers."""

    rid: str  # request id
    prompt_len: int  # prompt tokens
    output_len: int  # tokens to generate
    prompt: PromptState  # digests and resume probes of the prompt
    record: Any  # RequestRecord (filled as the job progresses)
    request: Any = None  # the SimRequest
    cached: int = 0  # resumed tokens
    computed: int = 0  # prompt tokens processed (starts at cached)
    decode_worker: SimWorker | None = None  # None: decode where it was prefilled
    ckpts: list[bytes] = field(default_factory=list)  # checkpoint keys the prefill stored
    extra: tuple[int, ...] = ()  # extra checkpoint positions for the prefill (learned placement)
    extra_kinds: dict[bytes, str] | None = None  # their keys -> placement kind (Simulator NOTE 10)
    speculative: list[bytes] = field(default_factory=list)  # keys of its start-prior points (retention)
    context: int = 0  # tokens in the sequence when it joins the decode batch
    remaining: int = 0  # tokens to produce when it joins
    join_step: int = 0  # worker decode-step count at join
    end_step: int = 0  # worker decode-step count of its last token
    decode_from: float = 0.0  # when its decode began (its first token on its decode worker)

    def __repr__(self) -> str:
        return f"SimJob({self.rid}, prompt={self.prompt_len}, cached={self.cached}, computed={self.computed})"


class SimWorker:
    def __init__(self, worker_id: str, node_id: str, role: str, cost: CostModel, device: LRUTier,
                 sim: Simulator, macro_steps: int = 16, block_size: int = 256):
        self.worker_id = worker_id
        self.node_id = node_id
        self.role = role
        self.cost = cost
        self.device = device
        self.sim = sim
        self.macro_steps = macro_steps
        self.block_size = block_size
        self.state = WorkerState(worker_id, role, node_id, device_tokens=device.capacity * block_size)  # NOTE 4
        self.prefill_q: deque[SimJob] = deque()
        self.decode_wait: deque[SimJob] = deque()
        self._batch: list[tuple[int, int, SimJob]] = []  # heap of (end_step, seq, job)
        self._seq = 0
        self.steps = 0  # decode steps run
        self._ctx_offset = 0  # sum over the batch of (context - join_step)
        self._wait_ctx = 0  # sum of contexts waiting for a slot
        self.inbound = 0  # P/D: requests whose decode comes here, prefilling in the pool or handing off
        self.inbound_tokens = 0  # their prompt tokens
        self.queued_prefill_tokens = 0  # NOTE 1
        self.busy = False
        self.version = 0  # invalidates superseded step-end events
        self.step_start = 0.0
        self.step_n = 0  # decode steps in the current step
        self.step_s0 = 0.0  # sum context at the start of the current step
        self.step_dt = 0.0  # first decode step's time in the current step
        self.step_a = 0.0  # growth of each further decode step's time, halved (f * batch / 2)
        self.step_prefill_s = 0.0  # prefill part of the current step
        self.step_rate = 1.0  # cost-seconds per second the current step progresses at (NOTE 5)
        self.step_w_t = 0.0  # time of the current step's last rate change (its start at first)
        self.step_w_done = 0.0  # cost-seconds of the current step done by step_w_t
        self.step_prefill: list[tuple[SimJob, int]] = []  # (job, tokens) in the current step
        self.q_area = 0.0  # integral of queued_prefill_tokens over time
        self.q_last_t = 0.0
        self.prefill_tokens_done = 0  # prompt tokens computed here
        self.decode_tokens_done = 0  # tokens generated here (decode steps x batch)
        self.busy_s = 0.0  # time spent in steps

    @property
    def batch_size(self) -> int:
        return len(self._batch)

    # ---- accounting --------------------------------------------------------
    def _account(self, now: float) -> None:
        self.q_area += self.queued_prefill_tokens * (now - self.q_last_t)
        self.q_last_t = now

    def decode_tokens(self) -> int:
        """Context tokens of running and waiting decodes."""
        return self._ctx_offset + len(self._batch) * self.steps + self._wait_ctx

    def _publish(self) -> None:
        s = self.state
        s.queued_prefill_tokens = self.queued_prefill_tokens
        s.queued_prefill_requests = len(self.prefill_q)
        s.running_decode_tokens = self.decode_tokens()
        s.running_decode_requests = len(self._batch) + len(self.decode_wait)
        s.inbound_decode_requests, s.inbound_decode_tokens = self.inbound, self.inbound_tokens
        u = self.device.used / self.device.capacity if self.device.capacity else 1.0
        s.cache_utilization = u if u < 1.0 else 1.0
        s.updated_at = self.sim.now

    # ---- work intake ---------------------------------------------------------
    def expect(self, now: float, prompt_len: int, n: int = 1) -> None:
        """A request's decode will come here after its prefill in the pool (``n`` = 1), or it
        arrived (-1): what a serving decode worker, which takes the request first, reports."""
        self._account(now)
        self.inbound += n
        self.inbound_tokens += n * prompt_len
        assert self.inbound >= 0 and self.inbound_tokens >= 0, "negative inbound decodes"
        self._publish()

    def enqueue_prefill(self, now: float, job: SimJob) -> None:
        self._account(now)
        self.prefill_q.append(job)
        self.queued_prefill_tokens += job.prompt_len - job.computed
        self._publish()
        self.kick(now)

    def enqueue_decode(self, now: float, job: SimJob) -> None:
        """``job.context`` / ``job.remaining`` set by the caller."""
        self.decode_wait.append(job)
        self._wait_ctx += job.context
        self._publish()
        self.kick(now)

    def kick(self, now: float) -> None:
        """New work: start a step, or cut a running macro decode step."""
        if not self.busy:
            self._start_step(now)
            return
        if self.step_prefill or self.step_n <= 1:
            return
        done = self._steps_by(self._progress(now)) + 1  # the step in progress completes
        if done < self.step_n:
            self.step_n = done
            self.version += 1
            self.sim.schedule(self._end_time(done), self._end_step, self.version)

    # ---- compute sharing (NOTE 5) ----------------------------------------------------
    def _progress(self, now: float) -> float:
        """Cost-seconds of the current step done by ``now``."""
        if self.step_w_done == 0.0 and self.step_rate == 1.0:  # never re-timed: as without sharing
            return now - self.step_start
        return self.step_w_done + (now - self.step_w_t) * self.step_rate

    def _end_time(self, n_steps: int) -> float:
        """When the current step ends with ``n_steps`` decode steps, at the current rate."""
        if self.step_w_done == 0.0 and self.step_rate == 1.0:
            return self.step_start + self.step_prefill_s + self._decode_time(n_steps)
        left = self.step_prefill_s + self._decode_time(n_steps) - self.step_w_done
        return self.step_w_t + max(left, 0.0) / self.step_rate

    def rerate(self, now: float, rate: float) -> None:
        """The node's busy engines changed: the rest of the current step runs at ``rate``."""
        if not self.busy or rate == self.step_rate:
            return
        self.step_w_done += (now - self.step_w_t) * self.step_rate
        self.step_w_t = now
        self.step_rate = rate
        self.version += 1
        self.sim.schedule(max(self._end_time(self.step_n), now), self._end_step, self.version)

    # ---- steps -------------------------------------------------------------------
    def _decode_time(self, k: int) -> float:
        return k * self.step_dt + self.step_a * k * (k - 1)

    def _steps_by(self, elapsed: float) -> int:
        """Decode steps of the current macro step completed ``elapsed`` seconds after it started.

        The largest j with time(j) <= elapsed, time(j) = j * dt + a * j * (j - 1), a = f * B / 2.
        """
        dt, a = self.step_dt, self.step_a
        if dt <= 0:
            return self.step_n
        if a <= 0:
            j = math.floor(elapsed / dt + 1e-9)
        else:
            b = dt - a
            j = math.floor((-b + math.sqrt(b * b + 4 * a * elapsed)) / (2 * a) + 1e-9)
            while j > 0 and self._decode_time(j) > elapsed + 1e-12:  # guard the float root
                j -= 1
            while self._decode_time(j + 1) <= elapsed + 1e-12:
                j += 1
        return max(0, j)

    def _admit_decodes(self) -> None:
        cap = self.cost.max_decode_batch
        batch = self._batch
        while self.decode_wait and len(batch) < cap:
            job = self.decode_wait.popleft()
            self._wait_ctx -= job.context
            job.join_step = self.steps
            job.end_step = self.steps + job.remaining
            self._ctx_offset += job.context - self.steps
            self._seq += 1
            heapq.heappush(batch, (job.end_step, self._seq, job))

    def _chunk(self, job: SimJob, budget: int) -> int:
        """Tokens of ``job``'s prompt this step's ``budget`` computes (a partial chunk ends on a block
        boundary: 0 when none fits)."""
        left = job.prompt_len - job.computed
        if left <= budget:
            return left
        bs = self.block_size
        return (job.computed + budget) // bs * bs - job.computed

    def _start_step(self, now: float) -> None:
        cost = self.cost
        self._admit_decodes()
        batch = len(self._batch)
        budget = cost.max_prefill_tokens_per_step - batch
        chunks: list[tuple[SimJob, int]] = []
        prefill_s = 0.0
        for job in self.prefill_q:
            if budget <= 0:
                break
            n = self._chunk(job, budget)
            if n <= 0:
                break
            if job.record.admitted < 0:  # it starts now: the engine looks its device up again
                gain = self.sim.admit(job, self, now)
                if gain:
                    job.cached += gain
                    job.computed += gain
                    self.queued_prefill_tokens -= gain
                    n = self._chunk(job, budget)
                    if n <= 0:  # admitted, its first chunk next step
                        break
            prefill_s += cost.prefill_job_time(n, job.computed)
            chunks.append((job, n))
            budget -= n
        if not chunks and not batch:
            if self.busy:
                self.busy = False
                self.sim.busy_changed(self, now)
            return
        s0 = self._ctx_offset + batch * self.steps
        started = not self.busy
        self.busy = True
        dt = cost.decode_step_time(batch, s0) if batch else 0.0
        self.step_a = cost.decode_per_ctx_token_s * batch / 2
        if chunks:
            prefill_s = prefill_s + cost.prefill_base_s
            n_steps = 1 if batch else 0
        else:
            n_steps = min(self.macro_steps, self._batch[0][0] - self.steps)
        self.step_start = now
        self.step_dt = dt
        self.step_s0 = s0
        self.step_n = n_steps
        self.step_prefill = chunks
        self.step_prefill_s = prefill_s
        self.step_rate = 1.0 / self.sim.node_slowdown(self)  # engines of a node sharing its compute (NOTE 5)
        self.step_w_t = now
        self.step_w_done = 0.0
        self.version += 1
        self.sim.schedule(self._end_time(n_steps), self._end_step, self.version)
        if started:
            self.sim.busy_changed(self, now)

    def _end_step(self, now: float, version: int) -> None:
        if version != self.version:
            return
        self.busy_s += now - self.step_start
        if self.step_n:
            self.steps += self.step_n
            self.decode_tokens_done += self.step_n * len(self._batch)
            batch = self._batch
            while batch and batch[0][0] <= self.steps:
                _, _, job = heapq.heappop(batch)
                self._ctx_offset -= job.context - job.join_step
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
                else:  # a chunk of a prefill still running (Simulator NOTE 11)
                    self.sim.chunk_done(job, self, now)
        self._publish()
        self._start_step(now)  # busy until it finds no work (NOTE 5)
