"""The serving worker of the vLLM backend: ``disagg.flow`` over vLLM, adapters only.

The Serve prefill/decode deployments call ``prefill(params)`` and
``generate(params, prefill_fn)`` on it exactly as on the reference worker. The
decode side is ``disagg.flow.RequestFlow`` (the same flow as the reference
backend's); what differs is where state moves: inside vLLM, through the K3
state connector. ``ConnectorState`` is the flow's state interface for that:

    lookup      the node's tiers' resumable length (a presence-only store, off the event loop)
    load        nothing to load here: vLLM's connector loads the resumable prefix itself
    open        a prefill's hand-off -> ``kv_transfer_params`` (StateHandle) for the decode request
    publish     nothing: the connector saves the turn end (kv_both) before vLLM frees the blocks
    demote      a session's end (``disagg.flow`` NOTE 13): the blocks the connector saved of the
                prompt go first in this node's tiers (its checkpoints are not this flow's publishes)

    decode replica                                   prefill replica
    RequestFlow.generate(params)                     prefill(params)
      lookup, PDDecider                   ----->       vLLM: max_tokens=1, kv_transfer_params
        disaggregate: prefill_fn(params) ------>         {"do_remote_decode": true}
             <---------------- PrefillHandle(position, first_token)
             vLLM: prompt + [first_token], kv_transfer_params = StateHandle(position)
                   (connector waits for the save, loads, computes one token)
        local: vLLM: prompt (connector loads the resumable prefix itself)

NOTES
1. Same node only: the hand-off is read from the node's shared host tier (the
   handle carries no peer address through ``PrefillHandle``).
2. Any failure of the state path is a recompute inside vLLM
   (``kv_load_failure_policy=recompute``), never a wrong token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from disagg.config import AppConfig
from disagg.engine.protocol import EngineRequest
from disagg.flow import (
    FlowOptions,
    PoolFn,
    PrefillFn,
    RequestFlow,
    Resume,
    ResumePoint,
    store_lookup,
)
from disagg.messages import GenerateParams, PrefillHandle, SessionEnd, StreamChunk
from kv_transfer.keys import BlockHasher, KeyExtras
from kv_transfer.vllm.jobs import StateHandle

log = logging.getLogger(__name__)


class ConnectorState:
    """``disagg.flow.FlowState`` where vLLM's connector moves the state (module docstring)."""

    def __init__(self, lookup, model_id: str, block_size: int, producer_sizes: tuple[int, int],
                 node_id: str = "local"):
        self.store = lookup  # a presence-only StateStore over the node's tiers, or None
        self.model_id, self.block_size = model_id, block_size
        self.producer_sizes = producer_sizes  # (TP, DCP) of the prefill engines: how hand-offs are stored
        self.node_id = node_id

    async def lookup(self, tokens: list[int], hasher: BlockHasher, limit: int | None = None) -> ResumePoint | None:
        return await store_lookup(self.store, tokens, hasher, limit)

    async def load(self, tokens, position, hasher, params, node_id=None, first_block=0) -> Resume:
        return Resume(None, position, "host")  # the connector loads it (NOTE 2)

    async def open(self, handle: PrefillHandle, tokens, hasher, params, release_fn, first_block=0) -> Resume:
        tp, dcp = self.producer_sizes
        kv_params = StateHandle(handle.position, tp, dcp, self.model_id, self.block_size,
                                producer=handle.replica_id, saved_at=StateHandle.now()).to_params()
        return Resume(kv_params, handle.position, "host")

    async def publish(self, engine, request_id, tokens, hasher, also_at=()) -> tuple[int, tuple[int, ...]]:
        await engine.release(request_id)  # the connector saves (the engine keeps no finished request for export)
        return 0, ()

    async def recall(self, tokens: list[int], hasher, from_position: int, timeout_s: float,
                     held_blocks: int = 0) -> None:
        return None  # vLLM's block pool does not say what it holds (transfer.host.victim is refused)

    async def demote(self, points: list) -> int:
        return 0  # the connector's saves are not this flow's publishes: nothing of them is demoted here

    async def demote_blocks(self, node_id: str, hashes: list[bytes]) -> int:
        """This node's tiers evict the blocks the connector saved under ``hashes`` first (a session's
        end, ``disagg.flow`` NOTE 13; the lookup's key space is the decode engines'). Another
        node's: nothing (hand-offs never leave the node, NOTE 1)."""
        if self.store is None or node_id != self.node_id or not hashes:
            return 0
        return await asyncio.to_thread(lambda: self.store.demote(self.store.block_keys(hashes)))


