"""The vLLM engine behind the engine protocol: vLLM's ``AsyncLLM`` with the K3 state connector.

    Serve replica (asyncio)                     vLLM engine core + workers (GPU)
    VLLMEngine.generate(EngineRequest) ---->    scheduler + K3StateConnector (scheduler side)
        <- TokenOutput per new token            model runner + K3StateConnector (one per rank)
                                                     |  MLA blocks, tails, KDA checkpoints
                                                     v
                                              node host tier (shared memory)

State never passes through this object: vLLM's connector loads resumable
prefixes and hand-offs, and saves checkpoints, itself. So ``export_state`` is
not available and ``release`` has nothing to free (vLLM frees on finish).

It is the vLLM backend's ``disagg.flow.FlowEngine``: it keeps no finished
request for export (``keeps_state`` False) and reports no device-resident
sessions. ``engine`` is a small synchronous view (``EngineView``) with the
figures the Serve replicas report to routers (``routing_report``).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from disagg.config import AppConfig
from disagg.engine.protocol import EngineRequest, TokenLogprob, TokenOutput
from disagg.engine.vllm.options import build_engine_args, model_id, options
from kv_transfer.vllm.jobs import NO_SAVE_KEY

_FINISH = {"length": "length", "stop": "stop", "abort": "abort", "error": "error"}


class EngineView:
    """What the replica reports about its engine (no device-tier content: vLLM's own cache is opaque)."""

    resident_version = 0  # the vLLM backend reports no device-resident sessions

    def __init__(self, owner: VLLMEngine):
        self._owner = owner
        self.model_id = owner.model_id
        self.block_size = owner.block_size
        self.eos_token_id = owner.eos_token_id

    def resident_contents(self) -> list:
        return []

    def resident_match(self, tokens: list[int], cache_salt: str = "") -> tuple[None, int]:
        return None, 0

    def load(self) -> dict:
        o = self._owner
        return {"queued_prefill_tokens": o.queued_prefill_tokens, "queued_prefill_requests": o.num_prefilling,
                "running_decode_requests": o.num_live - o.num_prefilling, "running_decode_tokens": 0,
                "cache_utilization": 0.0, "device_tokens": o.device_tokens}

    def stats(self) -> dict:
        return dict(self._owner.counters, live=self._owner.num_live, time=time.time())


class VLLMEngine:
    """``AsyncEngineProtocol`` over vLLM's ``AsyncLLM`` for one role ("prefill" | "decode").

    Args:
        app: the application config (``engine.backend == "vllm"``).
        role: "prefill" | "decode" (per-role engine args; both run the connector as kv_both).
        host_socket: the node host tier's socket (None: the connector needs ``local_tier``).
        start: False builds everything but the engine (config checks, tests).
    """

    keeps_state = False  # the connector saves turn ends itself (disagg.flow)

    def __init__(self, app: AppConfig, role: str, host_socket: str | None, *, start: bool = True,
                 engine_id: str | None = None):
        self.app, self.role = app, role
        self.model_id = model_id(app)
        self.block_size = app.engine.block_size
        self.layout = None  # state moves inside vLLM (kv_transfer.vllm_connector)
        self.eos_token_id: int | None = None
        self.engine_id = engine_id or f"{role}-{uuid.uuid4().hex[:8]}"
        self.engine_args = build_engine_args(app, role, host_socket, self.engine_id)
        self.counters = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "output_tokens": 0, "errors": 0}
        self.num_live = 0
        self.num_prefilling = 0
        self.queued_prefill_tokens = 0
        self.device_tokens = 0  # KV capacity in tokens, once vLLM has sized its cache (start)
        self.llm = None
        if start:
            self.start()
        self.engine = EngineView(self)

    def start(self) -> None:
        """Start vLLM (GPU). Sets the configured environment first (e.g. VLLM_ROCM_USE_AITER=1)."""
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.update(options(self.app).env)
        self.llm = AsyncLLM.from_engine_args(self.engine_args)
        vc = self.llm.vllm_config
        if vc.cache_config.block_size != self.block_size:
            raise ValueError(f"vLLM chose block_size {vc.cache_config.block_size}; set engine.block_size to it "
                             "so the router's keys match the connector's")
        self.eos_token_id = getattr(vc.model_config.hf_config, "eos_token_id", None)
        # the front end's copy of the cache config holds the blocks the engine core allocated
        self.device_tokens = int(vc.cache_config.num_gpu_blocks or 0) * self.block_size

    @staticmethod
    def sampling_params(request: EngineRequest, kv_transfer_params: dict | None = None):
        """vLLM ``SamplingParams`` for an engine request (delta outputs)."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        s = request.sampling
        extra = {"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None
        return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                              stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
                              logprobs=s.logprobs, output_kind=RequestOutputKind.DELTA, extra_args=extra)

    async def generate(self, request: EngineRequest, kv_transfer_params: dict | None = None,
                       on_finish: Callable[[dict | None], None] | None = None) -> AsyncIterator[TokenOutput]:
        """Stream a request's tokens. ``on_finish`` receives the final ``kv_transfer_params``."""
        if self.llm is None:
            raise RuntimeError("the vLLM engine was built with start=False")
        if not request.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if not request.save_state:  # a session's last turn: the connector saves none of it
            kv_transfer_params = {**(kv_transfer_params or {}), NO_SAVE_KEY: True}
        sp = self.sampling_params(request, kv_transfer_params)
        n_prompt = len(request.prompt_token_ids)
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += n_prompt
        self.num_live += 1
        self.num_prefilling += 1
        self.queued_prefill_tokens += n_prompt
        prefilling = True
        finished = False
        try:
            stream = self.llm.generate({"prompt_token_ids": list(request.prompt_token_ids)}, sp,
                                       request.request_id)
            async for out in stream:
                if prefilling:
                    prefilling = False
                    self.num_prefilling -= 1
                    self.queued_prefill_tokens -= n_prompt
                comp = out.outputs[0] if out.outputs else None
                new = list(comp.token_ids) if comp is not None else []
                self.counters["output_tokens"] += len(new)
                cached = out.num_cached_tokens or 0
                reason = None
                if out.finished:
                    finished = True
                    reason = _FINISH.get(str(comp.finish_reason) if comp else "", "stop")
                    self.counters["cached_tokens"] += cached
                    if on_finish is not None:
                        on_finish(out.kv_transfer_params)
                yield TokenOutput(request.request_id, new, out.finished, reason, n_prompt, cached,
                                  "host" if cached else "computed",
                                  logprobs=_logprobs(comp, new, request.sampling.logprobs))
                if out.finished:
                    return
        finally:
            if prefilling:
                self.num_prefilling -= 1
                self.queued_prefill_tokens -= n_prompt
            self.num_live -= 1
            if not finished and self.llm is not None:
                await self.llm.abort(request.request_id)

    async def export_state(self, request_id: str, position: int | None = None, first_block: int = 0):
        raise NotImplementedError("the vLLM backend moves state through its KV connector")

    async def export_and_release(self, request_id: str, positions: tuple[int, ...], present: int) -> list:
        raise NotImplementedError("the vLLM backend moves state through its KV connector")

    async def release(self, request_id: str, keep_resident: bool = True) -> None:
        return None  # vLLM frees a finished request's blocks itself (after the connector's saves)

    # -- what the request flow and the replicas ask of the engine (disagg.flow.FlowEngine) --------
    async def resident_length(self, tokens: list[int], cache_salt: str = "") -> int:
        return 0  # vLLM's own prefix cache is opaque: the connector reports hits as cached tokens

    async def resident_extent(self, tokens: list[int], cache_salt: str = "") -> tuple[int, int]:
        return 0, 0  # vLLM asks its connector only for what its prefix cache lacks: no delta to ask for

    async def checkpoint_positions(self, request_id: str) -> list[int]:
        raise KeyError(request_id)  # no request is held after it finishes

    async def computed_tokens(self, request_id: str) -> list[int]:
        raise KeyError(request_id)

    async def routing_report(self, known_version: int) -> tuple[int, list | None, dict]:
        """(resident version, resident sessions or None when current, load): what replicas report;
        the load's ``measured_at`` is the wall time it was read."""
        view = self.engine
        return (view.resident_version, (None if known_version == view.resident_version else []),
                {**view.load(), "measured_at": time.time()})

    def stats(self) -> dict:
        return self.engine.stats()

    async def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run ``fn`` off the event loop (the replica's stats path)."""
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def check_health(self) -> None:
        if self.llm is None or self.llm.errored:
            raise RuntimeError("vLLM engine is not running")
        await self.llm.check_health()

    def live_requests(self) -> int:
        """Requests streaming now (``disagg.flow.FlowEngine``): the batch a local prefill stalls."""
        return self.num_live

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None


def _logprobs(comp, new: list[int], num_top: int | None) -> list[TokenLogprob] | None:
    """vLLM's per-token ``{token_id: Logprob(logprob, rank)}`` as ``TokenLogprob``s (it holds the
    sampled token and the ``num_top`` most likely)."""
    if num_top is None or comp is None or not comp.logprobs or not new:
        return None
    out = []
    for token, entries in zip(new, comp.logprobs[-len(new):], strict=True):
        ranked = sorted(((lp.rank, tid, lp.logprob) for tid, lp in entries.items() if lp.rank is not None))
        out.append(TokenLogprob(entries[token].logprob, [(tid, lp) for _, tid, lp in ranked[:num_top]]))
    return out
