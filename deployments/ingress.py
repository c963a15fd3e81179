"""The HTTP ingress deployment: OpenAI API in front of the decode servers.

The ingress tokenizes, validates and hands each request to a decode replica
(which orchestrates its prefill); it streams the replica's chunks back as SSE.
A client that disconnects cancels the replica-side generator, which aborts the
request in the engine and frees its state.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ray import serve

from deployments.request_router import report_finished, router_stats
from disagg.api.app import create_app
from disagg.api.metrics import merge_replica_stats
from disagg.config import AppConfig, load_config
from disagg.engine.factory import build_tokenizer, engine_limits
from disagg.messages import GenerateParams, StreamChunk


class ServeBackend:
    """``GenerationBackend`` over Serve deployment handles."""

    def __init__(self, config: AppConfig, decode, prefill=None):
        self.config = config
        self.decode = decode
        self.prefill = prefill
        self.tokenizer = build_tokenizer(config)
        limits = engine_limits(config)
        self.max_model_len = limits.max_model_len
        self.vocab_size = limits.vocab_size  # valid prompt token ids: [0, vocab_size)
        self.model_name = config.model.openai_name

    async def stream(self, params: GenerateParams) -> AsyncIterator[StreamChunk]:
        gen = self.decode.options(stream=True).generate.remote(params)
        done = False
        try:
            async for chunk in gen:
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
        return {**merge_replica_stats([r for r in results if isinstance(r, dict)]), **router_stats()}


@serve.ingress()
class Ingress:
    def __init__(self, config: dict, decode, prefill=None):
        self.config = load_config(config)
        self.backend = ServeBackend(self.config, decode, prefill)

    def __serve_build_asgi_app__(self):
        return create_app(self.backend, self.config.http)
