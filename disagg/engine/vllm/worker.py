"""The serving worker of the vLLM backend: the same interface as ``disagg.worker.StatefulWorker``.

The Serve prefill/decode deployments call ``prefill(params)`` and
``generate(params, prefill_fn)`` on it exactly as on the reference worker. The
difference is where state moves: inside vLLM, through the K3 state connector.

    decode replica                                   prefill replica
    generate(params)                                 prefill(params)
      resumable prefix on this node's tiers  ----->    vLLM: max_tokens=1, kv_transfer_params
      suffix > local_prefill_max_tokens ?                {"do_remote_decode": true}
        yes: prefill_fn(params) ----------------->     connector saves the state at the prompt end
             <---------------- PrefillHandle(position, first_token)
             vLLM: prompt + [first_token], kv_transfer_params = StateHandle(position)
                   (connector waits for the save, loads, computes one token)
        no:  vLLM: prompt (connector loads the resumable prefix itself)
      stream tokens; at finish the connector checkpoints the turn end (kv_both)

NOTES
1. Same node only: the hand-off is read from the node's shared host tier (the
   handle carries no peer address through ``PrefillHandle``).
2. Any failure of the state path is a recompute inside vLLM
   (``kv_load_failure_policy=recompute``), never a wrong token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

from disagg.engine.protocol import EngineRequest
from disagg.messages import GenerateParams, PrefillHandle, StreamChunk
from kv_transfer.keys import BlockHasher, KeyExtras
from kv_transfer.vllm.jobs import StateHandle

log = logging.getLogger(__name__)
PrefillFn = Callable[[GenerateParams], Awaitable[PrefillHandle]]


class VLLMWorker:
    """Prefill / decode request flow over a ``VLLMEngine``.

    Args:
        engine: the role's ``VLLMEngine``.
        lookup: a ``StateStore`` over this node's tiers for resumable-length checks (or None).
        producer_sizes: (TP, DCP) of the prefill engines (their hand-offs are stored that way).
    """

    def __init__(self, engine, lookup=None, replica_id: str = "local", node_id: str = "local",
                 local_prefill_max_tokens: int = 512, producer_sizes: tuple[int, int] = (1, 1),
                 prefill_retries: int = 1):
        self.engine = engine
        self.store = lookup
        self.replica_id, self.node_id = replica_id, node_id
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.producer_sizes = producer_sizes
        self.prefill_retries = prefill_retries
        self.hasher = BlockHasher(engine.block_size, KeyExtras(engine.model_id))
        self.counters = {"prefills": 0, "decodes": 0, "remote_prefills": 0, "local_prefills": 0,
                         "prefill_failures": 0}

    def _resumable(self, tokens: list[int], salt: str) -> int:
        if self.store is None:
            return 0
        try:
            return self.store.resumable_length(tokens, self.hasher.with_salt(salt), len(tokens) - 1).position
        except Exception:  # a tier that fails is a miss
            log.exception("resumable-length lookup failed")
            return 0

    async def prefill(self, params: GenerateParams) -> PrefillHandle:
        """Compute the prompt, let the connector save its state, return the first token."""
        t0 = time.perf_counter()
        tokens = list(params.prompt_token_ids)
        req = EngineRequest(f"{params.request_id}/prefill", tokens, replace(params.sampling, max_tokens=1),
                            cache_salt=params.cache_salt)
        handle_params: list[dict | None] = []
        last = None
        async for out in self.engine.generate(req, {"do_remote_decode": True}, handle_params.append):
            last = out
        assert last is not None and last.new_token_ids, "prefill produced no token"
        saved = StateHandle.from_params(handle_params[0] if handle_params else None)
        if saved is None or saved.position != len(tokens):
            log.warning("prefill of %s left no hand-off (%s); decode will recompute", params.request_id, saved)
        self.counters["prefills"] += 1
        return PrefillHandle(len(tokens), last.new_token_ids[0], last.num_cached_tokens, last.cached_source,
                             self.replica_id, self.node_id, 0, 0.0, time.perf_counter() - t0,
                             first_logprob=last.logprobs[0] if last.logprobs else None)

    def _handoff_params(self, handle: PrefillHandle) -> dict:
        tp, dcp = self.producer_sizes
        return StateHandle(handle.position, tp, dcp, self.engine.model_id, self.engine.block_size,
                           producer=handle.replica_id, saved_at=StateHandle.now()).to_params()

    async def generate(self, params: GenerateParams, prefill_fn: PrefillFn | None = None) -> AsyncIterator[StreamChunk]:
        tokens = list(params.prompt_token_ids)
        sampling = params.sampling
        handle = None
        if prefill_fn is not None and len(tokens) - self._resumable(tokens, params.cache_salt) > self.local_prefill_max_tokens:
            handle = await self._remote_prefill(params, prefill_fn)
        kv_params = None
        cached, source = 0, "computed"
        if handle is not None:
            self.counters["remote_prefills"] += 1
            cached, source = handle.num_cached_tokens, handle.cached_source
            first = StreamChunk([handle.first_token], num_prompt_tokens=len(tokens), num_cached_tokens=cached,
                                cached_source=source, replica_id=self.replica_id,
                                logprobs=[handle.first_logprob] if handle.first_logprob is not None else None)
            eos = self.engine.engine.eos_token_id
            stop = handle.first_token in sampling.stop_token_ids or (not sampling.ignore_eos and handle.first_token == eos)
            if sampling.max_tokens == 1 or stop:
                first.finished, first.finish_reason = True, "length" if sampling.max_tokens == 1 else "stop"
                yield first
                return
            yield first
            tokens = tokens + [handle.first_token]
            sampling = replace(sampling, max_tokens=sampling.max_tokens - 1)
            kv_params = self._handoff_params(handle)
        else:
            self.counters["local_prefills"] += 1
        req = EngineRequest(f"{params.request_id}/decode", tokens, sampling, first_output_index=1 if handle else 0,
                            cache_salt=params.cache_salt)
        try:
            async for out in self.engine.generate(req, kv_params):
                yield StreamChunk(out.new_token_ids, out.finished, out.finish_reason, len(params.prompt_token_ids),
                                  cached if handle else out.num_cached_tokens,
                                  source if handle else out.cached_source, out.error, 0, 0.0, self.replica_id,
                                  out.logprobs)
        finally:
            self.counters["decodes"] += 1

    async def _remote_prefill(self, params: GenerateParams, prefill_fn: PrefillFn) -> PrefillHandle | None:
        for attempt in range(self.prefill_retries + 1):
            try:
                return await prefill_fn(params)
            except Exception as exc:  # a failing prefill replica: retry, then prefill here
                self.counters["prefill_failures"] += 1
                log.warning("remote prefill attempt %d failed (%s)", attempt + 1, exc)
        return None

    async def drain(self) -> None:
        return None  # saves run inside vLLM; it drains them before it frees the blocks

    def stats(self) -> dict:
        out = {"worker": dict(self.counters), "engine": self.engine.engine.stats()}
        if self.store is not None:
            out["store"] = self.store.stats()
        return out
