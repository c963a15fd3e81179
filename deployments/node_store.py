"""One state store per node, shared by the node's prefill and decode replicas.

A named Ray actor per node (``NodeStoreActor``) owns the node's host tier (a
shared-memory arena with its index) and, when enabled, the disk tier that host
evictions write behind to. Replicas on the node attach to the arena through a
Unix socket (``HostTierClient``) and read and write state bytes directly in
shared memory: no state byte passes through Ray. Disk reads, rare by design,
go through the actor.

    replica A --+                     +-- arena (/dev/shm, pinned where a GPU exists)
                +-- unix socket ----> NodeStoreActor -- index, eviction
    replica B --+                     +-- disk tier (write-behind segments)
                                      +-- gRPC state service (transfer.grpc.enabled)

Cross-node (``transfer.grpc.enabled``): each node store serves its host tier to
the other nodes (``kv_transfer.transport.StateServer``: the shared token from
``$token_env``, TLS/mTLS from the PEM paths, ``max_message_mb`` on both ends,
bound to ``bind``). A decode replica whose prefill ran on another node loads the
published state through ``PeerStores``: its own tiers first, then that node's
service (``RemoteStore``); what it fetches is promoted into its own host tier.

    node A: prefill replica -> host tier A --gRPC (token, TLS)--> decode replica on node B
                                                                  (host tier B, then peer A)

Spill to the pool (``transfer.spill``, with ``transfer.grpc``): what the last tier of a node
without prefill replicas evicts goes to a prefill node's host tier (``kv_transfer.spill``), so
a session whose decode node ran out of room is resumed by the pool, not recomputed.

    node B (decode only): host tier B [-> disk B] --evicted--> Spiller --gRPC put--> host tier A

NOTES
1. Nodes, not replicas, hold state: every replica of a node shares its node store.
2. A node is in the pool while a prefill replica runs there (``pool_join`` / ``pool_leave``).
   A node outside it sends its evictions to the pool node at its rank among the nodes outside
   (sorted node ids) modulo the number of pool nodes, found again every ``spill.refresh_s``:
   each pool node takes an equal share of the decode nodes, as in the simulator (Simulator
   NOTE 4). A pool node's own evictions are not spilled (nothing would resume them sooner),
   nor are objects the flow demoted (superseded checkpoints: ``HostTier`` NOTE 6).
3. The receiving host tier reports what it stores to the routers like any put, and the
   sending tier its evictions: the index follows the move without a message of its own.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from disagg.config import AppConfig, GrpcConfig

if TYPE_CHECKING:
    from kv_transfer.store import StateStore

log = logging.getLogger(__name__)
NAMESPACE = "disagg"
_PREFIX = "disagg-node-store-"
_ANY_HOST = ("0.0.0.0", "::", "[::]")  # bind hosts that listen on every interface


@ray.remote(num_cpus=0)
class NodeStoreActor:
    def __init__(self, transfer: dict, node_id: str):
        from disagg.config import TransferConfig
        from kv_transfer.events import EventLog
        from kv_transfer.tiers.host import HostTier
        from kv_transfer.tiers.host_ipc import HostTierServer

        cfg = TransferConfig.model_validate(transfer)
        self.cfg = cfg
        self.node_id = node_id
        self.events = EventLog()
        self._pool: set[str] = set()  # prefill replicas running on this node (NOTE 2)
        self.spiller = None  # spill to the pool (NOTE 2; transfer.spill with transfer.grpc)
        self._spill_to: tuple[str, object] | None = None  # (pool node id, its RemoteStore)
        self._looked_at = float("-inf")  # monotonic time the pool was last looked up
        self.num_spill_skipped = 0  # evictions not offered: this node is in the pool, or no pool exists
        on_evict = None
        if cfg.grpc.enabled and cfg.spill.enabled:
            from kv_transfer.spill import Spiller

            self.spiller = Spiller(self._spill_target, max_pending_bytes=cfg.spill.max_pending_mb << 20,
                                   name=f"spill-{node_id[:12]}")
            on_evict = self._spill
        self.disk = None
        if cfg.disk.enabled:
            from kv_transfer.tiers.disk import DiskTier

            path = os.path.join(cfg.disk.path, node_id[:12])
            self.disk = DiskTier(path, int(cfg.disk.capacity_gb * (1 << 30)), admission=cfg.disk.admission,
                                 event_log=self.events, worker_id=node_id, on_evict=on_evict)
            on_evict = self.disk.put_bytes  # write-behind: the disk tier queues and writes in the background
        # a spill straight from the host tier passes demoted objects by (HostTier NOTE 6); the disk's
        # write-behind takes them, as it always has
        self.host = HostTier(cfg.host.capacity_mb << 20, eviction=cfg.host.policy, pin_memory=cfg.host.pin_memory,
                             slab_bytes=(cfg.host.slab_kb << 10) or None,
                             on_evict=on_evict, hand_on_demoted=self.disk is not None, event_log=self.events,
                             worker_id=node_id)
        self.server = HostTierServer(self.host)
        self.state_server = None  # the gRPC state service (transfer.grpc.enabled)
        self.grpc_address_: str | None = None  # host:port peers dial
        if cfg.grpc.enabled:
            from kv_transfer.transport import StateServer

            node_ip = ray.util.get_node_ip_address()
            self.state_server = StateServer(self.host, grpc_server_config(cfg.grpc, node_ip))
            port = self.state_server.start()
            self.grpc_address_ = advertised_address(self.state_server.config.address, port, node_ip)
            log.info("node %s serves its host tier to peers on %s", node_id[:12], self.grpc_address_)

    def address(self) -> str:
        return self.server.socket_path

    # -- the pool and the spill to it (NOTE 2) -------------------------------------------------
    def pool_join(self, replica_id: str) -> None:
        """A prefill replica runs on this node: it is in the pool."""
        self._pool.add(replica_id)

    def pool_leave(self, replica_id: str) -> None:
        self._pool.discard(replica_id)

    def pool_info(self) -> tuple[bool, str | None]:
        """(whether this node is in the pool, the address of its gRPC state service)."""
        return bool(self._pool), self.grpc_address_

    def _spill(self, key: str, data: bytes) -> None:
        """The last tier's ``on_evict``: offer the object to the spiller unless nothing would take it."""
        recent = time.monotonic() - self._looked_at < self.cfg.spill.refresh_s
        if self._pool or (recent and self._spill_to is None):
            self.num_spill_skipped += 1
            return
        self.spiller.offer(key, data)

    def _spill_target(self):
        """The pool node's ``RemoteStore`` this node spills to (NOTE 2), None when no pool exists.
        Called by the spiller's writer thread; the lookup is Ray calls, renewed every refresh_s."""
        from kv_transfer.transport import RemoteStore

        if time.monotonic() - self._looked_at >= self.cfg.spill.refresh_s:
            pool, outside = {}, []
            for node in ray.nodes():
                node_id = node["NodeID"]
                if not node.get("Alive") or node_id == self.node_id:
                    continue
                actor = node_store_actor_of(node_id)
                if actor is None:  # no node store there (yet): not a target
                    continue
                try:
                    in_pool, address = ray.get(actor.pool_info.remote(), timeout=self.cfg.grpc.deadline_s)
                except Exception:  # noqa: BLE001 - it is gone or does not answer: not a target
                    continue
                if in_pool and address:
                    pool[node_id] = address
                elif not in_pool:
                    outside.append(node_id)
            self._looked_at = time.monotonic()
            rank = sorted([*outside, self.node_id]).index(self.node_id)
            target = sorted(pool)[rank % len(pool)] if pool and not self._pool else None
            old = self._spill_to
            if old is None or old[0] != target:
                self._spill_to = None if target is None else (
                    target, RemoteStore(grpc_client_config(self.cfg.grpc, pool[target])))
                if old is not None:
                    old[1].close()
                if target is not None:
                    log.info("node %s spills its evictions to pool node %s", self.node_id[:12], target[:12])
        return None if self._spill_to is None else self._spill_to[1]

    def grpc_address(self) -> str | None:
        """``host:port`` of this node's gRPC state service (None when transfer.grpc is off)."""
        return self.grpc_address_

    def disk_get(self, key: str) -> bytes | None:
        return None if self.disk is None else self.disk.get_bytes(key)

    def disk_contains(self, keys: list[str]) -> list[bool]:
        return [False] * len(keys) if self.disk is None else self.disk.contains(keys)

    def disk_delete(self, key: str) -> bool:
        return False if self.disk is None else self.disk.delete(key)

    def take_events(self) -> list:
        return self.events.take()

    def clear(self) -> int:
        """Drop every host-tier object no reader holds (e.g. weights changed under the same model
        id, so stored state no longer matches); returns how many were dropped. Router indexes
        hear of each as an eviction."""
        return sum(self.host.delete(key) for key in self.host.keys())

    def stats(self) -> dict:
        out = {"host": self.host.stats()}
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        if self.state_server is not None:
            from dataclasses import asdict

            out["grpc"] = {"address": self.grpc_address_, **asdict(self.state_server.stats())}
        if self.spiller is not None:
            to = self._spill_to
            out["spill"] = {**self.spiller.stats(), "num_skipped": self.num_spill_skipped, "in_pool": bool(self._pool),
                            "target": None if to is None else to[0]}
        return out

    def spill_flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every eviction offered so far was sent (tests, a drain); False on timeout."""
        return True if self.spiller is None else self.spiller.flush(timeout_s)

    def shutdown(self) -> None:
        if self.spiller is not None:
            self.spiller.close()
            if self._spill_to is not None:
                self._spill_to[1].close()
        if self.state_server is not None:
            self.state_server.stop(grace=1.0)
        self.server.close()
        self.host.close()
        if self.disk is not None:
            self.disk.close()


class ActorDiskStore:
    """``ByteStore`` view of the node actor's disk tier (reads go through Ray)."""

    name = "disk"

    def __init__(self, actor):
        self._actor = actor

    def put_bytes(self, key: str, data) -> bool:
        return False  # the disk tier is filled by host-tier write-behind only

    def get_bytes(self, key: str) -> bytes | None:
        return ray.get(self._actor.disk_get.remote(key))

    def contains(self, keys) -> list[bool]:
        return ray.get(self._actor.disk_contains.remote(list(keys)))

    def delete(self, key: str) -> bool:
        return ray.get(self._actor.disk_delete.remote(key))


