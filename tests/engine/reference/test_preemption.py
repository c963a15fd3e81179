"""Scheduling under memory pressure (engine NOTE 6): preemption, prefills that would otherwise
wait on each other forever, a request waiting for blocks held for export, and refusals of
states and ids that would give wrong output or orphan a stream."""

from __future__ import annotations

import asyncio

import pytest
import torch

from disagg.engine.async_engine import AsyncEngine
from disagg.engine.protocol import EngineRequest
from disagg.engine.reference.config import load_preset
from disagg.engine.reference.model import K3ForCausalLM
from kv_transfer.objects import MLABlock, ResumeState
from tests.engine.reference.test_engine import greedy, make_engine, prompt


@pytest.fixture(scope="module")
def model():
    return K3ForCausalLM.random_init(load_preset("tiny"), seed=0, dtype=torch.float32).eval()


def small_engine(model, num_blocks: int, max_num_seqs: int, **kw):
    g = make_engine(model).geometry
    return make_engine(model, cache_budget_bytes=g.slot_bytes * max_num_seqs + g.block_bytes * num_blocks,
                       max_num_seqs=max_num_seqs, resident_sessions=False, **kw)


def reference(model, tokens: list[int], n: int) -> list[int]:
    return make_engine(model, resident_sessions=False).generate(EngineRequest("ref", tokens, greedy(n)))[0]


def drive(eng, got: dict[str, list[int]] | None = None, max_idle: int = 3) -> dict[str, list[int]]:
    """Step until the engine has no work, or until ``max_idle`` steps in a row run nothing."""
    got = {} if got is None else got
    idle = 0
    while eng.has_work() and idle < max_idle:
        steps = eng.counters["steps"]
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        idle = idle + 1 if eng.counters["steps"] == steps else 0
    return got


def assert_all_free(eng) -> None:
    assert eng.cache.blocks.num_free == eng.geometry.num_blocks
    assert eng.cache.num_free_slots == eng.geometry.num_slots


@pytest.mark.parametrize("num_blocks,seqs,shape", [
    (4, 2, [(60, 40), (100, 40)]),  # a decode preempts the newer request
    (5, 2, [(100, 60), (120, 60)]),
    (6, 3, [(60, 60), (70, 60), (80, 60)]),  # three requests, repeated preemption
    (3, 2, [(10, 40), (120, 40)]),  # the newer request cannot grow: it preempts itself
])
def test_preempted_requests_give_the_uninterrupted_tokens(model, num_blocks, seqs, shape):
    """Greedy outputs equal each request run alone, however often it was preempted; a victim is
    never one already planned in the step (that ran it on freed state), and every block and slot
    comes back."""
    reqs = {f"r{i}": (prompt(n, seed=30 + i), m) for i, (n, m) in enumerate(shape)}
    refs = {rid: reference(model, p, m) for rid, (p, m) in reqs.items()}
    eng = small_engine(model, num_blocks, seqs)
    for rid, (p, m) in reqs.items():
        eng.add_request(EngineRequest(rid, p, greedy(m)))
    got = drive(eng)
    assert not eng.has_work() and eng.counters["preemptions"] > 0
    assert got == refs
    assert_all_free(eng)


def test_a_preempted_resumed_request_reports_no_cached_tokens(model):
    """A request admitted with a resume state, preempted and recomputed, reports what it reused
    at its end (nothing), not what it was admitted with."""
    p = prompt(130, seed=60)
    src = make_engine(model)
    src.generate(EngineRequest("s", p, greedy(1), keep_state=True))
    state = src.export_state("s", 128)
    eng = small_engine(model, 4, 2)
    eng.add_request(EngineRequest("old", prompt(60, seed=61), greedy(60)))
    eng.add_request(EngineRequest("new", p, greedy(60), resume=state, cached_source="host"))
    last = {}
    while eng.has_work():
        for o in eng.step():
            last[o.request_id] = o
    assert eng.counters["preemptions"] > 0
    assert (last["new"].num_cached_tokens, last["new"].cached_source) == (0, "computed")


