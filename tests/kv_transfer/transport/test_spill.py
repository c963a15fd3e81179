"""Spill to the pool (``kv_transfer.spill``): a host tier's evictions reach another host tier
through a real gRPC state service, byte for byte, and what cannot be sent is counted, not
blocked on."""

from __future__ import annotations

import threading

from kv_transfer.spill import Spiller
from kv_transfer.tiers.host import HostTier
from kv_transfer.tiers.memory import DictByteStore
from kv_transfer.transport.grpc_transport import RemoteStore, RemoteStoreConfig

from .conftest import TOKEN

KiB = 1 << 10


def _obj(i: int, size: int = 20 * KiB) -> tuple[str, bytes]:
    key = f"mla:{i:032x}"
    return key, (key.encode() * (size // len(key) + 1))[:size]


def test_host_evictions_land_in_the_pool_nodes_host_tier(make_server):
    pool = HostTier(1 << 20)  # the receiving node's host tier, served as in deployments.node_store
    server = make_server(pool)
    remote = RemoteStore(RemoteStoreConfig(server.address, token=TOKEN, timeout_s=10))
    spiller = Spiller(lambda: remote)
    local = HostTier(256 * KiB, on_evict=spiller.offer)  # the decode node's host tier
    objs = dict(_obj(i) for i in range(40))  # 800 KB through 256 KB
    for key, data in objs.items():
        assert local.put_bytes(key, data)
    assert spiller.flush(30)
    evicted = [k for k in objs if not local.contains([k])[0]]
    assert len(evicted) >= 25
    assert all(pool.get_bytes(k) == objs[k] for k in evicted), "every eviction arrived, byte for byte"
    st = spiller.stats()
    assert st["num_spilled"] == len(evicted) and st["num_refused"] == st["num_dropped"] == 0
    assert st["bytes_spilled"] == sum(len(objs[k]) for k in evicted) and st["pending_bytes"] == 0
    spiller.close()
    remote.close()
    local.close()
    pool.close()


def test_a_full_queue_drops_and_no_target_is_counted():
    gate = threading.Event()
    sink = DictByteStore()

    def target():
        gate.wait(10)  # the writer holds its first batch until the queue has filled
        return sink

    spiller = Spiller(target, max_pending_bytes=100 * KiB, batch_bytes=40 * KiB)
    offered = [spiller.offer(*_obj(i)) for i in range(12)]  # 240 KB offered against 100 KB of queue
    assert offered.count(False) >= 5, offered
    assert spiller.offer(*_obj(0)), "a key already queued (or being sent) is not queued twice"
    gate.set()
    assert spiller.flush(10)
    st = spiller.stats()
    assert st["num_dropped"] == offered.count(False) and st["num_spilled"] == offered.count(True)
    assert set(sink.keys()) == {_obj(i)[0] for i, ok in enumerate(offered) if ok}
    nobody = Spiller(lambda: None)
    assert nobody.offer(*_obj(99)) and nobody.flush(10)
    assert nobody.stats()["num_no_target"] == 1 and nobody.stats()["num_spilled"] == 0
    nobody.close()
    spiller.close()
    assert not spiller.offer(*_obj(100)), "closed: refused"


def test_what_the_target_refuses_or_a_dead_service_is_counted_not_retried(make_server):
    small = HostTier(64 * KiB)  # takes three 20 KB objects at most
    server = make_server(small)
    remote = RemoteStore(RemoteStoreConfig(server.address, token=TOKEN, timeout_s=5))
    spiller = Spiller(lambda: remote)
    big = _obj(1, 100 * KiB)
    assert spiller.offer(*big) and spiller.flush(30)
    assert spiller.stats()["num_refused"] == 1 and not small.contains([big[0]])[0]
    server.stop(0)  # the pool node is gone: the spill fails fast and the tier's put is unaffected
    local = HostTier(64 * KiB, on_evict=spiller.offer)
    for i in range(2, 10):
        assert local.put_bytes(*_obj(i))
    assert spiller.flush(60)
    st = spiller.stats()
    assert st["num_spilled"] == 0 and st["num_refused"] == 1 + local.stats()["num_evictions"]
    spiller.close()
    remote.close()
    local.close()
    small.close()
