"""Fixtures for the transport tests: a served in-memory store and its clients."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kv_transfer.tiers.memory import DictByteStore
from kv_transfer.transport.grpc_transport import (
    RemoteStore,
    RemoteStoreConfig,
    StateServer,
    StateServerConfig,
)

TOKEN = "test-token-7f3a"


class RecordingStore(DictByteStore):
    """A DictByteStore that counts every call made on it."""

    def __init__(self, name: str = "recording"):
        super().__init__(name)
        self.num_calls = 0

    def put_bytes(self, key, data):
        self.num_calls += 1
        return super().put_bytes(key, data)

    def get_bytes(self, key):
        self.num_calls += 1
        return super().get_bytes(key)

    def contains(self, keys):
        self.num_calls += 1
        return super().contains(keys)

    def delete(self, key):
        self.num_calls += 1
        return super().delete(key)


@pytest.fixture
def make_server() -> Iterator[Callable[..., StateServer]]:
    """Starts StateServers on 127.0.0.1 (ephemeral ports); all stopped at teardown."""
    servers: list[StateServer] = []

    def make(store=None, **overrides) -> StateServer:
        config = StateServerConfig(**{"token": TOKEN, "address": "127.0.0.1:0", **overrides})
        server = StateServer(store if store is not None else DictByteStore(), config)
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop(0)


@pytest.fixture
def make_client() -> Iterator[Callable[..., RemoteStore]]:
    """Builds RemoteStores; all closed at teardown."""
    clients: list[RemoteStore] = []

    def make(address: str, **overrides) -> RemoteStore:
        client = RemoteStore(RemoteStoreConfig(**{"address": address, "token": TOKEN, **overrides}))
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def recording_store() -> RecordingStore:
    return RecordingStore()
