"""Shared fixtures: a controlled-timing test server over real HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from disagg.tools.bench.testserver import TestServer, TestServerConfig


@pytest.fixture
def server_factory() -> Iterator:
    servers: list[TestServer] = []

    def start(**config: object) -> TestServer:
        server = TestServer(TestServerConfig(**config)).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
