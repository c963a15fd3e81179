"""Reuse through the serving path (in process, disaggregated, tiny model): a new session
resumes at a hot shared prefix, follow-ups resume where they diverge, and each miss reason
comes from a scenario that causes it, adding up to bound - realized."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from disagg.config import load_config
from disagg.engine.protocol import SamplingParams
from disagg.launch.inprocess import InProcessBackend
from disagg.messages import GenerateParams

BS = 64


def ids(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(4, 260) for _ in range(n)]


def backend(**over) -> InProcessBackend:
    cfg = {"model": {"name": "tiny"},
           "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 256, "num_threads": 1},
           "transfer": {"host": {"capacity_mb": 256, "pin_memory": False}},
           "router": {"local_prefill_max_tokens": 64}, "deployment": {"mode": "disaggregated"}}
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v}
    return InProcessBackend(load_config(cfg))


@pytest.fixture
def threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


async def send(b: InProcessBackend, rid: str, prompt: list[int], session: str, salt: str = ""):
    return await b.complete(GenerateParams(rid, prompt, SamplingParams(max_tokens=3, ignore_eos=True),
                                           session_id=session, cache_salt=salt))


def adds_up(last) -> None:
    assert sum((last.reuse_misses or {}).values()) == last.reuse_bound - last.num_cached_tokens


def test_new_session_resumes_at_the_hot_shared_prefix(threads):
    """s1's first turn shares nothing yet: the start prior keeps checkpoints at 2^k blocks, so s2's
    first turn resumes at 4 of the system prompt's 5 blocks. s2 stops sharing s1's blocks at the
    system prompt's end: its prefill keeps a checkpoint there, so s3's first turn resumes at all
    of it, token-exact against an unshared run."""
    b = backend()
    system = ids(5 * BS, 99)
    try:
        async def go():
            await send(b, "a", system + ids(420, 1), "s1")  # 11 full blocks: 2^k at 2, 4, 8 blocks
            _, l2 = await send(b, "b", system + ids(280, 2), "s2")
            assert l2.num_cached_tokens == 4 * BS and l2.reuse_misses == {"no_checkpoint": BS}
            t3, l3 = await send(b, "c", system + ids(350, 3), "s3")
            adds_up(l2)
            adds_up(l3)
            return t3, l3
        t3, l3 = asyncio.run(go())
        assert l3.num_cached_tokens == 5 * BS and not l3.reuse_misses
    finally:
        b.shutdown()
    ref = backend()
    try:
        tref, lref = asyncio.run(send(ref, "r", system + ids(350, 3), "x"))
    finally:
        ref.shutdown()
    assert lref.num_cached_tokens == 0 and t3 == tref


@pytest.mark.parametrize("placement", [False, True])
def test_follow_ups_diverging_before_the_last_block(threads, placement):
    """Each next prompt drops the previous one's two-block ephemeral tail. Without placement the
    tokens between the shared prefix and the last checkpoint are ``no_checkpoint`` misses; with it
    the learned distance puts a checkpoint there from the third turn on."""
    b = backend(engine={"learned_checkpoints": placement})
    try:
        async def go():
            ctx, out = ids(512, 1), []
            for turn in range(4):
                prompt = ctx + ids(150, 100 + turn)  # ephemeral tail: the next turn drops it
                _, last = await send(b, f"t{turn}", prompt, "s")
                adds_up(last)
                out.append(last)
                ctx = ctx + ids(128, 200 + turn)
            return out
        lasts = asyncio.run(go())
    finally:
        b.shutdown()
    later = lasts[2:]
    if placement:
        assert all(not x.reuse_misses for x in later), [x.reuse_misses for x in later]
    else:
        assert all(set(x.reuse_misses) == {"no_checkpoint"} for x in later)


@pytest.mark.parametrize("hint", [None, (3 * BS,)])
def test_the_routers_distances_place_the_first_follow_ups_checkpoint(threads, hint):
    """The router names where follow-ups diverge (``GenerateParams.checkpoint_back``, learned from
    every session, disagg.router.divergence); the decode flow's prefill keeps its checkpoint there
    before this worker saw any follow-up. The next turn drops a 3-block tail: at the named distance it
    resumes where it diverges; with the worker's cold prior (1, 2, 4 blocks back) a block short."""
    b = backend()
    ctx = ids(9 * BS, 1)  # not a power of two of blocks: no start-prior point at the divergence
    try:
        async def go():
            p0 = ctx + ids(3 * BS + 22, 100)  # 12 full blocks; the next turn keeps 9
            await b.complete(GenerateParams("t0", p0, SamplingParams(max_tokens=3, ignore_eos=True),
                                            session_id="s", checkpoint_back=hint))
            _, last = await send(b, "t1", ctx + ids(200, 101), "s")
            adds_up(last)
            return last
        last = asyncio.run(go())
    finally:
        b.shutdown()
    if hint:
        assert last.num_cached_tokens == 9 * BS and not last.reuse_misses
    else:  # the cold prior's points: 11, 10, 8 blocks (back) and 8, 4, 2 (start)
        assert last.num_cached_tokens == 8 * BS and last.reuse_misses == {"no_checkpoint": BS}


def test_tenant_salt_and_evicted(threads):
    b = backend(engine={"resident_sessions": False})
    a = ids(400, 5)
    try:
        async def go():
            await send(b, "a", a, "s", salt="t1")
            _, other = await send(b, "b", a + ids(30, 6), "s2", salt="t2")
            assert other.reuse_misses == {"tenant_salt": 384}
            _drop_all(b.store)  # the host tier loses everything (as an eviction would)
            _, gone = await send(b, "c", a + ids(30, 7), "s", salt="t1")
            adds_up(other)
            adds_up(gone)
            return gone
        gone = asyncio.run(go())
    finally:
        b.shutdown()
    assert gone.num_cached_tokens == 0 and gone.reuse_misses.get("evicted", 0) >= 384


