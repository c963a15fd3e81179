"""The tiers a connector process reads and writes, from ``kv_connector_extra_config``.

    host_socket: /dev/shm/...sock   the node's shared host tier (HostTierClient; the
                                    Serve deployments pass the node store's socket)
    local_tier: <name>              an in-process tier registered with
                                    ``register_local_tier`` (tests, single-process tools)
    token_env: DISAGG_TRANSFER_TOKEN  env var with the gRPC secret for remote peers

Each connector process (the scheduler side in the engine core, one worker per
rank) opens its own client; clients of one node see the same bytes.

A consumer reading state written under another DCP size, or held on another
node, gets a ``StateStore`` for that case from ``StoreSet.get``: same tiers (plus
the peer's gRPC ``RemoteStore`` as a lower tier), keys of the writer's DCP size.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from kv_transfer.events import EventLog
from kv_transfer.objects import StateLayout
from kv_transfer.store import StateStore
from kv_transfer.tiers.base import ByteStore

_LOCAL_TIERS: dict[str, ByteStore] = {}
_LOCAL_LOCK = threading.Lock()


def register_local_tier(name: str, tier: ByteStore) -> None:
    """Make ``tier`` available to connectors of this process as ``local_tier: name``."""
    with _LOCAL_LOCK:
        _LOCAL_TIERS[name] = tier


def unregister_local_tier(name: str) -> None:
    with _LOCAL_LOCK:
        _LOCAL_TIERS.pop(name, None)


def open_tiers(extra: dict[str, Any]) -> list[ByteStore]:
    """The first tiers named in the extra config (speed order).

    Raises:
        ValueError: no tier configured, or an unknown local tier name.
    """
    tiers: list[ByteStore] = []
    name = extra.get("local_tier")
    if name:
        with _LOCAL_LOCK:
            tier = _LOCAL_TIERS.get(name)
        if tier is None:
            raise ValueError(f"local_tier {name!r} is not registered in this process")
        tiers.append(tier)
    sock = extra.get("host_socket")
    if sock:
        from kv_transfer.tiers.host_ipc import HostTierClient

        tiers.append(HostTierClient(sock))
    if not tiers:
        raise ValueError("kv_connector_extra_config needs 'host_socket' (node store) or 'local_tier'")
    return tiers


class StoreSet:
    """``StateStore``s over one process's tiers, one per (writer DCP size, peer)."""

    def __init__(self, tiers: list[ByteStore], layout: StateLayout, tp_size: int, dcp_size: int,
                 worker_id: str = "", token_env: str = "DISAGG_TRANSFER_TOKEN", peer_timeout_s: float = 5.0):
        self.tiers, self.layout = tiers, layout
        self.tp_size, self.dcp_size = tp_size, dcp_size
        self.worker_id, self.token_env, self.peer_timeout_s = worker_id, token_env, peer_timeout_s
        self.event_log = EventLog()
        self._stores: dict[tuple[int, str], StateStore] = {}
        self._peers: dict[str, ByteStore] = {}
        self._lock = threading.Lock()

    @property
    def own(self) -> StateStore:
        """The store this engine writes (its own DCP size, local tiers)."""
        return self.get(self.dcp_size)

    def get(self, dcp_size: int, peer: str | None = None) -> StateStore:
        key = (dcp_size, peer or "")
        with self._lock:
            store = self._stores.get(key)
            if store is None:
                tiers = list(self.tiers)
                if peer:
                    tiers.append(self._peer(peer))
                store = StateStore(tiers, self.layout, tp_size=self.tp_size, dcp_size=dcp_size,
                                   write_behind=False, event_log=self.event_log, worker_id=self.worker_id)
                self._stores[key] = store
            return store

    def _peer(self, address: str) -> ByteStore:
        peer = self._peers.get(address)
        if peer is None:
            from kv_transfer.transport import RemoteStore, RemoteStoreConfig

            token = os.environ.get(self.token_env, "")
            peer = RemoteStore(RemoteStoreConfig(address, token=token, timeout_s=self.peer_timeout_s))
            self._peers[address] = peer
        return peer

    def close(self) -> None:
        for peer in self._peers.values():
            close = getattr(peer, "close", None)
            if close is not None:
                close()
