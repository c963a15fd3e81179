"""The HTTP ingress deployment: OpenAI API in front of the decode servers.

The ingress tokenizes, validates and hands each request to a decode replica
(which orchestrates its prefill); it streams the replica's chunks back as SSE.
A client that disconnects cancels the replica-side generator, which aborts the
request in the engine and frees its state. A decode replica lost mid-stream is
replaced: the stream continues on another replica from the tokens already sent
(``disagg.workers.tiered.continue_params``), at most ``deployment.max_stream_resumes`` times.
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

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import ReplicaUnavailableError

from deployments.request_router import report_finished, router_stats
from deployments.timings import CURRENT, RecentTimings, TimedASGI, stamp
from disagg.api.app import create_app
from disagg.api.metrics import merge_replica_stats
from disagg.config import AppConfig, load_config
from disagg.console import RequestLog, RequestRecord, format_request
from disagg.engine.factory import build_tokenizer, engine_limits
from disagg.messages import GenerateParams, StreamChunk
from disagg.workers.tiered import continue_params

log = logging.getLogger("ray.serve")


class ServeBackend:
    """``GenerationBackend`` over Serve deployment handles."""

    def __init__(self, config: AppConfig, decode, prefill=None):
        self.config = config
        self.decode = decode
        self._decode_stream = decode.options(stream=True)  # built once, not per request
        self.prefill = prefill
        self.tokenizer = build_tokenizer(config)
        limits = engine_limits(config)
        self.max_model_len = limits.max_model_len
        self.vocab_size = limits.vocab_size  # valid prompt token ids: [0, vocab_size)
        self.block_size = config.engine.block_size  # tokens per cache block (prefix reuse granularity)
        self.model_name = config.model.openai_name
        self.num_resumed_streams = 0  # streams continued on another decode replica
        self.request_log = RequestLog()

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
        streamed: list[int] = []  # output tokens the client has been sent
        current = params
        stamps = CURRENT.get()
        if stamps is not None:
            stamps["request_id"] = params.request_id
        stamp("handler")
        for attempt in range(1, self.config.deployment.max_stream_resumes + 2):
            try:
                async with aclosing(self._stream_once(current)) as chunks:  # a disconnect cancels the replica call
                    async for chunk in chunks:
                        streamed.extend(chunk.token_ids)
                        if current is not params:  # figures about the client's prompt, not the continuation's
                            n = len(params.prompt_token_ids)
                            chunk = replace(chunk, num_prompt_tokens=n,
                                            num_cached_tokens=min(chunk.num_cached_tokens, n))
                        yield chunk
                return
            except (RayActorError, ReplicaUnavailableError) as exc:
                if attempt > self.config.deployment.max_stream_resumes or len(streamed) >= params.sampling.max_tokens:
                    raise
                log.warning("decode replica lost after %d tokens of %s (%s); continuing on another replica",
                            len(streamed), params.request_id, type(exc).__name__)
                self.num_resumed_streams += 1
                current = continue_params(params, streamed, attempt)

    async def _stream_once(self, params: GenerateParams) -> AsyncIterator[StreamChunk]:
        stamp("call")
        gen = self._decode_stream.generate.remote(params)
        done = False
        try:
            async for chunk in gen:
                if chunk.token_ids:
                    stamp("chunk_in")
                done = chunk.finished
                if done:
                    report_finished(params.request_id, chunk.num_cached_tokens)
                yield chunk
        finally:
            if not done:
                gen.cancel()

    async def stats(self) -> dict:
        calls = [self.decode.stats.remote()]
        if self.prefill is not None:
            calls.append(self.prefill.stats.remote())
        results = await asyncio.gather(*calls, return_exceptions=True)
        return {**merge_replica_stats([r for r in results if isinstance(r, dict)]), **router_stats(),
                "resumed_streams": self.num_resumed_streams}


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
