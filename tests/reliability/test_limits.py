"""The edge's building blocks on their own: key table, token bucket, per-key limits, admission gate."""

from __future__ import annotations

import asyncio

import pytest

from disagg.api.limits import (
    AdmissionGate,
    KeyLimiter,
    KeyTable,
    TokenBucket,
    num_choices,
    request_salt,
    tenant_salt,
)


@pytest.mark.parametrize(("header", "want"), [
    ("Bearer key-a", "key-a"),
    ("bearer key-b", "key-b"),
    ("Bearer  key-a ", "key-a"),
    ("Bearer key-", None),
    ("Bearer key-aa", None),
    ("Basic key-a", None),
    ("key-a", None),
    ("", None),
    ("Bearer ", None),
])
def test_key_table_identifies_only_exact_keys(header, want):
    assert KeyTable(["key-a", "key-b"]).identify(header) == want


def test_key_table_refuses_empty_keys_and_is_falsy_without_keys():
    with pytest.raises(ValueError):
        KeyTable(["ok", ""])
    assert not KeyTable([])


def test_salts_separate_tenants_even_with_the_same_explicit_salt():
    a, b = tenant_salt("key-a"), tenant_salt("key-b")
    assert a != b and "key-a" not in a
    assert request_salt(a, None) == a
    assert request_salt(a, "team") != request_salt(b, "team")
    assert request_salt(a, "team") != request_salt(a, "other")
    assert request_salt("", "team") == "team" and request_salt("", None) == ""


def test_token_bucket_refills_at_its_rate_up_to_its_burst():
    bucket = TokenBucket(rate=2.0, burst=3.0)
    assert [bucket.take(10.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(10.0) == pytest.approx(0.5)  # one token takes 1/rate seconds
    assert bucket.take(10.5) == 0.0
    assert bucket.take(100.0) == 0.0  # refilled, but never past the burst
    assert [bucket.take(100.0) for _ in range(3)] == [0.0, 0.0, pytest.approx(0.5)]


def test_key_limiter_rate_and_concurrency_per_key():
    lim = KeyLimiter(rate=1.0, burst=2, max_concurrent=1)
    assert lim.admit("a", 0.0) is None
    err = lim.admit("a", 0.0)  # second token is there, but one request is already in flight
    assert err.status == 429 and err.code == "concurrency_limit_exceeded" and err.headers["Retry-After"] == "1"
    assert lim.admit("b", 0.0) is None  # other keys are not affected
    lim.done("a")
    err = lim.admit("a", 0.0)  # bucket empty now
    assert err.status == 429 and err.code == "rate_limit_exceeded" and int(err.headers["Retry-After"]) >= 1
    assert lim.admit("a", 1.0) is None


def test_gate_runs_queues_in_order_and_sheds():
    async def main():
        gate = AdmissionGate(max_inflight=1, max_queued=2, timeout_s=5)
        assert await gate.acquire()
        order = []

        async def waiter(name):
            ok = await gate.acquire()
            order.append((name, ok))

        tasks = [asyncio.create_task(waiter(n)) for n in ("w1", "w2")]
        await asyncio.sleep(0.01)
        assert gate.num_queued == 2
        assert not await gate.acquire()  # queue full: shed at once
        assert gate.num_shed == 1
        gate.release()  # the slot passes to w1, not to a newcomer
        await asyncio.sleep(0.01)
        assert order == [("w1", True)] and gate.num_running == 1
        gate.release()
        await asyncio.gather(*tasks)
        assert order == [("w1", True), ("w2", True)]
        gate.release()
        assert gate.num_running == 0 and gate.num_queued == 0

    asyncio.run(main())


def test_gate_wait_times_out_and_cancelled_waiters_leave_the_queue():
    async def main():
        gate = AdmissionGate(max_inflight=1, max_queued=4, timeout_s=0.05)
        assert await gate.acquire()
        assert not await gate.acquire()  # waited 50 ms, no slot
        assert gate.num_timed_out == 1 and gate.num_queued == 0
        gate.timeout_s = 5
        task = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gate.num_queued == 0
        gate.release()
        assert gate.num_running == 0  # nobody inherited the slot

    asyncio.run(main())


def test_gate_counts_each_choice_and_a_heavy_waiter_is_not_overtaken():
    """A request of n choices takes n slots; a lighter newcomer behind a waiting heavy one waits
    too (FIFO); a weight above max_inflight runs alone."""
    async def main():
        gate = AdmissionGate(max_inflight=4, max_queued=8, timeout_s=5)
        assert gate.try_acquire(3) and gate.num_running == 3
        heavy = asyncio.create_task(gate.acquire(2))
        await asyncio.sleep(0.01)
        assert gate.num_queued == 2
        assert not gate.try_acquire(1), "one slot is free, but the heavy waiter came first"
        light = asyncio.create_task(gate.acquire(1))
        await asyncio.sleep(0.01)
        assert not heavy.done() and not light.done()
        gate.release(3)
        assert await heavy and await light and gate.num_running == 3
        gate.release(2)
        gate.release(1)
        huge = asyncio.create_task(gate.acquire(100))  # counts as 4: the whole gate
        assert await huge and gate.num_running == 4
        gate.release(100)
        assert gate.num_running == 0 and gate.num_queued == 0

    asyncio.run(main())


def test_gate_sheds_by_queued_choices():
    async def main():
        gate = AdmissionGate(max_inflight=4, max_queued=3, timeout_s=5)
        assert gate.try_acquire(4)
        waiting = asyncio.create_task(gate.acquire(1))
        await asyncio.sleep(0.01)
        assert not await gate.acquire(3), "1 + 3 choices would queue beyond max_queued"
        assert gate.num_shed == 1 and gate.num_timed_out == 0
        gate.release(4)
        assert await waiting
        gate.release()

    asyncio.run(main())


@pytest.mark.parametrize(("body", "want"), [
    (b'{"prompt": "x", "n": 3}', 3), (b'{"prompt": "x", "n": 3.0}', 3), (b'{"prompt": "x"}', 1),
    (b'{"prompt": "x", "n": 17}', 1), (b'{"prompt": "x", "n": true}', 1), (b'{"prompt": "x", "n": 0}', 1),
    (b'{"prompt": "x", "n": "3"}', 1), (b'{"prompt": "say \\"n\\": 4"}', 1), (b'{"n": 2', 1), (b'[1, "n"]', 1),
])
def test_the_gate_weight_is_the_n_the_app_will_serve(body, want):
    assert num_choices(body, max_n=16) == want


def test_gate_refuses_bad_bounds():
    with pytest.raises(ValueError):
        AdmissionGate(0, 1, 1.0)
    with pytest.raises(ValueError):
        AdmissionGate(1, -1, 1.0)
