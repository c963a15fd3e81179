"""A call without the shared secret is refused before the store is touched."""

from __future__ import annotations

import logging

import grpc
import pytest

from kv_transfer.transport.framing import Chunk, KeyBatch
from kv_transfer.transport.grpc_protocol import TOKEN_METADATA_KEY, method_path


@pytest.mark.parametrize("token", ["wrong-token", "test-token-7f3", "test-token-7f3a "])
def test_wrong_token_is_refused_and_store_untouched(
    make_server, make_client, recording_store, caplog, token: str
) -> None:
    store = recording_store
    store.put_bytes("mla:x", b"secret state")
    store.num_calls = 0
    server = make_server(store)
    client = make_client(server.address, token=token)
    with caplog.at_level(logging.ERROR):
        assert client.put_bytes("mla:y", b"intruder") is False
        assert client.get_bytes("mla:x") is None
        assert client.contains(["mla:x"]) == [False]
        assert client.delete("mla:x") is False
        assert client.server_stats() is None
    assert store.num_calls == 0
    assert store.keys() == ["mla:x"]
    assert client.stats()["auth_failures"] == 5
    assert server.stats().num_auth_failures == 5
    refusals = [r for r in caplog.records if "UNAUTHENTICATED" in r.getMessage()]
    assert len(refusals) == 1  # surfaced once, then only counted


@pytest.mark.parametrize(
    "metadata", [None, (), ((TOKEN_METADATA_KEY, ""),), (("authorization", "x"),)]
)
def test_missing_token_is_refused(make_server, recording_store, metadata) -> None:
    store = recording_store
    server = make_server(store)
    with grpc.insecure_channel(server.address) as channel:
        push = channel.stream_unary(method_path("Push"))
        frames = iter([Chunk("mla:y", 3, 0, b"abc").encode()])
        with pytest.raises(grpc.RpcError) as err:
            push(frames, timeout=5, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        fetch = channel.unary_stream(method_path("Fetch"))
        with pytest.raises(grpc.RpcError) as err:
            list(fetch(KeyBatch(["mla:y"]).encode(), timeout=5, metadata=metadata))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert store.num_calls == 0
    assert len(store) == 0


def test_empty_token_is_a_config_error() -> None:
    from kv_transfer.transport.grpc_transport import RemoteStoreConfig, StateServerConfig

    with pytest.raises(ValueError):
        StateServerConfig(token="")
    with pytest.raises(ValueError):
        RemoteStoreConfig("127.0.0.1:1", token="two\nlines")