def node_store_actor_of(node_id: str):
    """The node's ``NodeStoreActor`` handle, None when the node runs none (yet); never starts one."""
    try:
        return ray.get_actor(_PREFIX + node_id, namespace=NAMESPACE)
    except ValueError:
        return None


def node_store_actor(cfg: AppConfig, node_id: str):
    return NodeStoreActor.options(
        name=_PREFIX + node_id, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(cfg.transfer.model_dump(), node_id)


def connect_node_store(cfg: AppConfig, node_id: str, layout):
    """The ``StateStore`` a replica on ``node_id`` uses (host tier, then disk) for ``layout``."""
    from kv_transfer.store import StateStore
    from kv_transfer.tiers.host_ipc import HostTierClient

    actor = node_store_actor(cfg, node_id)
    tiers = [HostTierClient(ray.get(actor.address.remote()))]
    if cfg.transfer.disk.enabled:
        tiers.append(ActorDiskStore(actor))
    return StateStore(tiers, layout, write_behind=False, worker_id=node_id)


# -- the cross-node state service (transfer.grpc) ----------------------------------------------
def _token(g: GrpcConfig) -> str:
    token = os.environ.get(g.token_env, "")
    if not token:
        raise ValueError(f"transfer.grpc.enabled needs the shared secret in ${g.token_env} on every node")
    return token


def _pem(path: str, field: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"transfer.grpc.{field} {path!r} cannot be read: {exc}") from exc


def _sizes(g: GrpcConfig) -> tuple[int, int]:
    """(chunk_bytes, max_message_bytes): the configured message limit, chunks that fit under it."""
    from kv_transfer.transport.framing import frame_overhead_bytes
    from kv_transfer.transport.grpc_protocol import DEFAULT_CHUNK_BYTES

    max_message = g.max_message_mb << 20
    return min(DEFAULT_CHUNK_BYTES, max_message - frame_overhead_bytes()), max_message


def grpc_server_config(g: GrpcConfig, node_ip: str):
    """The ``StateServerConfig`` of a node's state service: token, TLS (mutual: peers present their
    node certificate), message limits, and ``g.bind`` (an empty host binds ``node_ip``).

    Raises:
        ValueError: the token is not in the environment, or a PEM file cannot be read.
    """
    from kv_transfer.transport import StateServerConfig, TlsServerConfig

    host, _, port = g.bind.rpartition(":")
    tls = None
    if g.tls_cert:
        tls = TlsServerConfig(_pem(g.tls_cert, "tls_cert"), _pem(g.tls_key, "tls_key"), _pem(g.tls_ca, "tls_ca"))
    chunk, max_message = _sizes(g)
    return StateServerConfig(token=_token(g), address=f"{host or node_ip}:{port}", chunk_bytes=chunk,
                             max_message_bytes=max_message, tls=tls)


def grpc_client_config(g: GrpcConfig, address: str):
    """The ``RemoteStoreConfig`` for reaching a peer's service at ``address`` (same token, TLS
    material and limits as the server side; ``deadline_s`` per call)."""
    from kv_transfer.transport import RemoteStoreConfig, TlsClientConfig

    tls = None
    if g.tls_cert:
        tls = TlsClientConfig(_pem(g.tls_ca, "tls_ca"), _pem(g.tls_cert, "tls_cert"), _pem(g.tls_key, "tls_key"))
    chunk, max_message = _sizes(g)
    return RemoteStoreConfig(address, token=_token(g), timeout_s=g.deadline_s, chunk_bytes=chunk,
                             max_message_bytes=max_message, tls=tls)


def advertised_address(bind: str, port: int, node_ip: str) -> str:
    """The address peers dial: the bound host, or ``node_ip`` when bound to every interface."""
    host = bind.rpartition(":")[0]
    return f"{node_ip if host in _ANY_HOST else host}:{port}"


class PeerStores:
    """``node_id -> StateStore`` reading that node's host tier through its gRPC service.

    Each store holds this replica's own tiers first, then the peer's ``RemoteStore``, so a
    load takes what is already here and fetches the rest; fetched objects are promoted into
    this node's host tier. ``None`` for this node, or a node that serves no state.

    NOTES
    1. One ``RemoteStore`` (one channel) per peer node for the life of the replica.
    2. Looking up a peer is a Ray call: call from a worker thread, never the event loop.
    """

    def __init__(self, cfg: AppConfig, node_id: str, local: StateStore):
        self.grpc = cfg.transfer.grpc
        self.node_id = node_id
        self.layout = local.layout
        self.tiers = list(local.tiers)  # the replica's own tiers (before any fault wrapper)
        self._stores: dict[str, StateStore | None] = {}
        self._remotes: list = []  # RemoteStore per peer (closed by ``close``)
        self._lock = threading.Lock()

    def __call__(self, node_id: str) -> StateStore | None:
        if not node_id or node_id == self.node_id:
            return None
        with self._lock:
            if node_id in self._stores:
                return self._stores[node_id]
        from kv_transfer.store import StateStore
        from kv_transfer.transport import RemoteStore

        actor = ray.get_actor(_PREFIX + node_id, namespace=NAMESPACE)
        address = ray.get(actor.grpc_address.remote(), timeout=self.grpc.deadline_s)
        store = None
        if address is not None:
            peer = RemoteStore(grpc_client_config(self.grpc, address))
            store = StateStore([*self.tiers, peer], self.layout, write_behind=False, worker_id=self.node_id)
        with self._lock:
            if node_id in self._stores:  # another thread got there first
                if store is not None:
                    peer.close()
                return self._stores[node_id]
            self._stores[node_id] = store
            if store is not None:
                self._remotes.append(peer)
            return store

    def close(self) -> None:
        with self._lock:
            remotes, self._remotes, self._stores = self._remotes, [], {}
        for remote in remotes:
            remote.close()


def shutdown_node_stores() -> None:
    """Stop every node store actor of this cluster (their arenas and sockets are removed)."""
    for node in ray.nodes():
        try:
            handle = ray.get_actor(_PREFIX + node["NodeID"], namespace=NAMESPACE)
        except ValueError:
            continue
        try:
            ray.get(handle.shutdown.remote(), timeout=10)
        except Exception:
            log.warning("node store on %s did not shut down cleanly", node["NodeID"][:12])
        ray.kill(handle)
