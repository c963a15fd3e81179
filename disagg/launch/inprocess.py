"""Prefill and decode workers in one process, behind the same HTTP API.

For tests of the HTTP layer, for benchmarks that need a baseline without Ray,
and for GPU hosts where Ray is not installed. The workers share one model
object (the model is stateless) and one in-process host tier.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from disagg.api.metrics import merge_replica_stats
from disagg.config import AppConfig
from disagg.engine.async_engine import AsyncEngine
from disagg.engine.factory import build_reference_engine, build_tokenizer, engine_limits
from disagg.faults import FaultInjector
from disagg.flow import FlowOptions
from disagg.messages import GenerateParams, SessionEnd, StreamChunk
from disagg.workers.tiered import StatefulWorker


def make_local_store(cfg: AppConfig, layout):
    """An in-process ``StateStore`` over a host tier (and a disk tier when enabled)."""
    from kv_transfer.store import StateStore
    from kv_transfer.tiers.host import HostTier

    tiers = []
    disk = None
    if cfg.transfer.disk.enabled:
        from kv_transfer.tiers.disk import DiskTier

        disk = DiskTier(cfg.transfer.disk.path, int(cfg.transfer.disk.capacity_gb * (1 << 30)),
                        admission=cfg.transfer.disk.admission)
    host = HostTier(cfg.transfer.host.capacity_mb << 20, eviction=cfg.transfer.host.policy,
                    pin_memory=cfg.transfer.host.pin_memory, slab_bytes=(cfg.transfer.host.slab_kb << 10) or None)
    tiers.append(host)
    if disk is not None:
        tiers.append(disk)
    return StateStore(tiers, layout)  # host evictions write behind to disk


class InProcessBackend:
    """``GenerationBackend`` with in-process workers (aggregated or disaggregated)."""

    def __init__(self, cfg: AppConfig, store=None, host_tier: bool = True):
        """``store``: a shared ``StateStore`` (default: a new in-process one); ``host_tier=False``
        runs without any store (device-resident sessions only; a baseline; the decode worker
        then prefills every prompt itself, disaggregated or not)."""
        self.config = cfg
        decode_engine = build_reference_engine(cfg)
        if store is None and host_tier:
            store = make_local_store(cfg, decode_engine.layout)
        self.store = store
        self.decode = self._worker(AsyncEngine(decode_engine), "decode-0", "decode")
        self.prefill = None
        # without a store a prefill worker's state could not reach the decode worker: it prefills
        if cfg.deployment.mode == "disaggregated" and self.store is not None:
            from disagg.engine.reference.engine import ReferenceEngine

            prefill_engine = ReferenceEngine(decode_engine.model, decode_engine.model_id, decode_engine.options)
            self.prefill = self._worker(AsyncEngine(prefill_engine), "prefill-0", "prefill")
        self.tokenizer = build_tokenizer(cfg)
        limits = engine_limits(cfg)
        self.max_model_len = limits.max_model_len
        self.vocab_size = limits.vocab_size  # valid prompt token ids: [0, vocab_size)
        self.block_size = cfg.engine.block_size  # tokens per cache block (prefix reuse granularity)
        self.model_name = cfg.model.openai_name

    def _worker(self, engine: AsyncEngine, name: str, role: str) -> StatefulWorker:
        """A worker configured as the Serve deployments configure theirs (deadline, faults)."""
        cfg = self.config
        faults = FaultInjector(cfg.faults, name, role)  # off unless configured; a kill raises InjectedCrash
        return StatefulWorker(engine, self.store, name, "local", options=FlowOptions.from_config(cfg), faults=faults,
                              device_holds=cfg.transfer.host.victim and role != "prefill")

    def stream(self, params: GenerateParams) -> AsyncIterator[StreamChunk]:
        fn = self.prefill.prefill if self.prefill is not None else None
        return self.decode.generate(params, fn)

    async def complete(self, params: GenerateParams) -> tuple[list[int], StreamChunk]:
        """Stream a request to its end, then wait for both workers' background work (its
        publishes): (its tokens, its last chunk)."""
        tokens: list[int] = []
        last = None
        async for chunk in self.stream(params):
            tokens += chunk.token_ids
            last = chunk
        await self.decode.drain()
        if self.prefill is not None:
            await self.prefill.drain()
        assert last is not None, "a stream ends with a finished chunk"
        return tokens, last

    async def end_session(self, session_id: str, cache_salt: str = "") -> int:
        """The session is over (``disagg.flow`` NOTE 14): objects the decode worker's tiers now evict first."""
        return await self.decode.end_session(SessionEnd(session_id, cache_salt))

    async def stats(self) -> dict:
        parts = [dict(self.decode.stats(), role="decode")]
        if self.prefill is not None:
            parts.append(dict(self.prefill.stats(), role="prefill"))
        return merge_replica_stats(parts)

    def shutdown(self) -> None:
        self.decode.shutdown()
        if self.prefill is not None:
            self.prefill.shutdown()
