"""A session's end, when its client says so (``disagg.flow`` NOTE 13): the last turn publishes no
turn end, and the node's tiers are told to evict the session's private state before anything
else (that a demoted object goes first is the host tier's own tests'), while a system prompt
another session shares stays where recency put it.

Real engine (tiny CPU model), a real host tier and state store, the worker's own request flow;
no Ray cluster, no prefill pool (every prefill runs in the decode worker). Outputs are compared
token for token with the reference engine's.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from disagg.config import load_config
from disagg.engine.async_engine import AsyncEngine
from disagg.engine.factory import build_reference_engine
from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.engine.reference.engine import ReferenceEngine
from disagg.messages import GenerateParams
from disagg.workers.tiered import StatefulWorker
from kv_transfer.store import StateStore
from kv_transfer.tiers.host import HostTier


@pytest.fixture
def node():
    """(worker, its host tier, its store, reference engine)."""
    threads = torch.get_num_threads()
    cfg = load_config({"model": {"name": "tiny"},
                       "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 512, "num_threads": 1}})
    engine = build_reference_engine(cfg)
    tier = HostTier(512 << 20, pin_memory=False, eviction="lru")
    store = StateStore([tier], engine.layout, write_behind=False)
    worker = StatefulWorker(AsyncEngine(ReferenceEngine(engine.model, engine.model_id, engine.options)), store,
                            "decode-n", "n")
    try:
        yield worker, tier, store, ReferenceEngine(engine.model, engine.model_id, engine.options)
    finally:
        worker.engine.shutdown()
        tier.close()
        torch.set_num_threads(threads)


def _turn(worker, params) -> list[int]:
    async def go():
        out = []
        async for chunk in worker.generate(params):
            out.extend(chunk.token_ids)
        await worker.drain()  # background publishes and demotes, in this loop
        return out

    return asyncio.run(go())


def _demoted(tier, monkeypatch) -> list[list[str]]:
    """The key lists the tier is asked to demote (the real method runs)."""
    calls: list[list[str]] = []
    real = tier.demote

    def spy(keys):
        calls.append(list(keys))
        return real(keys)

    monkeypatch.setattr(tier, "demote", spy)
    return calls


@pytest.mark.timeout(300)
def test_an_ended_session_goes_first_and_its_last_turn_is_not_published(node, monkeypatch):
    """Session "a" takes two turns, the second with ``session_end``; session "b", between them,
    sends the same 128-token system prompt. After "a"'s last turn: no block past its first turn
    was stored, every private block of its first turn was demoted and none of the system
    prompt's (nor any of "b"'s), the end of the context first."""
    worker, tier, store, reference = node
    calls = _demoted(tier, monkeypatch)
    rng = random.Random(31)
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    bs = worker.engine.block_size
    system = [rng.randrange(4, 260) for _ in range(2 * bs)]
    a1 = system + [rng.randrange(4, 260) for _ in range(3 * bs + 5)]
    b1 = system + [rng.randrange(4, 260) for _ in range(3 * bs)]
    out_a1 = _turn(worker, GenerateParams("a1", a1, sampling, session_id="a"))
    assert out_a1 == reference.generate(EngineRequest("ref", a1, sampling))[0]
    out_b1 = _turn(worker, GenerateParams("b1", b1, sampling, session_id="b"))
    assert out_b1 == reference.generate(EngineRequest("ref", b1, sampling))[0]
    before = len(calls)
    a2 = a1 + out_a1 + [rng.randrange(4, 260) for _ in range(2 * bs)]
    out_a2 = _turn(worker, GenerateParams("a2", a2, sampling, session_id="a", session_end=True))
    assert out_a2 == reference.generate(EngineRequest("ref", a2, sampling))[0]
    assert worker.counters["sessions_ended"] == 1

    hashes = worker.hasher.block_hashes(a2)
    first_turn = (len(a1) + len(out_a1)) // bs  # blocks the first turn's turn end published
    assert not any(store.contains_keys(store.block_keys(hashes[first_turn:])))  # the last turn: not published
    private = store.block_keys(hashes[len(system) // bs:first_turn])
    shared = store.block_keys(hashes[:len(system) // bs])
    demoted = {k for c in calls[before:] for k in c}
    assert set(private) <= demoted
    assert not demoted & set(shared)
    assert worker.counters["session_end_demoted"] >= len(private)

    assert calls[-1][-len(private):] == private[::-1]  # the end of the context first
    b_keys = store.block_keys(worker.hasher.block_hashes(b1 + out_b1)[: (len(b1) + len(out_b1) - 1) // bs])
    assert not demoted & set(b_keys)
    assert all(store.contains_keys(private + b_keys))  # demoted, not dropped (kv_transfer tests: evicted first)


@pytest.mark.timeout(300)
def test_a_turn_without_session_end_publishes_and_demotes_nothing_of_its_session(node, monkeypatch):
    """The same two turns of "a" without ``session_end``: the second turn's end is published and no
    block of "a" is demoted (the control of the test above)."""
    worker, tier, store, reference = node
    calls = _demoted(tier, monkeypatch)
    rng = random.Random(31)
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    bs = worker.engine.block_size
    a1 = [rng.randrange(4, 260) for _ in range(5 * bs + 5)]
    out_a1 = _turn(worker, GenerateParams("a1", a1, sampling, session_id="a"))
    a2 = a1 + out_a1 + [rng.randrange(4, 260) for _ in range(2 * bs)]
    out_a2 = _turn(worker, GenerateParams("a2", a2, sampling, session_id="a"))
    assert out_a2 == reference.generate(EngineRequest("ref", a2, sampling))[0]
    hashes = worker.hasher.block_hashes(a2)
    assert all(store.contains_keys(store.block_keys(hashes)))
    blocks = set(store.block_keys(hashes))
    assert not blocks & {k for c in calls for k in c}
    assert worker.counters["sessions_ended"] == 0


@pytest.mark.timeout(300)
def test_a_session_ended_after_its_last_turn_goes_first_from_what_the_ledger_saw(node, monkeypatch):
    """``end_session`` after the fact (``disagg.flow`` NOTE 14; the API's DELETE /v1/sessions/{id}):
    session "a" took two turns without ``session_end``; "b" shares its system prompt; another
    tenant's session is also called "a". Ending "a" demotes every private prompt block of "a", the
    end of its context first, and nothing of the system prompt, of "b" or of the other tenant's
    "a"; the blocks stay readable, and a session the worker never saw demotes nothing."""
    from disagg.messages import SessionEnd

    worker, tier, store, reference = node
    calls = _demoted(tier, monkeypatch)
    rng = random.Random(41)
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    bs = worker.engine.block_size
    system = [rng.randrange(4, 260) for _ in range(2 * bs)]
    a1 = system + [rng.randrange(4, 260) for _ in range(3 * bs + 5)]
    out_a1 = _turn(worker, GenerateParams("a1", a1, sampling, session_id="a"))
    b1 = system + [rng.randrange(4, 260) for _ in range(3 * bs)]
    _turn(worker, GenerateParams("b1", b1, sampling, session_id="b"))
    other = [rng.randrange(4, 260) for _ in range(4 * bs)]
    _turn(worker, GenerateParams("t1", other, sampling, session_id="a", cache_salt="tenant-2"))
    a2 = a1 + out_a1 + [rng.randrange(4, 260) for _ in range(2 * bs)]
    out_a2 = _turn(worker, GenerateParams("a2", a2, sampling, session_id="a"))
    assert out_a2 == reference.generate(EngineRequest("ref", a2, sampling))[0]
    before = len(calls)

    assert asyncio.run(worker.end_session(SessionEnd("nobody"))) == 0
    demoted_n = asyncio.run(worker.end_session(SessionEnd("a")))
    hashes = worker.hasher.block_hashes(a2)
    private = store.block_keys(hashes[len(system) // bs:len(a2) // bs])
    shared = store.block_keys(hashes[:len(system) // bs])
    demoted = [k for c in calls[before:] for k in c]
    assert calls[-1][-len(private):] == private[::-1]  # the end of the context first
    assert set(private) <= set(demoted) and not set(demoted) & set(shared)
    b_keys = store.block_keys(worker.hasher.block_hashes(b1)[len(system) // bs:])
    t_keys = store.block_keys(worker.hasher.with_salt("tenant-2").block_hashes(other))
    assert not set(demoted) & set(b_keys + t_keys)
    assert demoted_n >= len(private) and worker.counters["sessions_ended_later"] == 2
    assert all(store.contains_keys(private + shared))  # demoted, not dropped
