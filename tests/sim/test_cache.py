"""LRUTier.put_many against one put per key (same order, contents and events)."""

from __future__ import annotations

import random

from disagg.tools.sim.cache import LRUTier, NodeView, VictimHost


def _pair(capacity: int):
    logs: tuple[list, list] = ([], [])
    return (LRUTier("t", capacity, lambda op, k: logs[0].append((op, k))),
            LRUTier("t", capacity, lambda op, k: logs[1].append((op, k))), logs)


def test_put_many_is_put_per_key():
    rng = random.Random(1)
    for capacity in (0, 1, 3, 8, 40):
        bulk, single, (log_b, log_s) = _pair(capacity)
        for _ in range(300):
            start = rng.randrange(60)
            keys = list(range(start, start + rng.randrange(0, 20)))
            if rng.random() < 0.3:
                rng.shuffle(keys)
            size = rng.choice((1, 1, 2, 50))
            bulk.put_many(keys, size)
            for k in keys:
                single.put(k, size)
            assert bulk.keys() == single.keys() and bulk.used == single.used
            assert bulk.num_evictions == single.num_evictions
        assert log_b == log_s


def test_put_many_touches_the_resident_run_then_inserts():
    t, _, (log, _) = _pair(4)
    t.put_many([1, 2, 3])
    t.put_many([2, 1, 9, 3])  # 2, 1 refreshed; 9 evicts nothing (room for one); 3 refreshed
    assert t.keys() == [2, 1, 9, 3] and log == [("stored", 1), ("stored", 2), ("stored", 3), ("stored", 9)]
    t.put_many([5, 6])  # evicts the two oldest
    assert t.keys() == [9, 3, 5, 6] and log[-4:] == [("evicted", 2), ("stored", 5), ("evicted", 1), ("stored", 6)]


def test_a_demoted_key_evicted_unread_is_reported_as_such():
    """NOTE 4: evicted while demoted -> "evicted_demoted"; refreshed since (put or touch) -> "evicted"."""
    log: list[tuple[str, int]] = []
    t = LRUTier("host", 4, lambda op, k: log.append((op, k)))
    t.put_many([1, 2, 3, 4])
    t.demote([2, 3, 4])
    t.put(3)  # refreshed: no longer demoted
    t.touch_present([4])
    for k in (5, 6, 7, 8):
        t.put(k)
    assert [e for e in log if e[0] != "stored"] == [("evicted_demoted", 2), ("evicted", 1), ("evicted", 3),
                                                     ("evicted", 4)]
    t.demote([5])
    t.discard(5)
    assert log[-1] == ("evicted_demoted", 5)


def test_policy_tier_runs_serving_s3fifo_with_serving_semantics():
    """A host tier ordered by serving's S3-FIFO class: new keys enter its small FIFO and leave
    first unless read; a put of a resident key is a read (serving writes nothing of what a tier
    holds and refreshes it, ``StateStore`` NOTE 4); a demoted key goes before all, reported as
    such."""
    from disagg.tools.sim.cache import PolicyTier

    events = []
    t = PolicyTier("host", 10, "s3fifo", lambda op, k: events.append((op, k)))
    for k in range(10):
        t.put(k)
    t.read([3])  # read while in S: promoted to M when it reaches the head
    t.put(4)  # resident: refreshed as a read
    assert t.put(10) == [0] and t.put(11) == [1] and t.put(12) == [2]
    assert t.put(13) == [5] and 3 in t and 4 in t  # 3 read, 4 re-put: both kept
    t.demote([8])
    assert t.put(14) == [8] and events[-2] == ("evicted_demoted", 8)
    t.demote([9, 7])
    t.put(7)  # a put of a demoted key is a read (serving's HostTier NOTE 3)
    assert t.put(15) == [9] and 7 in t
    assert t.used == 10 and len(t) == 10 and t.put(99, size=11) is None


def test_a_cluster_resumes_from_a_policy_host_tier_as_from_an_lru_one():
    """Host tiers of serving's S3-FIFO or ARC (``ClusterConfig.host_policy``): with a device too small to
    keep a session, each follow-up resumes from the host tier at its predecessor's last full block."""
    from disagg.tools.sim.simulator import ClusterConfig, Simulator
    from disagg.tools.sim.workload import SimRequest

    reqs = [SimRequest("s", t, 0.0, 0.0, 4 * 64 + 10 + 128 * t, 2, list(range(5 + 2 * t)), 64) for t in range(3)]
    for policy in ("lru", "s3fifo", "arc"):
        res = Simulator(reqs, "round_robin", ClusterConfig(num_workers=1, device_blocks=8, host_blocks=64,
                                                           host_policy=policy)).run()
        assert [r.cached_tokens for r in res.records] == [0, 4 * 64, 6 * 64]
        assert [r.cached_tier for r in res.records][1:] == ["host", "host"]


