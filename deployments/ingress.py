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

from disagg.api.app import create_app
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
        self.tokenizer.vocab_size = limits.vocab_size
        self.model_name = config.model.openai_name

    async def stream(self, params: GenerateParams) -> AsyncIterator[StreamChunk]:
        gen = self.decode.options(stream=True).generate.remote(params)
        done = False
        try:
            async for chunk in gen:
                done = chunk.finished
                yield chunk
        finally:
            if not done:
                gen.cancel()

    async def stats(self) -> dict:
        calls = [self.decode.stats.remote()]
        if self.prefill is not None:
            calls.append(self.prefill.stats.remote())
        results = await asyncio.gather(*calls, return_exceptions=True)
        return merge_stats([r for r in results if isinstance(r, dict)])


def merge_stats(replica_stats: list[dict]) -> dict:
    """Fold replica stats into the shape ``ServingMetrics.observe_stats`` reads."""
    tiers: dict[str, dict] = {}
    checksum = 0
    for s in replica_stats:
        store = s.get("store") or {}
        for name, t in (store.get("tiers") or {}).items():
            tiers[name] = t  # node-shared tiers: every replica on the node reports the same figures
        checksum = max(checksum, store.get("checksum_failures", 0))
        eng = s.get("engine") or {}
        if eng:
            dev = tiers.setdefault(f"device:{s.get('role', '?')}", {"used_bytes": 0, "capacity_bytes": 0,
                                                                    "num_objects": 0, "evictions": 0})
            dev["num_objects"] += eng.get("resident_sessions", 0)
            dev["evictions"] += eng.get("resident_evictions", 0)
            blocks = eng.get("num_blocks", 0)
            block_bytes = eng.get("block_bytes", 0)
            dev["used_bytes"] += (blocks - eng.get("free_blocks", 0)) * block_bytes
            dev["capacity_bytes"] += blocks * block_bytes
    return {"tiers": tiers, "checksum_failures": checksum}


@serve.ingress()
class Ingress:
    def __init__(self, config: dict, decode, prefill=None):
        self.config = load_config(config)
        self.backend = ServeBackend(self.config, decode, prefill)

    def __serve_build_asgi_app__(self):
        return create_app(self.backend, self.config.http)
