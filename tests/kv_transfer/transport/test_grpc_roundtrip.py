"""Objects cross a loopback StateServer bit-exact, in both directions."""

from __future__ import annotations

import numpy as np
import pytest

from kv_transfer.tiers.base import ByteStore
from kv_transfer.tiers.memory import DictByteStore

MiB = 1 << 20
CHUNK = 2 * MiB


def _payload(num_bytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(num_bytes)


@pytest.mark.parametrize(
    "num_bytes",
    [1, 1000, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, 64 * MiB],
    ids=lambda n: f"{n}B",
)
def test_round_trip_is_bit_exact(make_server, make_client, num_bytes: int) -> None:
    store = DictByteStore()
    server = make_server(store)
    client = make_client(server.address)
    data = _payload(num_bytes, seed=num_bytes)
    assert client.put_bytes("mla:obj", data)
    assert store.get_bytes("mla:obj") == data  # push landed exactly
    store.put_bytes("mla:other", data[::-1])
    got = client.get_many(["mla:obj", "mla:other"])
    assert got["mla:obj"] == data
    assert got["mla:other"] == data[::-1]
    stats = client.stats()
    assert (stats["hits"], stats["misses"], stats["bytes_fetched"]) == (2, 0, 2 * num_bytes)


def test_many_small_chunks_and_memoryview_input(make_server, make_client) -> None:
    server = make_server(chunk_bytes=4096)
    client = make_client(server.address, chunk_bytes=4096)
    array = np.arange(10_000, dtype=np.int32)  # 40,000 bytes = 9 full chunks + 3,136
    assert client.put_bytes("kda:a", memoryview(array))
    assert client.get_bytes("kda:a") == array.tobytes()


def test_byte_store_protocol_and_misses(make_server, make_client) -> None:
    server = make_server()
    client = make_client(server.address)
    assert isinstance(client, ByteStore)
    assert client.name == f"remote:{server.address}"
    assert client.put_many({"a": b"1", "b": b"", "c": b"333"}) == {"a": True, "b": True, "c": True}
    assert client.contains(["a", "zz", "b", "c"]) == [True, False, True, True]
    assert client.get_many(["b", "zz", "c"]) == {"b": b"", "zz": None, "c": b"333"}
    assert client.get_bytes("zz") is None
    assert client.delete("a") is True
    assert client.delete("a") is False
    assert client.contains(["a"]) == [False]
    remote = client.server_stats()
    assert remote is not None
    assert (remote.num_push_stored, remote.num_deleted, remote.num_fetch_misses) == (3, 1, 2)


def test_refused_put_reads_false(make_server, make_client) -> None:
    server = make_server(DictByteStore(capacity_bytes=10))
    client = make_client(server.address)
    assert client.put_many({"a": b"123456", "b": b"123456"}) == {"a": True, "b": False}
    assert client.stats()["puts_failed"] == 1
    assert server.stats().num_push_refused == 1


def test_key_batches_split_by_max_keys_per_call(make_server, make_client) -> None:
    store = DictByteStore()
    for i in range(25):
        store.put_bytes(f"k{i}", bytes([i]))
    server = make_server(store)
    client = make_client(server.address, max_keys_per_call=4)
    keys = [f"k{i}" for i in range(30)]
    assert client.contains(keys) == [True] * 25 + [False] * 5
    got = client.get_many(keys)
    assert [got[k] for k in keys] == [bytes([i]) for i in range(25)] + [None] * 5


def test_bad_key_is_a_caller_error(make_server, make_client) -> None:
    client = make_client(make_server().address)
    with pytest.raises(ValueError):
        client.put_bytes("", b"x")
    with pytest.raises(ValueError):
        client.get_bytes("k" * 5000)


def test_demote_orders_the_peer_tiers_evictions(make_server, make_client) -> None:
    """Demote puts a peer host tier's objects first in line for eviction, the first key first,
    across batches too; absent keys and stores without an eviction order count nothing."""
    from kv_transfer.tiers.host import HostTier

    kib = 1024
    evicted: list[str] = []
    with HostTier(16 * 64 * kib, slab_bytes=16 * 64 * kib, on_evict=lambda k, d: evicted.append(k)) as host:
        server = make_server(host)
        client = make_client(server.address, max_keys_per_call=2)
        for i in range(16):  # full: sixteen 64 KiB objects
            assert host.put_bytes(f"k{i}", bytes([i]) * (64 * kib))
        assert client.demote(["k6", "k5", "gone", "k7"]) == 3  # two batches
        assert client.stats()["demoted"] == 3
        assert server.stats().num_demoted == 3
        for i in range(16, 20):
            assert host.put_bytes(f"k{i}", bytes([i]) * (64 * kib))
        assert evicted == ["k6", "k5", "k7", "k0"]  # the demoted in the order given, then the oldest
        assert client.get_bytes("k1") == bytes([1]) * (64 * kib)  # the rest stay readable
    plain = make_client(make_server(DictByteStore()).address)
    plain.put_bytes("a", b"1")
    assert plain.demote(["a"]) == 0 and plain.get_bytes("a") == b"1"
