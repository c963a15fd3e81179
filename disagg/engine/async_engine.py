"""Asyncio front of a synchronous engine: one stepping thread, many streams.

    asyncio tasks  --add/abort/export-->  [lock]  engine  <--step-- stepping thread
         ^                                                     |
         +------ per-request asyncio.Queue <-- call_soon_threadsafe

A consumer that stops iterating (client disconnect, task cancellation) aborts
its request, which frees the request's blocks and slot on the next step.

It is the reference backend's ``disagg.flow.FlowEngine``: callers (the request
flow, the Serve replicas) use its methods, never the engine behind it.

NOTES
1. Every engine call happens under ``_lock``; the stepping thread holds it only
   for one step, so exports and admissions interleave with steps. ``call``
   hands its function to the stepping thread, which runs it before the next
   step (NOTE 5).
2. A request's queue receives exactly one final ``TokenOutput`` (finished=True).
3. ``trace(request_id)``: first-token stamps of the newest ``TRACE_CAPACITY``
   requests (``time.perf_counter`` seconds): ``admit``, ``step_start`` /
   ``step_end`` / ``step_cpu`` (CPU seconds) of the step that produced the
   first token, ``first_out`` (the consumer got it). Set by both threads, one
   key each, before the consumer reads them.
4. A consumer that leaves (closes its stream, or its task is cancelled) has its
   request aborted by the stepping thread before the next step (``abort_soon``):
   the consumer never awaits the abort, so it happens even while the consumer's
   task is being cancelled (an anyio cancel scope, e.g. Starlette's on a client
   disconnect, cancels every await of a ``finally`` block too).
5. ``call`` does not compete for ``_lock``: a thread blocked on it is woken when
   a step ends but needs the GIL, which the stepping thread keeps while it takes
   the lock again for its next step, so a waiting call could starve for as long
   as the engine stayed busy (16 steps, 0.56 s, measured on a CPU engine; on a
   GPU, publishing a prefill's state waited until every queued prefill was done).
   Calls queue instead and the stepping thread runs them between two steps, so a
   call waits at most for the step in progress. Once the thread has stopped,
   calls run in the caller's worker thread. Admissions (``generate``) are calls
   too: the event loop never blocks on the lock while a step runs. Calls run
   before the pending aborts, so a request whose consumer left while its
   admission was queued is aborted right after it is admitted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from disagg.engine.protocol import EngineRequest, TokenOutput

if TYPE_CHECKING:
    from kv_transfer.objects import ResumeState

TRACE_CAPACITY = 1024  # requests whose first-token stamps are kept (NOTE 3)


class AsyncEngine:
    keeps_state = True  # finished requests with keep_state stay held until release (disagg.flow)

    def __init__(self, engine, idle_wait_s: float = 0.05):
        self.engine = engine  # the synchronous engine: only this class touches it
        self.model_id = engine.model_id
        self.block_size = engine.block_size
        self.layout = engine.layout
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._aborts: deque[str] = deque()  # requests to abort before the next step (NOTE 4)
        self._calls: deque[tuple] = deque()  # (fn, args, kwargs, loop, future) to run before the next step (NOTE 5)
        self._stop = False
        self._idle_wait_s = idle_wait_s
        self.step_times: list[float] = []
        self._live_traces: dict[str, dict[str, float]] = {}  # request id -> stamps, until its first token
        self._traces: OrderedDict[str, dict[str, float]] = OrderedDict()  # finished requests (NOTE 3)
        self._thread = threading.Thread(target=self._loop, name="engine-step", daemon=True)
        self._thread.start()

    # -- stepping thread -----------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            with self._lock:
                self._run_calls()  # before the aborts: a request admitted by a call can be aborted at once
                while self._aborts:
                    self.engine.abort(self._aborts.popleft())
                busy = self.engine.has_work()
                if busy:
                    t0, c0 = time.perf_counter(), time.thread_time()
                    steps = self._steps()
                    try:
                        outputs = self.engine.step()
                    except Exception as exc:  # an engine bug must not hang its callers
                        outputs = self._fail_all(exc)
                    # Work it cannot run yet (it waits for blocks held for export): wait for a
                    # call or an abort to change that rather than spin on the lock.
                    stalled = not outputs and steps is not None and self._steps() == steps
                    t1 = time.perf_counter()
                    self.step_times.append(t1 - t0)
                    if self._live_traces:
                        self._stamp_first_step(outputs, t0, t1, time.thread_time() - c0)
                    if len(self.step_times) > 4096:
                        del self.step_times[:2048]
            if busy:
                for out in outputs:
                    self._deliver(out)
            if not busy or stalled:
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()

    def _steps(self) -> int | None:
        """The engine's count of model steps run, where it keeps one."""
        counters = getattr(self.engine, "counters", None)
        return counters.get("steps") if isinstance(counters, dict) else None

    def _run_calls(self) -> None:
        """Run every queued ``call`` (the caller holds ``_lock``) and settle its future."""
        while self._calls:
            fn, args, kwargs, loop, fut = self._calls.popleft()
            try:
                ok, value = True, fn(*args, **kwargs)
            except BaseException as exc:  # handed to the awaiting task, never raised here
                ok, value = False, exc
            if loop is None:  # call_blocking's
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)
                continue
            try:
                loop.call_soon_threadsafe(_settle, fut, ok, value)
            except RuntimeError:  # the caller's loop is gone
                pass

    def _stamp_first_step(self, outputs: list[TokenOutput], t0: float, t1: float, cpu: float) -> None:
        for out in outputs:
            trace = self._live_traces.pop(out.request_id, None) if out.new_token_ids else None
            if trace is not None:
                trace.update(step_start=t0, step_end=t1, step_cpu=cpu)

    def _fail_all(self, exc: Exception) -> list[TokenOutput]:
        outs = []
        for rid in list(self._queues):
            for o in self.engine.abort(rid) or []:
                outs.append(TokenOutput(rid, [], True, "error", o.num_prompt_tokens, error=repr(exc)))
        return outs

    def _deliver(self, out: TokenOutput) -> None:
        entry = self._queues.get(out.request_id)
        if entry is None:
            return
        loop, q = entry
        try:
            loop.call_soon_threadsafe(q.put_nowait, out)
        except RuntimeError:  # the consumer's loop is gone
            pass

    # -- asyncio side -------------------------------------------------------------------
    async def generate(self, request: EngineRequest, state: ResumeState | None = None) -> AsyncIterator[TokenOutput]:
        """Stream a request's outputs, resuming from ``state`` when given (it replaces
        ``request.resume``). Raises ValueError for a request the engine refuses."""
        if state is not None:
            request.resume = state
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[TokenOutput] = asyncio.Queue()
        rid = request.request_id
        if rid in self._queues:  # the live stream keeps its queue
            raise ValueError(f"duplicate request id {rid!r}")
        entry = self._queues[rid] = (loop, q)
        trace: dict[str, float] = {}

        def drop() -> None:  # only this call's entry
            if self._queues.get(rid) is entry:
                del self._queues[rid]

        def admit() -> None:
            self.engine.add_request(request)
            trace["admit"] = time.perf_counter()
            self._live_traces[request.request_id] = trace

        finished = False
        try:
            await self.call(admit)  # NOTE 5: the event loop never waits on the engine lock
        except asyncio.CancelledError:  # the admission may still run: abort it right after (NOTE 5)
            drop()
            self.abort_soon(request.request_id)
            raise
        except Exception:  # refused: nothing was admitted
            drop()
            raise
        try:
            while True:
                out = await q.get()
                finished = out.finished
                if out.new_token_ids and "first_out" not in trace:
                    trace["first_out"] = time.perf_counter()
                yield out
                if finished:
                    return
        finally:
            drop()
            self._live_traces.pop(request.request_id, None)
            self._traces[request.request_id] = trace
            while len(self._traces) > TRACE_CAPACITY:
                self._traces.popitem(last=False)
            if not finished:
                self.abort_soon(request.request_id)

    def abort_soon(self, request_id: str) -> None:
        """Abort (or drop, if held) ``request_id`` before the next step, without waiting (NOTE 4)."""
        self._aborts.append(request_id)
        self._wake.set()

    async def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run ``fn`` under the engine lock, on the stepping thread before its next step (NOTE 5)."""
        if self._thread.is_alive() and not self._stop:
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            self._calls.append((fn, args, kwargs, loop, fut))
            self._wake.set()
            if not self._thread.is_alive():  # it stopped since the check: run what it left (ours too)
                self._drain_calls()
            return await fut

        def locked():
            with self._lock:
                return fn(*args, **kwargs)

        return await asyncio.to_thread(locked)

    def _drain_calls(self) -> None:
        """Run the calls a stopped stepping thread left queued (from any thread; each runs once)."""
        with self._lock:
            self._run_calls()

    def watch_residents(self, fn) -> bool:
        """Have the engine tell ``fn`` of its resident sessions kept, taken and evicted, on the
        stepping thread (``disagg.engine.reference.engine`` NOTE 9); False when the engine has no
        such hook (vLLM's device tier is its own)."""
        if not hasattr(self.engine, "on_resident"):
            return False
        with self._lock:
            self.engine.on_resident = fn
        return True

    def call_blocking(self, fn: Callable[..., Any], *args, timeout_s: float | None = None, **kwargs) -> Any:
        """``call`` from a thread that is not the event loop's (nor the stepping thread): blocks
        until ``fn`` ran between two steps, or raises ``TimeoutError`` past ``timeout_s``."""
        if not (self._thread.is_alive() and not self._stop):
            with self._lock:
                return fn(*args, **kwargs)
        done = concurrent.futures.Future()
        self._calls.append((fn, args, kwargs, None, done))
        self._wake.set()
        if not self._thread.is_alive():
            self._drain_calls()
        return done.result(timeout_s)

    async def export_state(self, request_id: str, position: int | None = None, first_block: int = 0,
                           on_device: bool = False):
        if on_device:  # only engines that gather into device buffers take the flag
            return await self.call(self.engine.export_state, request_id, position, first_block, on_device=True)
        return await self.call(self.engine.export_state, request_id, position, first_block)

    async def release(self, request_id: str, keep_resident: bool = True) -> None:
        await self.call(self.engine.release, request_id, keep_resident)

    async def export_and_release(self, request_id: str, positions: tuple[int, ...], present: int) -> list:
        """In one hop onto the stepping thread: the held request's state at each of ``positions``
        (the first one's MLA blocks from block ``present`` on, the others' none: the first one's
        put stores them), then its release to the device tier, whatever happened."""
        return await self.call(_export_all, self.engine, request_id, positions, present)

    # -- what the request flow and the replicas ask of the engine (disagg.flow.FlowEngine) --------
    @property
    def eos_token_id(self) -> int | None:
        return self.engine.eos_token_id

    @property
    def device(self):
        """The engine's torch device."""
        return getattr(self.engine, "device", None)

    async def resident_length(self, tokens: list[int], cache_salt: str = "") -> int:
        """Tokens of ``tokens`` a device-resident session can resume (0: none)."""
        _, n = await self.call(self.engine.resident_match, tokens, cache_salt)
        return n

    async def resident_extent(self, tokens: list[int], cache_salt: str = "") -> tuple[int, int]:
        """(``resident_length``, leading full blocks of ``tokens`` whose MLA rows a resident session
        holds) in one hop: a load may skip those rows (``ResumeState.first_block``, reference
        engine NOTE 8)."""
        return await self.call(self.engine.resident_extent, tokens, cache_salt)

    async def checkpoint_positions(self, request_id: str) -> list[int]:
        """KDA checkpoint positions a held request keeps (KeyError: not held)."""
        fn = getattr(self.engine, "checkpoint_positions", None)
        return [] if fn is None else await self.call(fn, request_id)

    async def computed_tokens(self, request_id: str) -> list[int]:
        """The tokens whose state a held request has computed (KeyError: not held)."""
        return await self.call(self.engine.computed_tokens, request_id)

    async def routing_report(self, known_version: int) -> tuple[int, list | None, dict]:
        """(resident version, resident sessions or None when ``known_version`` is current, load);
        the load's ``measured_at`` is the wall time it was read, between two steps."""
        eng = self.engine
        return await self.call(lambda: (eng.resident_version, eng.resident_contents()
                                        if eng.resident_version != known_version else None,
                                        {**eng.load(), "measured_at": time.time()}))

    def stats(self) -> dict:
        return self.engine.stats()

    def is_alive(self) -> bool:
        """Whether the stepping thread runs (a replica's health check)."""
        return self._thread.is_alive()

    def trace(self, request_id: str) -> dict[str, float] | None:
        """First-token stamps of a finished request (NOTE 3), None when unknown or dropped."""
        return self._traces.get(request_id)

    def live_requests(self) -> int:
        """Requests streaming now (``disagg.flow.FlowEngine``): the batch a local prefill stalls."""
        return len(self._queues)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._drain_calls()


def _settle(fut: asyncio.Future, ok: bool, value: Any) -> None:
    if fut.cancelled():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


def _export_all(engine, request_id: str, positions: tuple[int, ...], present: int) -> list:
    """``AsyncEngine.export_and_release`` on the stepping thread."""
    bs = engine.block_size
    try:
        return [engine.export_state(request_id, p, present if i == 0 else p // bs) for i, p in enumerate(positions)]
    finally:
        engine.release(request_id)
