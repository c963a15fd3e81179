from __future__ import annotations

import random

import pytest

from kv_transfer.tiers.eviction import (
    EVICTION_POLICIES,
    ARCPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    make_policy,
)
from kv_transfer.tiers.host import HostTier

OBJ = 4096  # one page: every object in one size class, so eviction follows the policy exactly


def _tier(policy: str, num_objects: int) -> HostTier:
    # slab = capacity = num_objects pages
    return HostTier(num_objects * OBJ, eviction=policy, slab_bytes=num_objects * OBJ)


def _run(tier: HostTier, script: str) -> list[str]:
    """'+a' puts a, 'a' reads a, '-a,b' demotes a then b (a evicted first); returns evicted keys in order."""
    evicted: list[str] = []
    tier.on_evict = lambda k, _: evicted.append(k)
    for op in script.split():
        if op.startswith("+"):
            assert tier.put_bytes(op[1:], bytes(OBJ))
        elif op.startswith("-"):
            tier.demote(op[1:].split(","))
        else:
            assert tier.get_bytes(op) is not None, op
    return evicted


def test_registry_is_one_explicit_table() -> None:
    assert set(EVICTION_POLICIES) == {"lru", "s3fifo", "arc"}
    assert isinstance(make_policy("lru", 1), LRUPolicy)
    assert isinstance(make_policy("arc", 1), ARCPolicy)
    with pytest.raises(ValueError):
        make_policy("mru", 1)


@pytest.mark.parametrize(
    "script,expected",
    [
        ("+a +b +c +d +e", ["a"]),
        ("+a +b +c +d a +e +f", ["b", "c"]),
        ("+a +b +c +d c a +e +f +g", ["b", "d", "c"]),
    ],
)
def test_lru_exact_order(script: str, expected: list[str]) -> None:
    with _tier("lru", 4) as tier:
        assert _run(tier, script) == expected


@pytest.mark.parametrize(
    "script,expected,queues",
    [
        # capacity 10 objects: S target = 1 object; S is evicted from while it holds > 1
        # never-read objects leave S (FIFO) into the ghost list
        ("+a +b +c +d +e +f +g +h +i +j +k +l", ["a", "b"], (["c", "d", "e", "f", "g", "h", "i", "j", "k", "l"], [], ["a", "b"])),
        # a and b were read while in S: they move to M when they reach the head of S
        ("+a +b +c +d +e +f +g +h +i +j a b +k +l", ["c", "d"], (["e", "f", "g", "h", "i", "j", "k", "l"], ["a", "b"], ["c", "d"])),
        # a ghost key comes back straight into M
        ("+a +b +c +d +e +f +g +h +i +j +k +a", ["a", "b"], (["c", "d", "e", "f", "g", "h", "i", "j", "k"], ["a"], ["b"])),
    ],
)
def test_s3fifo_exact_order(script: str, expected: list[str], queues) -> None:
    with _tier("s3fifo", 10) as tier:
        assert _run(tier, script) == expected
        assert tier._policy.queues() == queues


def test_s3fifo_main_reinserts_hit_keys() -> None:
    p = S3FIFOPolicy(capacity_bytes=10 * OBJ)
    for k in "abc":
        p.on_insert(k, OBJ)
        p.on_access(k)
    victims = p.victims()
    first = next(victims)  # S promotes a, b, c to M (all hit), then M: freq 0 -> a
    assert first == "a"
    assert p.queues()[1] == ["a", "b", "c"]
    p.on_access("b")
    p.on_remove("a", evicted=True)
    assert next(victims) == "c"  # b was hit: reinserted behind c


def test_pinned_objects_are_skipped_not_evicted() -> None:
    with _tier("lru", 4) as tier:
        _run(tier, "+a +b +c +d")
        lease = tier.get_view("a")  # a is now most recent; pin b instead
        lease.release()
        with tier.get_view("b"):
            evicted = _run(tier, "+e +f")
            assert evicted == ["c", "d"]
            assert tier.contains(["b"]) == [True]
        assert tier.delete("b")


