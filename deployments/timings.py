"""Per-request first-token timestamps along the serving path (for ``benchmarks/serve_bench.py``).

Each process on the path keeps the stamps of its recent requests in a bounded
``RecentTimings`` (the newest ``capacity``); the benchmark fetches them by
request id through the deployments' ``timings`` method and lines them up with
its own client stamps. Stamps are ``time.perf_counter()`` seconds: on Linux
that is ``CLOCK_MONOTONIC``, one clock for every process of a host, so stamps
from the client, the ingress and the replicas compare directly (same host
only).

    client send ─> http_in ─> handler ─> call ─> entry ─> admit ─> step_start ─> step_end
      (HAProxy,     (ASGI)    (FastAPI,   (Serve    (replica,  (engine)   prefill step    |
       uvicorn)               validation) handle)   worker plan)                           v
    client recv <─ body_out <─ chunk_in <──────────── first_yield <─ first_out <───────────┘

    ingress:   http_in, handler, call, chunk_in, body_out      (``TimedASGI`` + ``ServeBackend``)
    replica:   entry, first_yield                              (``DecodeServer.generate``)
    engine:    admit, step_start, step_end, step_cpu, first_out (``AsyncEngine.trace``)

NOTES
1. Only the first token is stamped: per-token work pays one dict lookup at most.
2. ``step_cpu`` is CPU seconds (``time.thread_time``) of the step that produced
   the first token, so wall minus CPU is time the step thread waited (run queue).
3. The engine stamps are the decode replica's engine request (``<id>/decode``):
   when a prefill replica computed the first token (disaggregated, long
   uncached suffix), they describe the decode side's first step, not the
   prefill; the overhead benchmark runs the aggregated app.
"""

from __future__ import annotations

import contextvars
import time
from collections import OrderedDict

# the stamps dict of the HTTP request this task serves (set by TimedASGI, filled by the backend)
CURRENT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("disagg_timings", default=None)


class RecentTimings:
    """request id -> stamps, the newest ``capacity`` requests."""

    def __init__(self, capacity: int = 1024):
        if capacity < 1:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._items: OrderedDict[str, dict] = OrderedDict()

    def put(self, request_id: str, stamps: dict) -> None:
        self._items[request_id] = stamps
        self._items.move_to_end(request_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, request_ids: list[str]) -> dict[str, dict]:
        return {rid: self._items[rid] for rid in request_ids if rid in self._items}

    def __len__(self) -> int:
        return len(self._items)


class TimedASGI:
    """ASGI middleware (outermost: ``app.add_middleware(TimedASGI, log=...)``) stamping an HTTP request's arrival (``http_in``) and its first response body
    sent after the first token arrived (``body_out``); the backend adds ``request_id`` and its own
    stamps to ``CURRENT``. Requests that set no ``request_id`` (health, metrics) are not kept."""

    def __init__(self, app, log: RecentTimings):
        self.app = app
        self.log = log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        stamps = {"http_in": time.perf_counter()}
        token = CURRENT.set(stamps)

        async def timed_send(message):
            if "body_out" not in stamps and "chunk_in" in stamps and message["type"] == "http.response.body":
                stamps["body_out"] = time.perf_counter()
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            CURRENT.reset(token)
            if "request_id" in stamps:
                self.log.put(stamps["request_id"], stamps)


def stamp(name: str) -> None:
    """Stamp ``name`` on the current HTTP request (once; no-op outside one)."""
    stamps = CURRENT.get()
    if stamps is not None and name not in stamps:
        stamps[name] = time.perf_counter()
