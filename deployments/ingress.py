"""The HTTP ingress deployment: OpenAI API in front of the decode servers.

The ingress tokenizes, validates and hands each request to a decode replica
(which orchestrates its prefill); it streams the replica's chunks back as SSE.
A client that disconnects cancels the replica-side generator, which aborts the
request in the engine and frees its state. A decode replica lost mid-stream is
replaced: the stream continues on another replica from the tokens already sent
(``disagg.workers.tiered.continue_params``); while no replica is up the stream waits, with backoff,
at most ``deployment.stream_resume_timeout_s`` (``disagg.stream_resume``).
The ingress keeps its recent requests' first-token stamps (``timings``, see
``deployments.timings``) and a record of each finished request (logged at info
level, and read by ``disagg serve`` through ``console``, see ``disagg.console``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import asdict, replace
from typing import NoReturn

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from deployments.request_router import replica_ids, report_finished, router_stats
from deployments.servers import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT
from deployments.timings import CURRENT, RecentTimings, TimedASGI, stamp
from disagg.api.app import create_app
from disagg.api.errors import APIError
from disagg.api.metrics import merge_replica_stats
from disagg.config import AppConfig, load_config
from disagg.console import RequestLog, RequestRecord, format_request
from disagg.engine.factory import build_tokenizer, engine_limits
from disagg.messages import GenerateParams, SessionEnd, StreamChunk, ToReplica
from disagg.stream_resume import ResumeWait, timeout_message
from disagg.workers.tiered import continue_params

log = logging.getLogger("ray.serve")
# a decode call failed because its replica is gone or none is up: continue elsewhere
_REPLICA_LOST = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)


STATS_WAIT_S = 4.0  # how long the merged stats (/metrics, the console) wait for each replica's figures
END_SESSION_WAIT_S = 10.0  # how long a DELETE /v1/sessions/{id} waits for the decode replicas' answers


async def _awaited(response):
    return await response


class _FirstChunkLate(Exception):
    """A continuation's first chunk did not come before its outage's deadline."""


class ServeBackend:
    """``GenerationBackend`` over Serve deployment handles."""

    def __init__(self, config: AppConfig, decode, prefill=None):
        self.config = config
        self.decode = decode
        self._decode_stream = decode.options(stream=True)  # built once, not per request
        self.prefill = prefill
        if prefill is not None:  # initializes the handle: the decode pool's router reads this process's
            prefill.options()  # router of the prefill pool (deployments.request_router NOTE 2)
        self.tokenizer = build_tokenizer(config)
        limits = engine_limits(config)
        self.max_model_len = limits.max_model_len
        self.vocab_size = limits.vocab_size  # valid prompt token ids: [0, vocab_size)
        self.block_size = config.engine.block_size  # tokens per cache block (prefix reuse granularity)
        self.model_name = config.model.openai_name
        self.num_resumed_streams = 0  # streams continued on another decode replica
        self.num_resume_timeouts = 0  # streams ended because no replica took them back in time
        self.request_log = RequestLog()
        self._ending: set[asyncio.Future] = set()  # session ends still on their way (end_session)

    async def stream(self, params: GenerateParams) -> AsyncIterator[StreamChunk]:
        """The generation's chunks; its record joins ``request_log`` however it ends."""
        t0 = time.perf_counter()
        seen = {"ttft": None, "out": 0, "last": None, "status": "cancelled"}
        try:
            async with aclosing(self._stream(params)) as chunks:
                async for chunk in chunks:
                    if chunk.token_ids and seen["ttft"] is None:
                        seen["ttft"] = time.perf_counter() - t0
                    seen["out"] += len(chunk.token_ids)
                    seen["last"] = chunk
                    if chunk.finished or chunk.error:
                        seen["status"] = "error" if chunk.error else (chunk.finish_reason or "done")
                    yield chunk
        except Exception as exc:
            seen["status"] = type(exc).__name__
            raise
        finally:
            self._record(params, seen, time.perf_counter() - t0)

    def _record(self, params: GenerateParams, seen: dict, e2e_s: float) -> None:
        last = seen["last"]
        rec = RequestRecord(params.request_id, len(params.prompt_token_ids),
                            last.num_cached_tokens if last else 0, last.cached_source if last else "computed",
                            seen["out"], seen["ttft"], e2e_s, seen["status"])
        self.request_log.add(rec)
        log.info(format_request(rec))

    async def _stream(self, params: GenerateParams) -> AsyncIterator[StreamChunk]:
        """The chunks of ``params``, continued on another decode replica after a loss
        (``disagg.stream_resume``): no token lost, repeated or changed, or an explicit 503."""
        cfg = self.config.deployment
        streamed: list[int] = []  # output tokens the client has been sent
        current = params
        outage: ResumeWait | None = None  # from a loss until a replica acknowledges a continuation
        num_losses = num_calls = 0
        stamps = CURRENT.get()
        if stamps is not None:
            stamps["request_id"] = params.request_id
        stamp("handler")
        while True:
            num_calls += 1
            try:
                within = None if outage is None else outage.remaining(time.monotonic())
                async with aclosing(self._stream_once(current, within)) as chunks:  # a disconnect cancels the call
                    async for chunk in chunks:
                        outage = None  # resumed (stream_resume NOTE 1)
                        if current.ack and not (chunk.token_ids or chunk.finished or chunk.error):
                            continue  # the replica's acknowledgment: nothing for the client
                        streamed.extend(chunk.token_ids)
                        if current is not params:  # figures about the client's prompt, not the continuation's
                            n = len(params.prompt_token_ids)
                            chunk = replace(chunk, num_prompt_tokens=n,
                                            num_cached_tokens=min(chunk.num_cached_tokens, n))
                        yield chunk
                return
            except _REPLICA_LOST as exc:
                if len(streamed) >= params.sampling.max_tokens:
                    raise
                if outage is None:  # a new loss (stream_resume NOTE 2)
                    num_losses += 1
                    if num_losses > cfg.max_stream_resumes:
                        raise
                    outage = ResumeWait(cfg.stream_resume_timeout_s, time.monotonic())
                    self.num_resumed_streams += 1
                    log.warning("decode replica lost after %d tokens of %s (%s); continuing on another replica",
                                len(streamed), params.request_id, type(exc).__name__)
                delay = outage.next_delay(time.monotonic())
                if delay is None:
                    self._resume_timed_out(params, len(streamed))
                await asyncio.sleep(delay)
            except _FirstChunkLate:
                self._resume_timed_out(params, len(streamed))
            current = replace(continue_params(params, streamed, num_calls), ack=True)

    def _resume_timed_out(self, params: GenerateParams, num_sent: int) -> NoReturn:
        self.num_resume_timeouts += 1
        log.warning("no decode replica took %s back within %.0f s; it ends with an error",
                    params.request_id, self.config.deployment.stream_resume_timeout_s)
        raise APIError(503, timeout_message(self.config.deployment.stream_resume_timeout_s, num_sent),
                       type="server_error", code="stream_resume_timeout", headers={"Retry-After": "1"})

    async def _stream_once(self, params: GenerateParams, first_within: float | None = None
                           ) -> AsyncIterator[StreamChunk]:
        """One decode replica call's chunks; its first must arrive within ``first_within`` seconds
        when set (else ``_FirstChunkLate``): Serve queues a call while no replica is up."""
        stamp("call")
        gen = self._decode_stream.generate.remote(params)
        done = False
        generated = 0  # this call's output tokens (a continuation's: those after the loss)
        try:
            chunks = gen.__aiter__()
            while not done:
                try:
                    if first_within is None:
                        chunk = await chunks.__anext__()
                    else:
                        try:
                            chunk = await asyncio.wait_for(chunks.__anext__(), max(first_within, 1e-3))
                        except asyncio.TimeoutError:
                            raise _FirstChunkLate() from None
                        first_within = None
                except StopAsyncIteration:
                    return
                if chunk.token_ids:
                    stamp("chunk_in")
                    generated += len(chunk.token_ids)
                done = chunk.finished
                if done:
                    report_finished(params.request_id, chunk.num_cached_tokens, generated, chunk.served,
                                    chunk.replica_id)
                yield chunk
        finally:
            if not done:
                gen.cancel()
                report_finished(params.request_id, None)  # abandoned or failed: the routers forget it

    async def end_session(self, session_id: str, cache_salt: str = "") -> int:
        """Tell every decode replica this ingress's router knows (one call each, ``disagg.flow``
        NOTE 14; none known yet: one call, anywhere) that the session is over: the objects their
        nodes' tiers now evict first, counted over the replicas that answered within
        ``END_SESSION_WAIT_S`` (a replica at its ``max_ongoing_requests`` takes the call once a
        slot frees; the others' calls run on). A replica that fails counts none."""
        ids = replica_ids(DECODE_DEPLOYMENT) or [""]
        end = self.decode.end_session
        calls = [asyncio.ensure_future(_awaited(end.remote(SessionEnd(session_id, cache_salt, rid)))) for rid in ids]
        done, pending = await asyncio.wait(calls, timeout=END_SESSION_WAIT_S)
        if pending:
            log.warning("%d decode replicas had not taken a session's end after %.0f s; it runs on",
                        len(pending), END_SESSION_WAIT_S)
            for call in pending:  # held until done: the loop keeps only weak references to tasks
                self._ending.add(call)
                call.add_done_callback(self._ended_late)
        demoted = 0
        for call in done:
            if call.exception() is not None:
                log.warning("a decode replica did not take a session's end: %r", call.exception())
            else:
                demoted += call.result()["demoted"]
        return demoted

    def _ended_late(self, call: asyncio.Future) -> None:
        self._ending.discard(call)
        if not call.cancelled() and call.exception() is not None:
            log.warning("a decode replica did not take a session's end: %r", call.exception())

    async def stats(self) -> dict:
        """Every replica's figures, merged: one call to each replica this process's routers know
        (none known yet: one call, anywhere); those that answered within ``STATS_WAIT_S`` count,
        once each (a call for a replica gone since went to another)."""
        pools = [(self.decode, DECODE_DEPLOYMENT)] + ([(self.prefill, PREFILL_DEPLOYMENT)] if self.prefill else [])
        calls = [asyncio.ensure_future(_awaited(handle.stats.remote(ToReplica(rid))))
                 for handle, deployment in pools for rid in replica_ids(deployment) or [""]]
        done, pending = await asyncio.wait(calls, timeout=STATS_WAIT_S)
        for call in pending:
            call.cancel()
        for call in done:
            if call.exception() is not None:
                log.warning("a replica's stats call failed: %r", call.exception())
        answers = [c.result() for c in done if not c.exception() and isinstance(c.result(), dict)]
        by_replica = {a.get("replica_id", i): a for i, a in enumerate(answers)}
        return {**merge_replica_stats(list(by_replica.values())), **router_stats(),
                "resumed_streams": self.num_resumed_streams, "stream_resume_timeouts": self.num_resume_timeouts}


