from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from test_kvt_host import check_accounting, payload

from kv_transfer.tiers.base import ByteStore
from kv_transfer.tiers.host import HostTier
from kv_transfer.tiers.host_ipc import HostTierClient, HostTierServer

KiB, MiB = 1 << 10, 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, sys.argv[2])
    from kv_transfer.tiers.host_ipc import HostTierClient

    def payload(key, size):
        unit = (key + "|").encode()
        return (unit * (size // len(unit) + 1))[:size]

    client = HostTierClient(sys.argv[1])
    for i in range(40):
        assert client.put_bytes(f"c{i}", payload(f"c{i}", 3000 + 101 * i))
    with client.get_view("p0") as lease:          # written by the parent
        assert bytes(lease.view) == payload("p0", 5000)
    res = client.reserve("direct", 4096)          # alloc, write in place, commit
    res.view[:] = payload("direct", 4096)
    assert res.commit()
    lease = client.get_view("c39")                # hold a pin, then die without releasing
    print("pinned", flush=True)
    sys.stdin.readline()
    os._exit(0)
    """
)


def test_second_process_reads_and_writes_the_shared_arena() -> None:
    with HostTier(1 * MiB, slab_bytes=64 * KiB) as tier:
        server = HostTierServer(tier)
        try:
            tier.put_bytes("p0", payload("p0", 5000))
            child = subprocess.Popen([sys.executable, "-c", CHILD, server.socket_path, ROOT],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert child.stdout.readline().strip() == "pinned"
            sizes = {"p0": 5000, "direct": 4096, **{f"c{i}": 3000 + 101 * i for i in range(40)}}
            for k, n in sizes.items():
                assert tier.get_bytes(k) == payload(k, n), k
            assert tier.stats()["num_leases"] == 1
            assert not tier.delete("c39")  # pinned by the other process
            check_accounting(tier, sizes)
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.wait(timeout=30) == 0
            deadline = time.time() + 10
            while tier.stats()["num_leases"] and time.time() < deadline:
                time.sleep(0.01)
            assert tier.stats()["num_leases"] == 0  # the dead client's pin was released
            assert tier.delete("c39")
        finally:
            server.close()


def test_client_implements_the_byte_store_protocol_in_process() -> None:
    with HostTier(512 * KiB, slab_bytes=64 * KiB) as tier:
        server = HostTierServer(tier)
        client = HostTierClient(server.socket_path)
        try:
            assert isinstance(client, ByteStore)
            assert client.put_bytes("a", b"hello" * 1000)
            assert client.put_bytes("a", b"ignored")
            assert client.get_bytes("a") == b"hello" * 1000
            assert client.contains(["a", "b"]) == [True, False]
            assert client.get_view("b") is None
            with client.get_view("a") as lease:
                assert not client.delete("a")  # pinned
                assert tier.stats()["num_pinned"] == 1
            assert client.delete("a")
            assert client.stats()["num_objects"] == 0
            # backpressure travels through the protocol as False
            leases = []
            for i in range(8):
                assert client.put_bytes(f"big{i}", bytes(64 * KiB))
                leases.append(client.get_view(f"big{i}"))
            assert client.put_bytes("no-room", bytes(10)) is False
            for lease in leases:
                lease.release()
        finally:
            client.close()
            server.close()


def test_demote_through_the_client_reorders_the_owners_eviction() -> None:
    with HostTier(4 * 4 * KiB, slab_bytes=16 * KiB, eviction="s3fifo") as tier:  # 4 one-page slots
        server = HostTierServer(tier)
        client = HostTierClient(server.socket_path)
        try:
            for k in "abcd":
                assert client.put_bytes(k, bytes(4 * KiB))
            assert client.demote(["c", "zz", "b"]) == 2 and client.demote([]) == 0
            assert tier.stats()["num_demoted"] == 2
            assert client.put_bytes("e", bytes(4 * KiB)) and client.put_bytes("f", bytes(4 * KiB))
            assert client.contains(list("abcdef")) == [True, False, False, True, True, True]
        finally:
            client.close()
            server.close()


def test_touch_through_the_client_refreshes_in_the_owners_order() -> None:
    """``HostTier.touch`` over the socket: the keys touched become the newest, in the order given,
    a demoted one among them stops being demoted, and absent keys are ignored."""
    with HostTier(4 * 4 * KiB, slab_bytes=16 * KiB) as tier:  # 4 one-page slots, LRU
        server = HostTierServer(tier)
        client = HostTierClient(server.socket_path)
        try:
            for k in "abcd":
                assert client.put_bytes(k, bytes(4 * KiB))
            assert client.demote(["c"]) == 1
            assert client.touch(["c", "zz", "a"]) == 2 and client.touch([]) == 0
            assert tier.stats()["num_refreshed"] == 2
            for k in "efg":  # order now b, d, c, a: b, d and c go, a stays
                assert client.put_bytes(k, bytes(4 * KiB))
            assert client.contains(list("abcdefg")) == [True, False, False, False, True, True, True]
        finally:
            client.close()
            server.close()


def test_a_bad_request_is_refused_without_dropping_the_connections_leases() -> None:
    """An unknown op (a newer client) or a truncated field gets an error reply; the connection
    and the leases its other threads read through stay, and a truncated key is never served."""
    from kv_transfer.tiers.host_ipc import _U8, _U32, DELETE

    with HostTier(512 * KiB, slab_bytes=64 * KiB) as tier:
        server = HostTierServer(tier)
        client = HostTierClient(server.socket_path)
        try:
            assert client.put_bytes("x", b"A" * 4096) and client.put_bytes("mla:ab", b"B" * 4096)
            lease = client.get_view("x")
            with pytest.raises(RuntimeError, match="unknown op"):
                client._call(_U8.pack(99))
            with pytest.raises(RuntimeError, match="past the end"):  # claims 12 bytes, carries 6
                client._call(_U8.pack(DELETE) + _U32.pack(12) + b"mla:ab")
            assert tier.stats()["num_leases"] == 1 and bytes(lease.view[:4]) == b"AAAA"
            assert client.contains(["mla:ab", "x"]) == [True, True]  # the same connection serves on
            lease.release()
        finally:
            client.close()
            server.close()


def test_a_failing_write_behind_does_not_leak_the_reservation() -> None:
    """on_evict (the write-behind to a lower tier) raises while a put evicts: the put still gets
    its reservation, and nothing stays pending once the client is gone."""
    def broken(_key, _data):
        raise OSError("lower tier down")

    with HostTier(256 * KiB, slab_bytes=64 * KiB, on_evict=broken) as tier:
        server = HostTierServer(tier)
        client = HostTierClient(server.socket_path)
        try:
            for i in range(12):  # more than fits: the later puts evict
                assert client.put_bytes(f"k{i}", bytes([i]) * (40 * KiB))
            assert tier.stats()["num_evict_errors"] > 0 and tier.stats()["pending_bytes"] == 0
            assert client.get_bytes("k11") == bytes([11]) * (40 * KiB)
        finally:
            client.close()
            server.close()


def test_the_socket_and_the_arena_are_owner_only() -> None:
    old = os.umask(0o000)  # a permissive umask must not open them up
    try:
        with HostTier(512 * KiB, slab_bytes=64 * KiB) as tier:
            server = HostTierServer(tier)
            try:
                assert os.stat(server.socket_path).st_mode & 0o777 == 0o600
                assert os.stat(tier.arena.path).st_mode & 0o777 == 0o600
            finally:
                server.close()
    finally:
        os.umask(old)


def test_holds_belong_to_the_connection_and_go_with_it() -> None:
    """HOLD_MANY / UNHOLD_MANY (``HostTier`` NOTE 8): a connection holds a key once however often
    it asks, only its own holds are released, and a client that goes away drops what it held, so
    its keys stop going first."""
    with HostTier(4 * 4 * KiB, slab_bytes=16 * KiB) as tier:  # 4 one-page slots, LRU
        server = HostTierServer(tier)
        a, b = HostTierClient(server.socket_path), HostTierClient(server.socket_path)
        try:
            for k in "abcd":
                assert a.put_bytes(k, bytes(4 * KiB))
            assert a.hold(["b", "b", "zz"]) == 1 and a.hold(["b"]) == 0 and tier.num_held() == 2  # held once
            assert b.unhold(["b"]) == 0 and tier.num_held() == 2, "b never held it"
            assert b.hold(["c"]) == 1
            b.close()
            deadline = time.monotonic() + 5
            while tier.num_held() != 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert tier.num_held() == 2, "the closed connection's hold of c was dropped"
            assert a.put_bytes("e", bytes(4 * KiB))  # b goes first, though a is older
            assert a.contains(list("abcde")) == [True, False, True, True, True]
            assert a.unhold(["b", "zz"]) == 2 and tier.num_held() == 0
        finally:
            a.close()
            server.close()


def test_recalls_reach_the_holder_on_its_own_connection() -> None:
    """RECALL_MANY / RECALLED (``HostTier`` NOTE 9) between two processes' connections: a reader
    does not recall what its own connection holds; another's hold is recalled, its holder hears
    it on a connection of its own, writes back and comes back, which ends the reader's wait;
    a listening connection that closes is forgotten, so no recall waits for it."""
    with HostTier(16 * 4 * KiB, slab_bytes=64 * KiB) as tier:
        server = HostTierServer(tier)
        holder, reader = HostTierClient(server.socket_path), HostTierClient(server.socket_path)
        listener = holder.reconnect()
        try:
            holder.hold(["x", "y"])
            reader.hold(["own"])
            listener.recalled(0, 0.0)  # listening from now on
            heard = []

            def answer():
                seq, keys = listener.recalled(0, 5.0)
                heard.append(keys)
                for key in keys:
                    assert holder.put_bytes(key, bytes(4 * KiB))
                listener.recalled(seq, 0.0)

            t = threading.Thread(target=answer)
            t.start()
            assert reader.recall(["own", "x", "y", "z"], 5.0) == 2
            t.join()
            assert heard == [["x", "y"]], "the reader's own hold and an unheld key are not recalled"
            listener.close()
            deadline = time.monotonic() + 5
            while tier.stats()["num_recall_listeners"] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert tier.stats()["num_recall_listeners"] == 0
            holder.hold(["w"])
            t0 = time.monotonic()
            assert reader.recall(["w"], 5.0) == 0 and time.monotonic() - t0 < 1.0
        finally:
            holder.close()
            reader.close()
            server.close()