def _drop_all(store) -> None:
    tier = store.tiers[0]
    for key in list(tier._index):
        tier.delete(key)



def test_load_deadline(threads):
    """Every state load of session "late" stalls past the load deadline: the prompt's published
    prefix is recomputed, and its tokens are ``load_deadline`` misses."""
    rule = {"fault": "delay", "rate": 1.0, "session_prefix": "late", "delay_s": 5.0}
    b = backend(transfer={"load_deadline_s": 0.2}, faults={"enabled": True, "rules": [rule]})
    a = ids(400, 5)
    try:
        async def go():
            await send(b, "a", a, "s")
            for w in (b.prefill, b.decode):  # the device tier forgets: the next turn needs a load
                await w.engine.call(w.engine.engine._residents.clear)
            _, late = await send(b, "b", a + ids(30, 6), "late")
            adds_up(late)
            return late
        late = asyncio.run(go())
    finally:
        b.shutdown()
    assert late.num_cached_tokens == 0 and late.reuse_misses == {"load_deadline": 400}


def test_in_flight_and_the_counters(threads):
    """B shares A's full blocks and arrives while A's prefill (and publish) is still running, and
    does not wait for it (``publish_wait_s`` 0, flow NOTE 8): its tokens are ``in_flight`` misses.
    The edge's counters of every request add up."""
    from disagg.api.metrics import ServingMetrics
    from disagg.tools.bench.servermetrics import counter_by_label, counter_total, parse_prometheus

    b = backend()
    b.decode.flow.options.publish_wait_s = 0.0
    a = ids(1500, 7)
    try:
        async def go():
            first = asyncio.create_task(send(b, "a", a, "sa"))
            while not b.decode.reuse.ledger._blocks:  # A is noted as seen (its lookup began)
                await asyncio.sleep(0.01)
            _, lb = await send(b, "b", a[:1472] + ids(40, 8), "sb")
            _, la = await first
            return la, lb
        la, lb = asyncio.run(go())
    finally:
        b.shutdown()
    assert lb.num_cached_tokens == 0 and lb.reuse_misses.get("in_flight", 0) == 1472, lb.reuse_misses
    metrics = ServingMetrics()
    for last in (la, lb):
        metrics.request_finished("completions", last, 3)
    samples = parse_prometheus(metrics.render()[0].decode())
    missed = sum(counter_by_label(samples, "disagg_reuse_miss_tokens_total", "reason").values())
    cached = la.num_cached_tokens + lb.num_cached_tokens
    assert missed == counter_total(samples, "disagg_reuse_bound_tokens_total") - cached == 1472


def test_a_lookup_waits_for_the_branch_publish_in_flight(threads):
    """The race of the GPU run's ``raced_publish`` misses: s2's first turn branches off the system
    prompt s1 sent, and s3's first turn looks up while s2's prefill (which keeps the branch
    checkpoint) is still in flight; s2's state load is held 0.5 s so s3 always arrives then. s3
    waits for that publish (flow NOTE 8) and resumes at the whole system prompt, no miss,
    token-exact against an unshared run."""
    rule = {"fault": "delay", "rate": 1.0, "session_prefix": "s2", "delay_s": 0.5}
    b = backend(faults={"enabled": True, "rules": [rule]})
    system = ids(5 * BS, 99)
    try:
        async def go():
            await send(b, "a", system + ids(420, 1), "s1")  # start prior: s1 keeps 2^k blocks, 4 < 5
            second = asyncio.create_task(send(b, "b", system + ids(280, 2), "s2"))
            ledger = b.decode.reuse.ledger
            while ledger.view(system + ids(280, 2), b.decode.hasher, "x").bound < 5 * BS + 280 - 1:
                await asyncio.sleep(0.005)  # s2 is noted as seen: its lookup began
            t3, l3 = await send(b, "c", system + ids(350, 3), "s3")
            _, l2 = await second
            return t3, l3, l2
        t3, l3, l2 = asyncio.run(go())
        waits = b.decode.counters["publish_waits"]
    finally:
        b.shutdown()
    adds_up(l3)
    assert waits >= 1
    assert l3.num_cached_tokens == 5 * BS and not l3.reuse_misses, l3.reuse_misses
    ref = backend()
    try:
        tref, _ = asyncio.run(send(ref, "r", system + ids(350, 3), "x"))
    finally:
        ref.shutdown()
    assert t3 == tref


def test_a_local_prefill_leaves_nothing_in_flight_to_wait_for(threads):
    """A follow-up with a short suffix prefills on the decode replica, whose points land only with
    its turn end: once it has decided, none of them is in flight (a waiter looks up at once,
    flow NOTE 8); its prompt end is published with the turn end."""
    b = backend()
    a = ids(400, 5)
    follow = a + ids(30, 6)
    try:
        async def go():
            await send(b, "a", a, "s")
            p = GenerateParams("b", follow, SamplingParams(max_tokens=8, ignore_eos=True), session_id="s")
            in_flight = None
            async for _chunk in b.stream(p):
                if in_flight is None:
                    in_flight = b.decode.reuse.ledger.pending_among(follow, b.decode.hasher, (384, 430))
            await b.decode.drain()
            return in_flight
        in_flight = asyncio.run(go())
        view = b.decode.reuse.ledger.view(follow + [7], b.decode.hasher, "x")
        local = b.decode.counters["local_prefills"]
    finally:
        b.shutdown()
    assert local == 1 and in_flight == () and 430 in view.published