class VLLMWorker:
    """Prefill / decode over a ``VLLMEngine`` (a ``disagg.flow.FlowEngine``).

    Args:
        engine: the role's ``VLLMEngine``.
        lookup: a ``StateStore`` over this node's tiers for resumable-length checks (or None).
        options: the flow's settings (``disagg.flow.FlowOptions``; default: one prefill retry);
            never learned checkpoints: vLLM's connector saves what vLLM keeps.
        producer_sizes: (TP, DCP) of the prefill engines (their hand-offs are stored that way).
    """

    def __init__(self, engine, lookup=None, replica_id: str = "local", node_id: str = "local",
                 *, options: FlowOptions | None = None, producer_sizes: tuple[int, int] = (1, 1),
                 prefill_pool: PoolFn | None = None):
        self.engine = engine
        self.store = lookup
        self.replica_id, self.node_id = replica_id, node_id
        self.hasher = BlockHasher(engine.block_size, KeyExtras(engine.model_id))
        state = ConnectorState(lookup, engine.model_id, engine.block_size, producer_sizes, node_id)
        # vLLM's connector saves what vLLM keeps: no learned checkpoint positions to ask for, and no
        # published points of this flow's to demote (NOTE 9 of disagg.flow)
        options = replace(options or FlowOptions(prefill_retries=1), learned_checkpoints=False, keep_checkpoints=0)
        self.flow = RequestFlow(engine, state, replica_id, options, prefill_pool=prefill_pool, node_id=node_id)
        self.counters = self.flow.counters

    def generate(self, params: GenerateParams, prefill_fn: PrefillFn | None = None) -> AsyncIterator[StreamChunk]:
        return self.flow.generate(params, self.hasher.with_salt(params.cache_salt), prefill_fn)

    async def end_session(self, end: SessionEnd) -> int:
        """The session is over (``disagg.flow`` NOTE 14): blocks the connector saved here go first."""
        return await self.flow.end_session_by_id(end.session_id, end.cache_salt)

    async def prefill(self, params: GenerateParams) -> PrefillHandle:
        """Compute the prompt, let the connector save its state, return the first token."""
        t0 = time.perf_counter()
        tokens = list(params.prompt_token_ids)
        req = EngineRequest(f"{params.request_id}/prefill", tokens, replace(params.sampling, max_tokens=1),
                            first_output_index=params.resumed_output_tokens, cache_salt=params.cache_salt)
        handle_params: list[dict | None] = []
        last = None
        async for out in self.engine.generate(req, {"do_remote_decode": True}, handle_params.append):
            last = out
        assert last is not None and last.new_token_ids, "prefill produced no token"
        computed_at = time.time()  # its engine's reports stop counting it (PrefillHandle.computed_at)
        saved = StateHandle.from_params(handle_params[0] if handle_params else None)
        if saved is None or saved.position != len(tokens):
            log.warning("prefill of %s left no hand-off (%s); decode will recompute", params.request_id, saved)
        self.counters["prefills"] += 1
        return PrefillHandle(len(tokens), last.new_token_ids[0], last.num_cached_tokens, last.cached_source,
                             self.replica_id, self.node_id, 0, 0.0, time.perf_counter() - t0,
                             first_logprob=last.logprobs[0] if last.logprobs else None, computed_at=computed_at)

    async def drain(self) -> None:
        await self.flow.drain()  # nothing in the background: saves run inside vLLM, drained before it frees blocks

    def stats(self) -> dict:
        out = {"worker": dict(self.counters), "engine": self.engine.stats(), "pd_decisions": dict(self.flow.decisions)}
        if self.store is not None:
            out["store"] = self.store.stats()
        return out


def lookup_store(app: AppConfig, tiers: list):
    """A presence-only ``StateStore`` over the node's tiers, in the decode engines' key space.

    The worker asks it for resumable lengths (conditional disaggregation); bytes
    are read by vLLM's connector, never through it.
    """
    from disagg.engine.vllm.options import model_id, parallel_sizes
    from kv_transfer.objects import StateLayout
    from kv_transfer.store import StateStore

    tp, dcp = parallel_sizes(app, "decode")
    # lookups read keys only: block size, TP shards and DCP shards decide them (not tensor shapes)
    layout = StateLayout(model_id(app), app.engine.block_size, 0, 1, 0, tp, 1, 1, 1)
    return StateStore(tiers, layout, tp_size=tp, dcp_size=dcp, write_behind=False)


def build_vllm_worker(app: AppConfig, role: str, host_socket: str | None, replica_id: str, node_id: str):
    """(engine, lookup store, worker) of one Serve replica running vLLM."""
    from disagg.engine.vllm.engine import VLLMEngine
    from disagg.engine.vllm.options import parallel_sizes

    engine = VLLMEngine(app, role, host_socket)
    lookup = None
    if role == "decode" and host_socket:
        from kv_transfer.tiers.host_ipc import HostTierClient

        lookup = lookup_store(app, [HostTierClient(host_socket)])
    options = FlowOptions.from_config(app, prefill_retries=1)
    worker = VLLMWorker(engine, lookup, replica_id, node_id, options=options, producer_sizes=parallel_sizes(app, "prefill"))
    return engine, lookup, worker