@serve.ingress()
class Ingress:
    def __init__(self, config: dict, decode, prefill=None):
        self.config = load_config(config)
        self.backend = ServeBackend(self.config, decode, prefill)
        self._timings = RecentTimings()
        ctx = serve.get_replica_context()
        self._replica_id = ctx.replica_id.unique_id if ctx else "ingress"

    def __serve_build_asgi_app__(self):
        app = create_app(self.backend, self.config.http)
        app.add_middleware(TimedASGI, log=self._timings)  # outermost: stamps the arrival
        return app

    async def console(self, seen: dict[str, int]) -> dict:
        """This replica's requests finished after ``seen[its id]`` (each ingress replica numbers
        its own), its id, its newest sequence number and the replicas' merged stats: what
        ``disagg serve`` prints (``disagg.console``)."""
        records, last = self.backend.request_log.since(seen.get(self._replica_id, 0))
        try:
            stats = await asyncio.wait_for(self.backend.stats(), timeout=5)
        except Exception:  # stats are best effort; the request lines still come
            stats = {}
        return {"replica": self._replica_id, "requests": [asdict(r) for r in records], "last_seq": last,
                "stats": stats}

    async def timings(self, request_ids: list[str]) -> dict[str, dict]:
        """First-token stamps of recent requests through this ingress (``deployments.timings``)."""
        return self._timings.get(request_ids)