def _victim_node(host_capacity: int, device_capacity: int, devices: int = 1):
    """A node whose host tier is its devices' victim cache (cache NOTE 5), every event logged."""
    log: list[tuple[str, str, object]] = []
    host = LRUTier("host", host_capacity)
    victim = VictimHost(host, lambda k: 3 if k == "ckpt" else 1)
    host.on_event = victim.host_listener(lambda op, k: log.append(("host", op, k)))
    devs = [LRUTier(f"d{i}", device_capacity) for i in range(devices)]
    for i, dev in enumerate(devs):
        dev.on_event = victim.device_listener(lambda op, k, i=i: log.append((f"d{i}", op, k)))
    return host, devs, victim, log


def test_victim_host_lets_go_first_of_what_a_device_holds():
    """A full host tier evicts what a device of the node holds before what none holds, the
    oldest first; the listener below it still sees every event."""
    host, (dev,), victim, log = _victim_node(4, 8)
    dev.put_many([1, 2])
    host.put_many([1, 2, 10, 11])  # a turn written through: 1, 2 are on the device too
    assert host.keys() == [2, 1, 10, 11] and victim.held == {1: 1, 2: 1}
    host.put(12)
    host.put(13)
    assert host.keys() == [10, 11, 12, 13]  # the device's keys went first, not 10 and 11
    assert ("host", "evicted_demoted", 2) in log and ("host", "evicted_demoted", 1) in log
    host.put(1)
    assert host.keys()[0] == 1  # stored again while the device holds it: at the eviction end


def test_victim_host_gets_back_what_the_last_device_evicts():
    """A device's eviction returns the key to the host tier as its newest: refreshed when the
    host still held it, written back when it had let it go; a key another device of the node
    still holds stays where it is, and one the device had demoted is not written back."""
    host, (d0, d1), victim, _ = _victim_node(8, 2, devices=2)
    d0.put_many([1, 2])
    d1.put(1)
    host.put_many([1, 2, 5])
    host.discard(2)  # the host let 2 go (as a full tier would)
    d0.put_many([3, 4])  # d0 evicts 1 (d1 still holds it) and 2 (no device does)
    assert victim.held == {1: 1, 3: 1, 4: 1}
    assert host.keys() == [1, 5, 2] and victim.written_back == 1
    d1.put(6)  # d1 still has room: nothing moves
    d1.put(7)  # d1 evicts 1, the last device copy: refreshed, the host's newest, no longer demoted
    assert host.keys() == [5, 2, 1] and 1 not in host._cold
    d0.demote([3])
    d0.put(8)  # 3 was demoted on the device (nothing expects to read it): not written back
    assert 3 not in host and victim.written_back == 1
    d0.put("ckpt")
    d0.put_many([10, 11])  # pushes out what d0 held, the checkpoint last: back to the host at its size
    assert host.keys()[-1] == "ckpt" and host.used == len(host) - 1 + 3


def test_node_view_reads_the_host_and_the_node_devices():
    host, (d0, d1), _, _ = _victim_node(8, 4, devices=2)
    host.put(1)
    d0.put(2)
    d1.put(3)
    view = NodeView(host, [d0, d1])
    assert view.present([1, 2, 3, 4]) == [True, True, True, False]
    assert 3 in view and 4 not in view
    assert NodeView(None, [d1]).present([1, 3]) == [False, True]


def test_victim_host_publishes_what_the_node_can_read():
    """With ``publish`` the node's host tier is published as ``NodeView`` reads it: a key a device
    stores first is published, one the host tier lets go while a device holds it stays
    published, and one that leaves the node is withdrawn (cache NOTE 5)."""
    host = LRUTier("host", 2)
    seen: list[tuple[str, object]] = []
    victim = VictimHost(host, lambda k: 1, publish=lambda op, k: seen.append((op, k)))
    host.on_event = victim.host_listener(lambda op, k: seen.append((op, k)))
    dev = LRUTier("d0", 2, victim.device_listener(lambda op, k: None))
    dev.put(1)
    assert seen == [("stored", 1)] and 1 not in host  # published for the device's copy
    host.put_many([1, 2, 3])  # 1 is demoted (the device holds it) and let go first
    assert host.keys() == [2, 3] and ("evicted_demoted", 1) not in seen
    dev.demote([1])
    dev.put_many([4, 5])  # 1 leaves the node (demoted on the device: not written back)
    assert seen[-3:] == [("stored", 4), ("evicted_demoted", 1), ("stored", 5)] and 1 not in host
