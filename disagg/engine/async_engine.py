"""Asyncio front of a synchronous engine: one stepping thread, many streams.

    asyncio tasks  --add/abort/export-->  [lock]  engine  <--step-- stepping thread
         ^                                                     |
         +------ per-request asyncio.Queue <-- call_soon_threadsafe

A consumer that stops iterating (client disconnect, task cancellation) aborts
its request, which frees the request's blocks and slot on the next step.

NOTES
1. Every engine call happens under ``_lock``; the stepping thread holds it only
   for one step, so exports and admissions interleave with steps.
2. A request's queue receives exactly one final ``TokenOutput`` (finished=True).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from disagg.engine.protocol import EngineRequest, TokenOutput


class AsyncEngine:
    def __init__(self, engine, idle_wait_s: float = 0.05):
        self.engine = engine
        self.model_id = engine.model_id
        self.block_size = engine.block_size
        self.layout = engine.layout
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._idle_wait_s = idle_wait_s
        self.step_times: list[float] = []
        self._thread = threading.Thread(target=self._loop, name="engine-step", daemon=True)
        self._thread.start()

    # -- stepping thread -----------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            with self._lock:
                busy = self.engine.has_work()
                if busy:
                    t0 = time.perf_counter()
                    try:
                        outputs = self.engine.step()
                    except Exception as exc:  # an engine bug must not hang its callers
                        outputs = self._fail_all(exc)
                    self.step_times.append(time.perf_counter() - t0)
                    if len(self.step_times) > 4096:
                        del self.step_times[:2048]
            if busy:
                for out in outputs:
                    self._deliver(out)
            else:
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()

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
    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenOutput]:
        """Stream a request's outputs. Raises ValueError for a request the engine refuses."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[TokenOutput] = asyncio.Queue()
        self._queues[request.request_id] = (loop, q)
        try:
            with self._lock:
                self.engine.add_request(request)
        except Exception:
            self._queues.pop(request.request_id, None)
            raise
        self._wake.set()
        finished = False
        try:
            while True:
                out = await q.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(request.request_id, None)
            if not finished:
                await self.call(self.engine.abort, request.request_id)

    async def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run ``fn`` under the engine lock in a worker thread."""

        def locked():
            with self._lock:
                return fn(*args, **kwargs)

        return await asyncio.to_thread(locked)

    async def export_state(self, request_id: str, position: int | None = None, first_block: int = 0):
        return await self.call(self.engine.export_state, request_id, position, first_block)

    async def release(self, request_id: str, keep_resident: bool = True) -> None:
        await self.call(self.engine.release, request_id, keep_resident)

    def num_live(self) -> int:
        return len(self._queues)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
