"""A node's host tier served over a real gRPC state server on loopback, as another node reads it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from deployments.node_store import grpc_client_config, grpc_server_config
from disagg.config import GrpcConfig
from kv_transfer.tiers.host import HostTier
from kv_transfer.transport import RemoteStore, StateServer

TOKEN_ENV = "DISAGG_TEST_PEER_TOKEN"  # the test sets it (monkeypatch) to the shared secret


@contextmanager
def served_tier(capacity_bytes: int = 64 << 20) -> Iterator[tuple[HostTier, StateServer, RemoteStore]]:
    """(the served node's host tier, its state server, a client of it); stopped and closed after."""
    g = GrpcConfig(token_env=TOKEN_ENV)
    tier = HostTier(capacity_bytes, pin_memory=False)
    server = StateServer(tier, grpc_server_config(g, "127.0.0.1"))
    port = server.start()
    remote = RemoteStore(grpc_client_config(g, f"127.0.0.1:{port}"))
    try:
        yield tier, server, remote
    finally:
        server.stop(0)
        remote.close()
        tier.close()
