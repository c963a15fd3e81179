"""The reference backend's serving worker: the request flow over an ``AsyncEngine`` and the node's tiers.

The Serve prefill and decode deployments are thin shells around this class, and
the in-process backend (tests, overhead baseline) uses it directly. The decode
side is ``disagg.flow.RequestFlow`` (its docstring has the path and NOTEs 1-6);
this module adapts the two things it runs over:

    engine  ``disagg.engine.async_engine.AsyncEngine`` (a ``FlowEngine`` as it is)
    state   ``TierState``: the node's ``kv_transfer`` store, peer nodes' stores, device hand-offs
            (wrapped by ``disagg.faults.FaultyState`` when fault injection is on)

and runs the prefill side (``prefill``): resume, compute, then publish the
prompt's state to the host tier or hand it over device to device.

NOTES
1. Device hand-off (a prefill and a decode engine on two GPUs of one host):
   the prefill worker gathers the state into buffers on its GPU and returns
   their IPC descriptor in the handle; the decode worker copies them onto its
   GPU (one peer copy each, fingerprint-checked), then releases them. The
   prefill keeps the prefix resident on its device for the session's next
   turn; the decode's turn-end checkpoint still goes to the host tier.
2. A host-tier handle from a prefill replica on another node is loaded through
   ``peer_stores(handle.node_id)`` (this node's tiers, then that node's gRPC state
   service); with no peer store for that node, from this node's tiers (a miss
   there is a recompute, ``disagg.flow`` NOTE 3).
3. A prefill for a decode replica on another node (``GenerateParams.decode_node``), or one that
   resumed from another node's tiers (a peer resume, ``disagg.flow`` NOTE 10), publishes its
   turn here for the hand-off, then has this node's tiers evict those checkpoints first
   (``FlowState.demote``): the session's state lives on the decode replica's node, where the
   hand-off and the turn end land and which its next turn names again (or the router does,
   when the session moves); a copy here would only push out the sessions this node serves.
   A demoted point is still read until evicted (the hand-off).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from disagg.engine.protocol import EngineRequest
from disagg.faults import FaultInjector, FaultyState
from disagg.flow import (
    FlowOptions,
    PoolFn,
    PrefillFn,
    ReleaseFn,
    RequestFlow,
    Resume,
    ResumePoint,
    _quietly,
    earlier_checkpoints,
    store_lookup,
)
from disagg.messages import GenerateParams, PrefillHandle, SessionEnd, StreamChunk
from disagg.reuse.retention import points_at
from disagg.session import session_key
from kv_transfer.keys import BlockHasher, KeyExtras, ObjectKey

if TYPE_CHECKING:
    from kv_transfer.store import StateStore

log = logging.getLogger(__name__)

PeerStoresFn = Callable[[str], "StateStore | None"]  # node_id -> a store that reads that node (NOTE 2)


class TierState:
    """``disagg.flow.FlowState`` over the node's ``kv_transfer`` store (thread-safe: no engine lock).

    Args:
        store: the node-shared tiers, or None (then only device hand-offs load).
        layout: the engine's state layout.
        node_id: this node (a handle from another node goes through ``peer_stores``).
        load_device: where loaded MLA rows go (a GPU engine's device), None: host memory.
        engine_device: the engine's device (device hand-offs are copied onto it).
        peer_stores: node_id -> a store reading that node (NOTE 2); may block.
        counters: the flow's counters (peer loads are counted here).
    """

    def __init__(self, store, layout, node_id: str, load_device, engine_device, peer_stores: PeerStoresFn | None,
                 counters: dict[str, int]):
        self.store = store
        self.layout = layout
        self.node_id = node_id
        self.load_device = load_device
        self.engine_device = engine_device
        self.peer_stores = peer_stores
        self.counters = counters
        self._wrap: Callable | None = None

    def wrap_stores(self, fn: Callable) -> None:
        """Apply ``fn`` to the store now and to every peer store when first used (fault injection)."""
        self._wrap = fn
        if self.store is not None:
            fn(self.store)

    async def lookup(self, tokens: list[int], hasher: BlockHasher, limit: int | None = None) -> ResumePoint | None:
        return await store_lookup(self.store, tokens, hasher, limit)

    async def recall(self, tokens: list[int], hasher: BlockHasher, from_position: int, timeout_s: float,
                     held_blocks: int = 0) -> ResumePoint | None:
        """``disagg.flow`` NOTE 16 over the node's host tier (``HostTier`` NOTE 9)."""
        if self.store is None:
            return None
        return await asyncio.to_thread(self._recall, tokens, hasher, from_position, timeout_s, held_blocks)

    def _recall(self, tokens: list[int], hasher: BlockHasher, from_position: int, timeout_s: float,
                held_blocks: int) -> ResumePoint | None:
        if not self.store.recall(tokens, hasher, from_position, len(tokens) - 1, timeout_s):
            return None
        point = self.store.resumable_length(tokens, hasher, len(tokens) - 1, held_blocks)
        return ResumePoint(point.position, point.slowest_tier)

    async def load(self, tokens: list[int], position: int, hasher: BlockHasher, params: GenerateParams,
                   node_id: str | None = None, first_block: int = 0) -> Resume | None:
        t0 = time.perf_counter()
        remote = self.peer_stores is not None and node_id is not None and node_id != self.node_id
        state = None
        try:
            state = await asyncio.to_thread(self._load, tokens, position, hasher, node_id if remote else None,
                                            first_block)
        finally:  # a failed or cancelled (deadline) peer load counts as one
            if remote:
                self.counters["peer_loads" if state is not None else "peer_load_failures"] += 1
        if state is None:
            return None
        return Resume(state, position, "host", state.nbytes, time.perf_counter() - t0)

    def _load(self, tokens: list[int], position: int, hasher: BlockHasher, node_id: str | None, first_block: int):
        store = self.peer_stores(node_id) if node_id is not None else None
        if store is None:
            store = self.store
        elif self._wrap is not None:
            self._wrap(store)  # injected transfer faults reach peer loads too
        return store.load_state(tokens, position, hasher, self.layout, first_block=first_block, contiguous=True,
                                device=self.load_device)

    async def open(self, handle: PrefillHandle, tokens: list[int], hasher: BlockHasher, params: GenerateParams,
                   release_fn: ReleaseFn | None, first_block: int = 0) -> Resume | None:
        """A prefill's state: copied from its device (NOTE 1), else loaded from its node's host tier
        from block ``first_block`` on (``disagg.flow`` NOTE 11)."""
        desc = handle.device_state
        if desc is None:
            return await self.load(tokens, handle.position, hasher, params, handle.node_id, first_block)
        from kv_transfer.transport.device_ipc import open_shared

        t0 = time.perf_counter()
        try:
            state = await asyncio.to_thread(open_shared, desc, self.engine_device)
        finally:
            if release_fn is not None:
                await _quietly(release_fn(handle), f"release of device hand-off {desc.share_id}")
        return Resume(state, handle.position, "peer", desc.nbytes, time.perf_counter() - t0)

    async def publish(self, engine, request_id: str, tokens: list[int], hasher: BlockHasher,
                      also_at: tuple[int, ...] = ()) -> tuple[int, tuple[int, ...]]:
        """Store a held request's state at ``len(tokens)`` and at ``also_at`` (longest first: the
        others share its blocks), releasing the request in the same engine hop as the exports (a hop
        waits for a step, and a prefill's hand-off waits for this). Returns (bytes stored, positions
        whose every piece is stored)."""
        if self.store is None:
            await engine.release(request_id)
            return 0, ()
        positions = (len(tokens), *also_at)
        released = False
        try:
            present = await asyncio.to_thread(self._present_blocks, tokens, hasher)
            released = True
            states = await engine.export_and_release(request_id, positions, present)
        finally:
            if not released:
                await engine.release(request_id)

        def put_all():
            return [self.store.put_state(tokens[:p], st, hasher) for p, st in zip(positions, states, strict=True)]

        results = await asyncio.to_thread(put_all)
        stored = ()
        if not results[0].num_refused:  # the others' blocks are the longest one's
            stored = tuple(p for p, r in zip(positions, results, strict=True) if not r.num_refused)
        return sum(r.bytes_stored for r in results), stored

    async def demote(self, points: list) -> int:
        """The node's tiers evict these resume points (``disagg.reuse.retention.PublishedPoint``)
        first (``disagg.flow`` NOTE 9; one round trip to a node's store process): how many of
        their objects (KDA shards, and tails of unaligned points) some tier held."""
        if self.store is None or not points:
            return 0
        bs = self.layout.block_size

        def demote_all() -> int:
            keys = [k for pt in points for k in self.store.checkpoint_keys(pt.digest, pt.position % bs != 0)]
            return self.store.demote(keys)

        return await asyncio.to_thread(demote_all)

    async def demote_blocks(self, node_id: str, hashes: list[bytes]) -> int:
        """``node_id``'s tiers evict these MLA blocks first, the first first: another node's through
        its state service (NOTE 2; ``disagg.flow`` NOTE 12), whose reads try this node's tiers
        first, so those keep theirs; this node's own (``disagg.flow`` NOTE 13). How many that
        node held (0 without a store for it)."""
        if not node_id or not hashes:
            return 0
        if node_id == self.node_id:
            if self.store is None:
                return 0
            return await asyncio.to_thread(lambda: self.store.demote(self.store.block_keys(hashes)))
        if self.peer_stores is None:
            return 0

        def demote() -> int:
            store = self.peer_stores(node_id)  # may block (NOTE 2): in this thread
            if store is None:
                return 0
            own = {id(t) for t in (self.store.tiers if self.store is not None else ())}
            keys = store.block_keys(hashes)
            return sum(t.demote(keys) for t in store.tiers if id(t) not in own and hasattr(t, "demote"))

        return await asyncio.to_thread(demote)

    def _present_blocks(self, tokens: list[int], hasher: BlockHasher) -> int:
        digests = hasher.block_hashes(tokens)
        if not digests:
            return 0
        flags = self.store.contains_keys([ObjectKey("mla", d) for d in digests])
        n = 0
        while n < len(flags) and flags[n]:
            n += 1
        return n


class StatefulWorker:
    """The reference backend's prefill and decode worker (module docstring).

    Args:
        engine: an ``AsyncEngine``.
        store: the node's ``kv_transfer.store.StateStore`` or None.
        options: the flow's settings (``disagg.flow.FlowOptions``; a replica's: ``FlowOptions.from_config``).
        faults: fault injection (``disagg.faults``), wrapping the flow's interfaces when enabled.
        device_shares: a prefill worker with ``kv_transfer.transport.device_ipc.DeviceShares``
            hands state over device to device (NOTE 1) instead of publishing it.
        peer_stores: other nodes' stores by node id (cross-node loads), or None.
        prefill_pool: the prefill pool's loads and uncached tokens per request (``disagg.flow`` NOTE 5).
        device_holds: mirror the engine's resident sessions into the node's host tier, which
            then evicts first what this device holds and gets back what it evicts
            (``transfer.host.victim``; ``disagg.workers.holds``). Decoding workers only.
    """

    def __init__(self, engine, store=None, replica_id: str = "local", node_id: str = "local",
                 *, options: FlowOptions | None = None, faults: FaultInjector | None = None, device_shares=None,
                 peer_stores: PeerStoresFn | None = None, prefill_pool: PoolFn | None = None,
                 device_holds: bool = False):
        self.engine = engine  # AsyncEngine
        self.store = store
        self.replica_id = replica_id
        self.node_id = node_id
        self.faults = faults if faults is not None and faults.enabled else None
        self.peer_stores = peer_stores
        self.device_shares = device_shares
        self.hasher = BlockHasher(engine.block_size, KeyExtras(engine.model_id))
        # loaded MLA rows go straight to a GPU engine's device (kv_transfer.direct); on CPU they
        # stay in host memory, which is where the engine reads them
        device = engine.device
        load_device = device if device is not None and torch.device(device).type != "cpu" else None
        if store is not None and load_device is not None:
            try:  # the device checksum's kernel and constants now, not in the first resume's TTFT
                store.warm(load_device)
            except Exception as e:  # noqa: BLE001 - a cold first load is slower, not wrong
                log.warning("warming direct loads to %s failed: %s", load_device, e)
        self.flow = RequestFlow(engine, None, replica_id, options, prefill_pool=prefill_pool, node_id=node_id)
        self.reuse = self.flow.reuse
        self.counters = self.flow.counters
        state = TierState(store, engine.layout, node_id, load_device, device, peer_stores, self.counters)
        self.flow.state = FaultyState(state, self.faults) if self.faults is not None else state
        self.holds = None  # transfer.host.victim (disagg.workers.holds)
        if device_holds and store is not None:
            from disagg.workers.holds import DeviceHolds

            base = getattr(engine, "engine", None)  # the ReferenceEngine an AsyncEngine steps
            export = getattr(base, "export_resident", None)
            self.holds = DeviceHolds(store, self.hasher, export_fn=None if export is None else (
                lambda rid, position, first: engine.call_blocking(export, rid, position, first, timeout_s=10.0)))
            if not engine.watch_residents(self.holds.on_change):
                self.holds.close()
                raise ValueError("transfer.host.victim needs an engine that reports its resident sessions "
                                 "(the reference engine)")

    # -- decode side: the request flow ------------------------------------------------------
    def generate(self, params: GenerateParams, prefill_fn: PrefillFn | None = None,
                 release_fn: ReleaseFn | None = None) -> AsyncIterator[StreamChunk]:
        """Stream one request (``disagg.flow``); ``release_fn(handle)`` frees a device hand-off."""
        hasher = self.hasher.with_salt(params.cache_salt)
        if self.faults is None:
            return self.flow.generate(params, hasher, prefill_fn, release_fn)
        if prefill_fn is not None:
            prefill_fn = self.faults.guard_prefill_fn(prefill_fn, self.flow.options.prefill_retries + 1)
        return self.faults.guard_decode(params, self.flow.generate(params, hasher, prefill_fn, release_fn))

    async def end_session(self, end: SessionEnd) -> int:
        """The session is over (``disagg.flow`` NOTE 14): objects this node's tiers now evict first."""
        return await self.flow.end_session_by_id(end.session_id, end.cache_salt)

    # -- prefill side ------------------------------------------------------------------------
    async def prefill(self, params: GenerateParams) -> PrefillHandle:
        engine = self.engine if self.faults is None else self.faults.guard_prefill_engine(self.engine, params)
        t0 = time.perf_counter()
        tokens = params.prompt_token_ids
        hasher = self.hasher.with_salt(params.cache_salt)
        plan = await self.flow.plan_resume(tokens, hasher, params)
        rid = f"{params.request_id}/prefill"
        req = EngineRequest(rid, tokens, replace(params.sampling, max_tokens=1), keep_state=True,
                            first_output_index=params.resumed_output_tokens, cached_source=plan.source,
                            cache_salt=params.cache_salt, checkpoint_at=params.checkpoint_at)
        last = None
        async for out in engine.generate(req, plan.state):
            last = out
        assert last is not None and last.new_token_ids, "prefill produced no token"
        computed_at = time.time()  # its engine's reports stop counting it (PrefillHandle.computed_at)
        compute_s = time.perf_counter() - t0
        shared, stored = None, ()
        try:
            if self.device_shares is not None:  # NOTE 1
                t1 = time.perf_counter()
                try:
                    state = await self.engine.export_state(rid, None, 0, on_device=True)
                    shared = await asyncio.to_thread(self.device_shares.share, state)
                finally:
                    await self.engine.release(rid)  # the prefix stays resident on this device for the next turn
                nbytes, pub_s = shared.nbytes, time.perf_counter() - t1
            else:  # the prompt end, and its aligned checkpoint (engine NOTE 5) for a next prompt that only shares blocks
                try:
                    positions = await self.engine.checkpoint_positions(rid)
                except KeyError:  # not held any more: publish the prompt end alone (``publish`` logs, releases)
                    positions = []
                nbytes, pub_s, stored = await self.flow.publish(rid, tokens, hasher,
                                                                earlier_checkpoints(positions, len(tokens)))
                if stored and (plan.source == "peer" or params.decode_node not in ("", self.node_id)):  # NOTE 3
                    self.flow.spawn(self.flow.demote(points_at(tokens, hasher, sorted(stored), params.request_id)))
        except BaseException:  # cancelled (the client left) or failed before the release: the held
            self.flow.spawn(_quietly(self.engine.release(rid), f"release of {rid}"))  # blocks go back
            if shared is not None:
                self.flow.spawn(_quietly(asyncio.to_thread(self.device_shares.release, shared.share_id),
                                         f"device hand-off {shared.share_id}"))
            raise
        self.counters["prefills"] += 1
        return PrefillHandle(len(tokens), last.new_token_ids[0], last.num_cached_tokens, last.cached_source,
                             self.replica_id, self.node_id, nbytes, pub_s, compute_s, shared, stored, plan.failure,
                             first_logprob=last.logprobs[0] if last.logprobs else None, computed_at=computed_at)

    def shutdown(self) -> None:
        """Stop the engine and the device holds' threads (their holds end with their connection)."""
        if self.holds is not None:
            self.holds.close()
        self.engine.shutdown()

    async def drain(self) -> None:
        """Wait for background publishes, and the device holds' queue (graceful shutdown, tests)."""
        await self.flow.drain()
        if self.holds is not None:
            await asyncio.to_thread(self.holds.flush)

    def stats(self) -> dict:
        out = {"worker": dict(self.counters), "engine": self.engine.stats(), "pd_decisions": dict(self.flow.decisions),
               "reuse": self.reuse.stats()}
        if self.store is not None:
            out["store"] = self.store.stats()
        if self.holds is not None:
            out["device_holds"] = self.holds.stats()
        return out


def continue_params(params: GenerateParams, streamed: list[int], attempt: int) -> GenerateParams:
    """The request that continues ``params`` after its output ``streamed`` was sent (``disagg.flow`` NOTE 4).

    The prompt grows by the streamed tokens and ``max_tokens`` shrinks by as many, so greedy (and
    seeded) decoding of the continuation yields exactly the tokens the lost stream had left to send.
    """
    assert len(streamed) < params.sampling.max_tokens, "nothing left to continue"
    return replace(params, request_id=f"{params.request_id}~{attempt}",
                   prompt_token_ids=[*params.prompt_token_ids, *streamed],
                   sampling=replace(params.sampling, max_tokens=params.sampling.max_tokens - len(streamed)),
                   resumed_output_tokens=params.resumed_output_tokens + len(streamed), prefill=None)


def _session_key(params: GenerateParams) -> str | None:
    return session_key(params.cache_salt, params.session_id) or None