@pytest.mark.parametrize("interval,budget", [(64, 128), (0, 2048)])
def test_prefills_short_of_blocks_preempt_instead_of_waiting_on_each_other(model, interval, budget):
    """Two 400-token prefills each fit alone (7 of 10-12 blocks) but not together; partial
    chunks (a checkpoint interval, or NOTE 5's aligned stop) left each holding part of its blocks
    and both waiting forever. Now the older one preempts the newer and both finish."""
    pa, pb = prompt(400, seed=50), prompt(400, seed=51)
    refs = {"A": reference(model, pa, 4), "B": reference(model, pb, 4)}
    eng = small_engine(model, 10 if interval else 12, 2, checkpoint_interval=interval,
                       max_num_batched_tokens=budget)
    eng.add_request(EngineRequest("A", pa, greedy(4)))
    eng.add_request(EngineRequest("B", pb, greedy(4)))
    assert drive(eng) == refs and not eng.has_work()
    assert eng.counters["preemptions"] > 0
    assert_all_free(eng)


def test_a_request_short_of_blocks_held_for_export_waits_for_their_release(model):
    """Blocks of a finished keep_state request stay until ``release`` (NOTE 1). A request that
    fits the engine but not beside them keeps what it has and waits, without recomputing in a
    loop; ``generate`` reports the stall; after the release it finishes with the right tokens."""
    eng = small_engine(model, 10, 2)
    eng.generate(EngineRequest("held", prompt(300, seed=52), greedy(2), keep_state=True))
    pb = prompt(500, seed=53)
    eng.add_request(EngineRequest("B", pb, greedy(4)))
    got = drive(eng)
    assert eng.has_work() and "B" not in got  # waiting, not finished
    before = eng.stats()
    got = drive(eng, got)
    after = eng.stats()
    assert after["prefill_tokens"] == before["prefill_tokens"] and after["preemptions"] == before["preemptions"]
    eng.release("held", keep_resident=False)
    assert drive(eng, got) == {"B": reference(model, pb, 4)} and not eng.has_work()
    assert_all_free(eng)

    eng.generate(EngineRequest("held", prompt(300, seed=52), greedy(2), keep_state=True))
    with pytest.raises(RuntimeError, match="engine stalled"):
        eng.generate(EngineRequest("C", pb, greedy(4)))


def test_a_state_missing_pieces_is_refused(model):
    """An import writes only the blocks a state carries; one short of a block (or with a tail
    of the wrong span) would resume from whatever the pool pages held: refused instead."""
    p = prompt(300)
    src = make_engine(model)
    src.generate(EngineRequest("a", p, greedy(8), keep_state=True))
    full = src.export_state("a", 192)
    dst = make_engine(model, resident_sessions=False)
    with pytest.raises(ValueError, match="2 MLA blocks, not 3"):
        dst.add_request(EngineRequest("b", p, greedy(8), resume=ResumeState(full.layout, 192, full.mla_blocks[:2],
                                                                            0, None, full.kda)))
    with pytest.raises(ValueError, match="no KDA state"):
        dst.add_request(EngineRequest("b", p, greedy(8), resume=ResumeState(full.layout, 192, full.mla_blocks,
                                                                            0, None, [])))
    unaligned = src.export_state("a", 300)  # the prompt's end: a tail of 44 rows
    tail = unaligned.tail
    short = MLABlock(tail.rows[:, :40], tail.start, 40)  # presented as the tail of 296
    with pytest.raises(ValueError, match="tail"):
        dst.add_request(EngineRequest("b", p + [5], greedy(8), resume=ResumeState(
            full.layout, 300, unaligned.mla_blocks, 0, short, unaligned.kda)))
    dst.add_request(EngineRequest("b", p, greedy(8), resume=full))  # the whole state is taken
    assert drive(dst)["b"] == reference(model, p, 8)


def test_a_duplicate_id_is_refused_without_orphaning_the_live_stream(model):
    front = AsyncEngine(make_engine(model))

    async def main() -> int:
        first = front.generate(EngineRequest("x", prompt(100), greedy(30)))
        n = len((await first.__anext__()).new_token_ids)
        with pytest.raises(ValueError, match="duplicate"):
            async for _ in front.generate(EngineRequest("x", prompt(50, seed=2), greedy(5))):
                pass
        async for o in first:
            n += len(o.new_token_ids)
        return n

    try:
        assert asyncio.run(asyncio.wait_for(main(), timeout=60)) == 30
    finally:
        front.shutdown()