def _hit_ratio(policy: str) -> float:
    """A hot set of 6 read in a loop, interleaved with a one-pass scan of 100 keys."""
    with _tier(policy, 10) as tier:
        hot = [f"h{i}" for i in range(6)]
        for k in hot:
            tier.put_bytes(k, bytes(OBJ))
        hits = total = 0
        for rnd in range(20):
            for k in hot:
                total += 1
                lease = tier.get_view(k)
                if lease is not None:
                    hits += 1
                    lease.release()
                else:
                    tier.put_bytes(k, bytes(OBJ))
            for s in range(5):  # the scan: never read again
                tier.put_bytes(f"scan{rnd}-{s}", bytes(OBJ))
        return hits / total


def test_s3fifo_and_arc_resist_a_scan_that_flushes_lru() -> None:
    lru, s3, arc = _hit_ratio("lru"), _hit_ratio("s3fifo"), _hit_ratio("arc")
    assert lru < 0.1  # every scan pushes the whole hot set out of LRU
    assert s3 > 0.9
    assert arc > 0.9  # the hot set was read: T2; the scan churns T1 (p stays 0: no ghost hits)


@pytest.mark.parametrize(
    "script,expected,queues,p",
    [
        # capacity 4, p = 0: never-read keys leave T1 oldest first; T1 fills the cache, so
        # B1 has no room (|T1| + |B1| <= c, ARCPolicy NOTE 3)
        ("+a +b +c +d +e", ["a"], (["b", "c", "d", "e"], [], [], []), 0),
        # read keys are in T2; T1 (c, d) is over p and goes first, into B1
        ("+a +b +c +d a b +e +f", ["c", "d"], (["e", "f"], ["a", "b"], ["c", "d"], []), 0),
        # a put of a B1 ghost: T1 gave it up too soon, so it goes to T2 and p grows by one object
        ("+a +b +c +d a b +e +c", ["c", "d"], (["e"], ["a", "b", "c"], ["d"], []), 1),
        # T1 (e) is not over p = 1: T2's least recently used (a) goes, into B2; then T1 is
        ("+a +b +c +d a b +e +c +f +g", ["c", "d", "a", "e"], (["f", "g"], ["b", "c"], ["d", "e"], ["a"]), 1),
        # a put of a B2 ghost shrinks p by the object times |B1| / |B2| (3), floored at 0
        ("+a +b +c +d a b +e +c +f +g +a", ["c", "d", "a", "e", "f"],
         (["g"], ["b", "c", "a"], ["d", "e", "f"], []), 0),
    ],
)
def test_arc_exact_order(script: str, expected: list[str], queues, p: int) -> None:
    with _tier("arc", 4) as tier:
        assert _run(tier, script) == expected
        assert tier._policy.queues() == queues
        assert tier._policy.p == p * OBJ


@pytest.mark.parametrize(
    "script,expected",
    [
        # demoted keys go first, in the order given, before the oldest plain key
        ("+a +b +c +d -c,b +e +f +g", ["c", "b", "a"]),
        # a demoted key read again is refreshed like any other: most recent now
        ("+a +b +c +d -c c +e +f +g +h", ["a", "b", "d", "c"]),
        # absent keys are ignored; a second demote moves the key to the head again
        ("+a +b +c +d -x,d,c -d +e +f", ["d", "c"]),
    ],
)
def test_lru_demote_order(script: str, expected: list[str]) -> None:
    with _tier("lru", 4) as tier:
        assert _run(tier, script) == expected


