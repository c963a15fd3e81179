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
"""

from __future__ import annotations

import logging
import os

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from disagg.config import AppConfig

log = logging.getLogger(__name__)
NAMESPACE = "disagg"
_PREFIX = "disagg-node-store-"


@ray.remote(num_cpus=0)
class NodeStoreActor:
    def __init__(self, transfer: dict, node_id: str):
        from disagg.config import TransferConfig
        from kv_transfer.events import EventLog
        from kv_transfer.tiers.host import HostTier
        from kv_transfer.tiers.host_ipc import HostTierServer

        cfg = TransferConfig.model_validate(transfer)
        self.node_id = node_id
        self.events = EventLog()
        self.disk = None
        on_evict = None
        if cfg.disk.enabled:
            from kv_transfer.tiers.disk import DiskTier

            path = os.path.join(cfg.disk.path, node_id[:12])
            self.disk = DiskTier(path, int(cfg.disk.capacity_gb * (1 << 30)), admission=cfg.disk.admission,
                                 event_log=self.events, worker_id=node_id)
            on_evict = self.disk.put_bytes  # write-behind: the disk tier queues and writes in the background
        self.host = HostTier(cfg.host.capacity_mb << 20, eviction=cfg.host.policy, pin_memory=cfg.host.pin_memory,
                             on_evict=on_evict, event_log=self.events, worker_id=node_id)
        self.server = HostTierServer(self.host)

    def address(self) -> str:
        return self.server.socket_path

    def disk_get(self, key: str) -> bytes | None:
        return None if self.disk is None else self.disk.get_bytes(key)

    def disk_contains(self, keys: list[str]) -> list[bool]:
        return [False] * len(keys) if self.disk is None else self.disk.contains(keys)

    def disk_delete(self, key: str) -> bool:
        return False if self.disk is None else self.disk.delete(key)

    def take_events(self) -> list:
        return self.events.take()

    def stats(self) -> dict:
        out = {"host": self.host.stats()}
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        return out

    def shutdown(self) -> None:
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
