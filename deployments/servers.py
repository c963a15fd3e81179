"""Ray Serve deployments: the prefill server and the decode server.

Each replica owns an engine (through the engine protocol: the reference engine
now, vLLM later) and a client of its node's shared host tier. The decode
server orchestrates a request: it prefills locally when the uncached suffix is
short (conditional disaggregation) or asks a prefill replica, then loads the
published state by handle and streams tokens.

Replicas report ``record_routing_stats`` (queue, cache and state summaries) to
the request router, answer ``check_health`` and drain on shutdown. A decode
replica keeps its recent requests' first-token stamps (``timings``, see
``deployments.timings``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import aclosing
from functools import partial

from ray import serve

from deployments.node_store import PeerStores, connect_node_store, node_store_actor_of
from deployments.request_router import prefill_finished, prefill_pool_view, replica_nodes
from deployments.timings import RecentTimings
from disagg.config import AppConfig, load_config
from disagg.engine.async_engine import AsyncEngine
from disagg.engine.factory import build_reference_engine
from disagg.faults import FaultInjector, exit_process
from disagg.flow import FlowOptions
from disagg.messages import GenerateParams, PrefillHandle, SessionEnd, StreamChunk, ToReplica
from disagg.workers.tiered import StatefulWorker
from kv_transfer.keys import BlockHasher

log = logging.getLogger("ray.serve")
PREFILL_DEPLOYMENT = "PrefillServer"  # the prefill deployment's name (deployments.app)
DECODE_DEPLOYMENT = "DecodeServer"  # the decode deployment's name (deployments.app)


def device_snapshot(hasher: BlockHasher, sessions: list[tuple]
                    ) -> tuple[list[list[str]], list[list | None], list[list[int] | None]]:
    """What a replica reports of its device-resident sessions (``(cache salt, tokens[, KDA
    checkpoint positions])`` each): per session its block digests (hex); its turn end,
    ``[position, tail digest hex]`` when the position is not a multiple of the block size, else
    None; and the numbers of full blocks at which it has KDA checkpoints, or None when the engine
    does not say (the router then assumes one at the last full block). See
    ``deployments.request_router``."""
    blocks, tails, checkpoints = [], [], []
    for salt, tokens, *rest in sessions:
        h = hasher.with_salt(salt)
        hashes = h.block_hashes(tokens)
        blocks.append([d.hex() for d in hashes])
        n, bs = len(tokens), h.block_size
        tails.append([n, h.prefix_digest(tokens, n, hashes).hex()] if n % bs else None)
        checkpoints.append(sorted({p // bs for p in rest[0] if p % bs == 0 and 0 < p <= n}) if rest else None)
    return blocks, tails, checkpoints


class _ServerBase:
    role = "server"

    @property
    def pool_role(self) -> str:
        """The role reported to routers: what this replica computes (``deployments.request_router``)."""
        return self.role

    def _prefill_nodes(self) -> list[str]:
        """The nodes of the prefill pool this replica hands prompts to ([]: none, or none known yet)."""
        return []

    def __init__(self, config: dict | AppConfig):
        self.config = config if isinstance(config, AppConfig) else load_config(config)
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id if ctx else f"{self.role}-{os.getpid()}"
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        if self.config.engine.backend == "vllm":  # vLLM + the K3 state connector (docs/vllm.md)
            from deployments.node_store import node_store_actor
            from disagg.workers.vllm import build_vllm_worker

            sock = ray.get(node_store_actor(self.config, self.node_id).address.remote())
            self.engine, self.store, self.worker = build_vllm_worker(self.config, self.role, sock,
                                                                     self.replica_id, self.node_id)
        else:
            self.engine = AsyncEngine(build_reference_engine(self.config))
            self.store = connect_node_store(self.config, self.node_id, self.engine.layout)
            faults = FaultInjector(self.config.faults, self.replica_id, self.role, kill=exit_process)  # off by default
            # other nodes' host tiers over their gRPC state service (transfer.grpc; deployments.node_store)
            peers = PeerStores(self.config, self.node_id, self.store) if self.config.transfer.grpc.enabled else None
            # the node's host tier as the decoding devices' victim cache (disagg.workers.holds NOTE 4)
            holds = self.config.transfer.host.victim and self.role == "decode"
            self.worker = StatefulWorker(self.engine, self.store, self.replica_id, self.node_id,
                                         options=FlowOptions.from_config(self.config), faults=faults, peer_stores=peers,
                                         device_holds=holds)
        self._pool_membership(join=True)
        self._draining = False
        self._inflight = 0
        self._snapshot: list[list[str]] = []  # device-resident sessions' block digests (hex)
        self._tails: list[list | None] = []  # and their unaligned turn ends (see device_snapshot)
        self._snapshot_version = -1

    def _pool_membership(self, join: bool) -> None:
        """A prefill replica puts its node in the pool while it runs: the node then resumes what
        nodes without prefill replicas spill (deployments.node_store NOTE 2)."""
        if self.role != "prefill":
            return
        # looked up, never created here: a leave must not start a node store after its shutdown
        actor = node_store_actor_of(self.node_id)
        if actor is None:  # its node store is gone (the node is going): nothing to join or leave
            log.warning("%s %s: node store unreachable for the pool", self.role, self.replica_id)
            return
        (actor.pool_join if join else actor.pool_leave).remote(self.replica_id)

    async def check_health(self) -> None:
        if self.config.engine.backend == "vllm":
            await self.engine.check_health()
        elif not self.engine.is_alive():
            raise RuntimeError("engine step thread died")

    async def record_routing_stats(self) -> dict:
        """Load and device-tier content for the request routers (see deployments.request_router)."""
        version, sessions, load = await self.engine.routing_report(self._snapshot_version)
        # stamped when the engine's figures were read: requests that ended after it are still in them
        # (disagg.router.loads NOTE 6)
        measured_at = load.pop("measured_at", None) or time.time()
        load = {**load, **self.worker.flow.routing_load()}  # P/D: requests on their way (disagg.flow NOTE 15)
        if sessions is not None:
            self._snapshot, self._tails, self._checkpoints = device_snapshot(self.worker.hasher, sessions)
            self._snapshot_version = version
        return {"role": self.pool_role, "node_id": self.node_id, "inflight": self._inflight, "time": measured_at,
                "model_id": self.engine.model_id, "block_size": self.engine.block_size, "load": load,
                "device_version": self._snapshot_version, "device_sessions": self._snapshot,
                "device_tails": self._tails, "device_checkpoints": self._checkpoints,
                "prefill_nodes": self._prefill_nodes()}

    async def stats(self, to: ToReplica | None = None) -> dict:
        """This replica's figures (``to`` names it: the routers send the call here)."""
        out = self.worker.stats()
        out["replica_id"] = self.replica_id
        out["role"] = self.role
        out["node_id"] = self.node_id
        t = self.config.transfer
        if t.grpc.enabled and t.spill.enabled:  # the node's spill to the pool (deployments.node_store NOTE 2)
            out["spill"] = await self._node_spill()
        return out

    async def _node_spill(self) -> dict | None:
        """This node's spill counters (the node store's), tagged with the node: best effort."""
        actor = await asyncio.to_thread(node_store_actor_of, self.node_id)
        if actor is None:
            return None
        try:
            node = await asyncio.wait_for(actor.stats.remote(), timeout=2.0)
        except Exception:  # noqa: BLE001 - its node store is busy or gone: no figures this time
            return None
        spill = node.get("spill")
        return None if spill is None else {**spill, "node_id": self.node_id}

    async def __del__(self):
        """Graceful drain. Serve calls this once the replica has no ongoing request (a stream in
        flight when the stop came has run to its end; deployment.graceful_shutdown_timeout_s
        bounds the whole stop). Streams still counted here, then the turn-end publishes they left
        running in the background, get the rest of that budget; the engine stops last."""
        self._draining = True
        deadline = time.monotonic() + self.config.deployment.graceful_shutdown_timeout_s
        try:
            while self._inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            try:
                await asyncio.wait_for(self.worker.drain(), max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                log.warning("%s %s: background state publishes still running at the drain deadline; "
                            "those turns will be recomputed", self.role, self.replica_id)
        finally:
            self._pool_membership(join=False)
            peers = getattr(self.worker, "peer_stores", None)
            if peers is not None:
                peers.close()
            holds = getattr(self.worker, "holds", None)  # transfer.host.victim: its threads
            if holds is not None:
                holds.close()
            self.engine.shutdown()


class PrefillServer(_ServerBase):
    role = "prefill"

    async def prefill(self, params: GenerateParams) -> PrefillHandle:
        self._inflight += 1
        try:
            return await self.worker.prefill(params)
        finally:
            self._inflight -= 1


class DecodeServer(_ServerBase):
    role = "decode"

    def __init__(self, config: dict | AppConfig, prefill_handle=None):
        super().__init__(config)
        self.prefill_handle = prefill_handle
        self._timings = RecentTimings()
        if prefill_handle is not None:  # the P/D decision sees the prefill pool (disagg.flow NOTE 5)
            self.worker.flow.prefill_pool = partial(prefill_pool_view, PREFILL_DEPLOYMENT)

    @property
    def pool_role(self) -> str:
        return "decode" if self.prefill_handle is not None else "both"  # aggregated: it prefills everything

    def _prefill_nodes(self) -> list[str]:
        # as this process's prefill router knows them (it has one once a prefill was sent)
        return replica_nodes(PREFILL_DEPLOYMENT) if self.prefill_handle is not None else []

    async def _prefill(self, params: GenerateParams) -> PrefillHandle:
        handle = None
        try:
            handle = await self.prefill_handle.prefill.remote(params)
            return handle
        finally:  # this process's prefill router forgets it, done or failed (disagg.router.loads NOTE 6)
            prefill_finished(PREFILL_DEPLOYMENT, params.request_id, handle)

    async def generate(self, params: GenerateParams):
        """Stream ``StreamChunk``s for one request (a Serve streaming method)."""
        stamps = {"entry": time.perf_counter()}
        self._inflight += 1
        try:
            if params.ack:  # taken: the ingress's outage clock stops here (disagg.stream_resume NOTE 1)
                yield StreamChunk(replica_id=self.replica_id)
            fn = self._prefill if self.prefill_handle is not None else None
            try:
                async with aclosing(self.worker.generate(params, fn)) as chunks:  # a cancelled call aborts it
                    async for chunk in chunks:
                        if chunk.token_ids and "first_yield" not in stamps:
                            stamps["first_yield"] = time.perf_counter()
                        yield chunk
            except ValueError as exc:  # refused by the engine: the client's fault
                yield StreamChunk(finished=True, finish_reason="invalid", error=str(exc), replica_id=self.replica_id)
        finally:
            self._inflight -= 1
            engine_trace = getattr(self.engine, "trace", None)  # the reference engine's (disagg.engine.async_engine)
            stamps.update((engine_trace and engine_trace(f"{params.request_id}/decode")) or {})
            self._timings.put(params.request_id, stamps)

    async def timings(self, request_ids: list[str]) -> dict[str, dict]:
        """First-token stamps of recent requests on this replica (``deployments.timings``)."""
        return self._timings.get(request_ids)

    async def end_session(self, end: SessionEnd) -> dict:
        """A session is over (``disagg.flow`` NOTE 14; the ingress asks each decode replica, the
        router sends the call to ``end.replica``): how many objects this node now evicts first."""
        return {"replica": self.replica_id, "demoted": await self.worker.end_session(end)}
