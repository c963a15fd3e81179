from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kv_transfer.events import EventLog
from kv_transfer.tiers.base import ByteStore
from kv_transfer.tiers.host import HostTier

KiB, MiB = 1 << 10, 1 << 20


def payload(key: str, size: int) -> bytes:
    unit = (key + "|").encode()
    return (unit * (size // len(unit) + 1))[:size]


def check_accounting(tier: HostTier, sizes: dict[str, int]) -> None:
    st_ = tier.stats()
    present = [k for k in sizes if tier.contains([k])[0]]
    assert st_["allocated_bytes"] <= st_["capacity_bytes"]
    assert st_["num_objects"] == len(tier.keys())
    assert st_["used_bytes"] == sum(sizes[k] for k in tier.keys())
    assert set(present) <= set(tier.keys())


def test_put_get_duplicate_delete_and_protocol() -> None:
    with HostTier(1 * MiB, slab_bytes=64 * KiB) as tier:
        assert isinstance(tier, ByteStore)
        assert tier.put_bytes("a", payload("a", 10_000))
        assert tier.put_bytes("a", b"other bytes are ignored")  # immutable: no-op, True
        assert tier.get_bytes("a") == payload("a", 10_000)
        assert tier.contains(["a", "b"]) == [True, False]
        assert tier.get_bytes("b") is None
        assert tier.delete("a") and not tier.delete("a")
        st_ = tier.stats()
        assert (st_["num_objects"], st_["used_bytes"], st_["allocated_bytes"]) == (0, 0, 0)
        assert (st_["num_puts"], st_["num_duplicate_puts"], st_["num_hits"], st_["num_misses"]) == (1, 1, 1, 1)


def test_zero_copy_view_points_into_the_arena() -> None:
    with HostTier(1 * MiB, slab_bytes=64 * KiB) as tier:
        data = torch.arange(1000, dtype=torch.float32)
        tier.put_bytes("t", data.numpy().tobytes())
        with tier.get_view("t") as lease:
            assert lease.view.readonly
            t = torch.frombuffer(lease.view, dtype=torch.float32)
            base = torch.frombuffer(tier.arena.view, dtype=torch.uint8).data_ptr()
            assert base <= t.data_ptr() < base + tier.capacity_bytes
            assert torch.equal(t, data)
            del t


def test_backpressure_when_everything_is_pinned_and_oversize() -> None:
    with HostTier(256 * KiB, slab_bytes=64 * KiB) as tier:
        leases = []
        for i in range(4):
            assert tier.put_bytes(f"k{i}", payload(f"k{i}", 64 * KiB))
            leases.append(tier.get_view(f"k{i}"))
        assert tier.put_bytes("new", b"x" * 100) is False  # all pinned: no room, no exception
        assert tier.put_bytes("huge", b"x" * (65 * KiB)) is False  # larger than a slab
        assert tier.stats()["num_put_rejected"] == 2
        assert tier.stats()["num_pinned"] == 4
        assert not tier.delete("k0")  # in use
        for lease in leases:
            lease.release()
        assert tier.put_bytes("new", b"x" * 100)
        assert tier.stats()["num_evictions"] == 1


def test_on_evict_gets_the_exact_bytes_and_events_are_emitted() -> None:
    log = EventLog()
    got: dict[str, bytes] = {}
    with HostTier(64 * KiB, slab_bytes=64 * KiB, on_evict=lambda k, b: got.__setitem__(k, b),
                  event_log=log, worker_id="w0") as tier:
        for i in range(17):  # 16 slots of 4 KiB
            tier.put_bytes(f"k{i}", payload(f"k{i}", 4000))
        assert got == {"k0": payload("k0", 4000)}
        events = log.take()
        assert [e.kind for e in events].count("stored") == 17
        assert [(e.kind, e.key) for e in events if e.kind == "evicted"] == [("evicted", "k0")]
        assert events[0].worker_id == "w0" and len(log) == 0


def test_mixed_size_churn_keeps_the_arena_full() -> None:
    """Full arena, mixed sizes, policy + slab-aware eviction: utilisation stays high."""
    rng = random.Random(3)
    sizes = [12 * KiB, 40 * KiB, 300 * KiB, 1 * MiB, 2 * MiB]
    with HostTier(64 * MiB, slab_bytes=4 * MiB, eviction="s3fifo") as tier:
        utilisation = []
        for i in range(3000):
            nbytes = rng.choice(sizes)
            assert tier.put_bytes(f"k{i}", bytes(nbytes))  # never refused: nothing is pinned
            if i > 500:
                utilisation.append(tier.used_bytes / tier.capacity_bytes)
            if rng.random() < 0.3:
                tier.get_bytes(f"k{rng.randrange(i + 1)}")
        st_ = tier.stats()
        mean = sum(utilisation) / len(utilisation)
        print(f"mean utilisation {mean:.3f}, min {min(utilisation):.3f}, slab reclaims {st_['num_slab_reclaims']}")
        assert mean > 0.75
        assert st_["allocated_bytes"] <= st_["capacity_bytes"]


def test_concurrent_writers_and_readers_threads() -> None:
    sizes = {f"k{i}": 1000 + 997 * (i % 50) for i in range(400)}
    errors: list[str] = []
    with HostTier(2 * MiB, slab_bytes=128 * KiB, eviction="lru") as tier:
        def writer(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(600):
                k = rng.choice(list(sizes))
                tier.put_bytes(k, payload(k, sizes[k]))
                if tier.stats()["allocated_bytes"] > tier.capacity_bytes:
                    errors.append("capacity exceeded")

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(1500):
                k = rng.choice(list(sizes))
                lease = tier.get_view(k)
                if lease is not None:
                    with lease:
                        if bytes(lease.view) != payload(k, sizes[k]):
                            errors.append(f"bad bytes for {k}")

        threads = [threading.Thread(target=writer, args=(s,)) for s in range(4)]
        threads += [threading.Thread(target=reader, args=(100 + s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:3]
        check_accounting(tier, sizes)
        assert tier.stats()["num_leases"] == 0 and tier.stats()["pending_bytes"] == 0


class HostTierMachine(RuleBasedStateMachine):
    """Allocator + eviction model: capacity, pins, exact accounting, contents."""

    leases = Bundle("leases")
    eviction = "s3fifo"

    def __init__(self) -> None:
        super().__init__()
        self.tier = HostTier(256 * KiB, slab_bytes=32 * KiB, eviction=self.eviction)
        self.sizes = {f"k{i}": 1 + (i * 7919) % (32 * KiB) for i in range(24)}
        self.pinned: dict[int, str] = {}

    def teardown(self) -> None:
        self.tier.close()

    @rule(i=st.integers(0, 23))
    def put(self, i: int) -> None:
        k = f"k{i}"
        before = set(self.tier.keys())
        ok = self.tier.put_bytes(k, payload(k, self.sizes[k]))
        if k in before:
            assert ok
        if ok:
            assert self.tier.contains([k]) == [True]
        gone = before - set(self.tier.keys())
        assert not gone & set(self.pinned.values()), "a pinned object was evicted"

    @rule(target=leases, i=st.integers(0, 23))
    def pin(self, i: int):
        lease = self.tier.get_view(f"k{i}")
        if lease is not None:
            self.pinned[id(lease)] = lease.key
        return lease

    @rule(lease=consumes(leases))
    def release(self, lease) -> None:
        if lease is not None:
            assert bytes(lease.view) == payload(lease.key, self.sizes[lease.key])
            del self.pinned[id(lease)]
            lease.release()

    @rule(i=st.integers(0, 23))
    def delete(self, i: int) -> None:
        k = f"k{i}"
        present = self.tier.contains([k])[0]
        ok = self.tier.delete(k)
        assert ok == (present and k not in self.pinned.values())

    @invariant()
    def accounting(self) -> None:
        check_accounting(self.tier, self.sizes)
        st_ = self.tier.stats()
        assert st_["num_leases"] == len(self.pinned)
        assert set(self.pinned.values()) <= set(self.tier.keys())


TestHostTierMachine = HostTierMachine.TestCase
TestHostTierMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


class ARCHostTierMachine(HostTierMachine):
    eviction = "arc"


TestARCHostTierMachine = ARCHostTierMachine.TestCase
TestARCHostTierMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


def test_an_arena_that_cannot_be_mapped_leaves_no_file(tmp_path, monkeypatch) -> None:
    """The arena's file lives in shared memory (/dev/shm): a failed mapping (no memory) must
    not leave it behind. The failure is injected through the arena module's ``mmap``."""
    import errno
    import mmap
    import os
    import types

    import kv_transfer.tiers.arena as arena_mod

    def failing(*_a, **_k):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    proxy = types.SimpleNamespace(**{k: getattr(mmap, k) for k in dir(mmap) if not k.startswith("__")})
    proxy.mmap = failing
    monkeypatch.setattr(arena_mod, "mmap", proxy)
    with pytest.raises(OSError):
        HostTier(1 << 20, arena_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("hand_on_demoted", [True, False])
def test_demoted_objects_are_handed_on_only_when_asked(hand_on_demoted):
    """NOTE 6: with ``hand_on_demoted`` False an object evicted while demoted is not handed to
    ``on_evict`` (a spill passes it by); one read since its demotion is, as is every other."""
    handed: list[str] = []
    tier = HostTier(16 * 64 * KiB, slab_bytes=16 * 64 * KiB, on_evict=lambda k, d: handed.append(k),
                    hand_on_demoted=hand_on_demoted)
    for i in range(16):  # full: sixteen 64 KiB objects in one slab
        assert tier.put_bytes(f"k{i}", payload(f"k{i}", 64 * KiB))
    assert tier.demote(["k5", "k6", "k7"]) == 3
    assert tier.get_bytes("k6") == payload("k6", 64 * KiB)  # read since: refreshed, no longer demoted
    for i in range(16, 21):
        assert tier.put_bytes(f"k{i}", payload(f"k{i}", 64 * KiB))
    if hand_on_demoted:
        assert handed == ["k5", "k7", "k0", "k1", "k2"]
    else:
        assert handed == ["k0", "k1", "k2"], "k5 and k7 went without a hand-on"
    assert tier.stats()["num_evictions"] == 5
    tier.close()


@pytest.mark.parametrize("eviction", ["lru", "s3fifo", "arc"])
def test_a_demoted_object_put_again_is_refreshed(eviction):
    """NOTE 3 / 5: a put of a demoted key (another node spilling the copy it evicted) refreshes it
    as a read does: it no longer goes first; a put of a key not demoted changes nothing."""
    evicted: list[str] = []
    tier = HostTier(16 * 64 * KiB, slab_bytes=16 * 64 * KiB, eviction=eviction,
                    on_evict=lambda k, d: evicted.append(k))
    for i in range(16):
        assert tier.put_bytes(f"k{i}", payload(f"k{i}", 64 * KiB))
    assert tier.demote(["k5", "k6"]) == 2
    assert tier.put_bytes("k6", payload("k6", 64 * KiB))  # a duplicate: the bytes stay, the order changes
    assert tier.put_bytes("k0", payload("k0", 64 * KiB))
    assert tier.stats()["num_duplicate_puts"] == 2
    for i in (16, 17):
        assert tier.put_bytes(f"k{i}", payload(f"k{i}", 64 * KiB))
    assert evicted[0] == "k5" and len(evicted) == 2 and "k6" not in evicted  # k6 went back among the others
    assert tier.get_bytes("k6") == payload("k6", 64 * KiB)
    tier.close()


@pytest.mark.parametrize("eviction", ["lru", "s3fifo", "arc"])
def test_held_keys_go_first_and_come_back_when_no_device_holds_them(eviction):
    """NOTE 8: a key a device holds, stored before or after the hold, is evicted before the rest
    and still handed on (the disk keeps it: not NOTE 6's demotion); a second holder keeps it held
    after the first lets go; the last release refreshes it as the newest."""
    evicted: list[str] = []
    tier = HostTier(16 * 64 * KiB, slab_bytes=16 * 64 * KiB, eviction=eviction,
                    on_evict=lambda k, d: evicted.append(k), hand_on_demoted=False)
    for i in range(14):
        assert tier.put_bytes(f"k{i}", payload(f"k{i}", 64 * KiB))
    assert tier.hold(["k3", "k4", "late"]) == 2  # "late" is held before it is stored
    assert tier.hold(["k4"]) == 1  # a second device holds k4
    for key in ("late", "k14"):
        assert tier.put_bytes(key, payload(key, 64 * KiB))  # full now: 16 objects
    assert tier.unhold(["k4"]) == 0 and tier.num_held() == 3  # k4: one holder left
    assert tier.unhold(["k3", "never"]) == 1  # k3 released by its last holder: the newest now
    for i in (15, 16):
        assert tier.put_bytes(f"k{i}", payload(f"k{i}", 64 * KiB))
    assert sorted(evicted) == ["k4", "late"], "the held keys went first, and were handed on"
    assert tier.get_bytes("k3") == payload("k3", 64 * KiB)
    stats = tier.stats()
    assert stats["num_held"] == 2 and stats["num_hold_released"] == 1
    assert stats["num_hold_demoted"] == 3  # k3 and k4 at the hold, "late" when it was stored
    tier.close()


def test_a_recall_waits_for_the_holder_and_its_write_back_is_not_put_first():
    """NOTE 9: a reader recalls what another device holds and this tier lacks; the holder hears
    it, writes back, and comes back for more, which ends the wait; what was written back while
    the recall waited is not at the head of the eviction order (the reader is about to load it).
    Keys nobody else holds are not asked for, and a holder that never comes back costs the
    reader its timeout, no more."""
    tier = HostTier(8 * 64 * KiB, slab_bytes=8 * 64 * KiB)
    for i in range(6):
        assert tier.put_bytes(f"k{i}", payload(f"k{i}", 64 * KiB))
    assert tier.hold(["doc0", "doc1", "ckpt", "mine"]) == 0  # a device holds a document the tier let go
    listener, heard = tier.reconnect(), []

    def holder():
        seq, keys = listener.recalled(0, 5.0)
        heard.append(keys)
        for key in ("doc0", "doc1", "ckpt"):  # its blocks, and its checkpoint the reader did not name
            assert tier.put_bytes(key, payload(key, 64 * KiB))
        listener.recalled(seq, 0.0)  # back for more: the recall is answered

    t = threading.Thread(target=holder)
    t.start()
    assert tier.recall(["k1", "doc0", "doc1", "mine", "nobody"], 5.0, exclude={"mine"}) == 2
    t.join()
    assert heard == [["doc0", "doc1"]], "only what another device holds and the tier lacks"
    assert tier.put_bytes("k6", payload("k6", 64 * KiB))  # full: the oldest goes, not the write-back
    assert tier.contains(["k0", "doc0", "doc1", "ckpt"]) == [False, True, True, True]
    assert tier.recall(["k1", "k2"], 5.0) == 0  # stored: nothing to ask
    stuck = tier.reconnect()
    stuck.recalled(0, 0.0)  # a listener that will not come back
    tier.hold(["gone"])
    t0 = time.monotonic()
    assert tier.recall(["gone"], 0.2) == 0
    assert 0.15 < time.monotonic() - t0 < 2.0
    stuck.close()
    listener.close()
    t0 = time.monotonic()
    assert tier.recall(["gone"], 5.0) == 0 and time.monotonic() - t0 < 1.0, "no listener left to wait for"
    stats = tier.stats()
    assert stats["num_recalls"] == 3 and stats["num_recalled_keys"] == 2 and stats["num_recall_timeouts"] == 1
    tier.close()


def test_a_held_key_evicted_stays_published_until_its_last_holder_lets_go():
    """NOTE 9: the node's index events follow what the node reads: a key a device holds is still
    readable (a recall brings it back) after this tier evicts it, so its eviction is published
    when the last holder lets it go, not before."""
    log = EventLog()
    with HostTier(4 * 64 * KiB, slab_bytes=4 * 64 * KiB, event_log=log) as tier:
        for i in range(4):
            assert tier.put_bytes(f"k{i}", payload(f"k{i}", 64 * KiB))
        tier.hold(["k2"])
        tier.hold(["k2"])  # two devices
        for i in (4, 5):
            assert tier.put_bytes(f"k{i}", payload(f"k{i}", 64 * KiB))  # k2 (held: first), then k0
        assert [e.key for e in log.take() if e.kind == "evicted"] == ["k0"]
        assert not tier.contains(["k2"])[0] and tier.stats()["num_withheld_evictions"] == 1
        tier.unhold(["k2"])
        assert not [e for e in log.take() if e.kind == "evicted"], "a device still holds it"
        tier.unhold(["k2"])
        assert [(e.kind, e.key) for e in log.take()] == [("evicted", "k2")]