@pytest.mark.parametrize(
    "script,expected,queues",
    [
        # capacity 10, S target 1 object: +k evicts c from S (a, b were read: now in M); then the
        # demoted h (S) and a (M) leave before d (S) and b (M), and do not enter the ghost list
        # (S3FIFOPolicy NOTE 4)
        ("+a +b +c +d +e +f +g +h +i +j a b +k -h,a +l +m",
         ["c", "h", "a"], (["d", "e", "f", "g", "i", "j", "k", "l", "m"], ["b"], ["c"])),
        # a demoted key read before its eviction is promoted to M instead of evicted
        ("+a +b +c +d +e +f +g +h +i +j -e,f f +k +l",
         ["e", "a"], (["b", "c", "d", "g", "h", "i", "j", "k", "l"], ["f"], ["a"])),
        # a demoted key that comes back after its eviction starts again in S, not in M
        ("+a +b +c +d +e +f +g +h +i +j -e +k +e",
         ["e", "a"], (["b", "c", "d", "f", "g", "h", "i", "j", "k", "e"], [], ["a"])),
    ],
)
def test_s3fifo_demote_order(script: str, expected: list[str], queues) -> None:
    with _tier("s3fifo", 10) as tier:
        assert _run(tier, script) == expected
        assert tier._policy.queues() == queues
        assert tier._policy.demoted() == []


def test_s3fifo_demote_resets_hits_and_keeps_the_byte_counts() -> None:
    p = S3FIFOPolicy(capacity_bytes=10 * OBJ)
    for k in "abc":
        p.on_insert(k, OBJ)
    p.on_access("a")
    p.demote("a")
    p.demote("b")
    assert p.demoted() == ["b", "a"] and len(p) == 3
    assert next(p.victims()) == "b"
    assert (p._small_bytes, p._main_bytes, p._demoted_bytes) == (OBJ, 0, 2 * OBJ)
    p.on_remove("a", evicted=False)
    assert (p._demoted_bytes, p.demoted()) == (OBJ, ["b"])
    p.demote("zz")  # unknown: ignored
    assert len(p) == 2


@pytest.mark.parametrize(
    "script,expected,ghosts",
    [
        # demoted keys go first (in the order given), before T1
        ("+a +b +c +d a -a,c +e +f +g", ["a", "c", "b"], []),
        # and leave no ghost (ARCPolicy NOTE 4): B1 has room for one (T1 holds c, d, e)
        ("+a +b +c +d a b -a +e", ["a"], []),
        # a demoted key read again goes to T2 instead; T1 (e, f, g) leaves room for one ghost
        ("+a +b +c +d -c c +e +f +g", ["a", "b", "d"], ["d"]),
    ],
)
def test_arc_demote_order(script: str, expected: list[str], ghosts: list[str]) -> None:
    with _tier("arc", 4) as tier:
        assert _run(tier, script) == expected
        assert tier._policy.demoted() == []
        t1, t2, b1, b2 = tier._policy.queues()
        assert b1 + b2 == ghosts


def test_arc_keeps_its_byte_counts_and_bounds() -> None:
    """Random puts, reads, demotes and deletes of objects of several sizes: the counters equal
    the queues, p stays in [0, capacity] and the directory within 2x capacity (ARCPolicy NOTES 1-3)."""
    rng = random.Random(7)
    cap = 40 * OBJ
    p = ARCPolicy(cap)
    held: dict[str, int] = {}
    for i in range(4000):
        key = f"k{rng.randrange(120)}"
        op = rng.random()
        if key in held:
            if op < 0.6:
                p.on_access(key)
            elif op < 0.7:
                p.demote(key)
            else:
                p.on_remove(key, evicted=op < 0.9)
                del held[key]
        else:
            size = OBJ * rng.choice((1, 1, 1, 5))
            while sum(held.values()) + size > cap:
                victim = next(p.victims())
                p.on_remove(victim, evicted=True)
                del held[victim]
            p.on_insert(key, size)
            held[key] = size
        t1, t2, b1, b2 = p.queues()
        assert sorted(t1 + t2 + p.demoted()) == sorted(held), i
        assert not (set(b1) | set(b2)) & set(held)
        for q in (p._t1, p._t2, p._b1, p._b2, p._demoted):
            assert p._bytes[id(q)] == sum(q.values())
        assert 0 <= p.p <= cap
        assert p._bytes[id(p._t1)] + p._bytes[id(p._b1)] <= cap
        assert sum(p._bytes.values()) - p._bytes[id(p._demoted)] <= 2 * cap
