"""Peer resume (``disagg.flow`` NOTE 10): a prefill replica on another node resumes the prefix that
the decode replica's node holds, read through that node's gRPC state service.

Real engines (tiny CPU model), real host tiers, a real gRPC state server and client on loopback;
no Ray cluster. The decode worker on node "d" ran the session's first turn itself, so its node's
host tier holds the turn end; the second turn goes to a prefill worker on node "p", whose own tier
holds nothing of it. Outputs are compared token for token with the reference engine's.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from disagg.config import load_config
from disagg.engine.async_engine import AsyncEngine
from disagg.engine.factory import build_reference_engine
from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.engine.reference.engine import ReferenceEngine
from disagg.flow import FlowOptions
from disagg.messages import GenerateParams
from disagg.router.decider import DeciderConfig
from disagg.workers.tiered import StatefulWorker
from kv_transfer.store import StateStore
from kv_transfer.tiers.host import HostTier
from tests.reuse.peer_util import TOKEN_ENV, served_tier

TOKEN = "peer-resume-7f3c"


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
def cluster(monkeypatch, request):
    """(decode worker on "d", prefill worker on "p" that reads "d" through gRPC, state server, reference),
    the engines on the CPU or on a GPU."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    threads = torch.get_num_threads()
    cfg = load_config({"model": {"name": "tiny", "device": request.param},
                       "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 512, "num_threads": 1}})
    engine = build_reference_engine(cfg)
    with served_tier() as (d_tier, server, remote):
        p_tier = HostTier(64 << 20, pin_memory=False)
        peer = StateStore([p_tier, remote], engine.layout, write_behind=False)  # "d" as node "p" reads it

        def copy():
            return AsyncEngine(ReferenceEngine(engine.model, engine.model_id, engine.options))

        # the decode worker prefills short suffixes itself (the first turn) and sends long ones to the pool
        decode = StatefulWorker(copy(), StateStore([d_tier], engine.layout), "decode-d", "d",
                                options=FlowOptions(DeciderConfig(local_prefill_max_tokens=200, local_harm_weight=0)))
        prefill = StatefulWorker(copy(), StateStore([p_tier], engine.layout), "prefill-p", "p",
                                 peer_stores=lambda node: peer if node == "d" else None)
        try:
            yield decode, prefill, server, ReferenceEngine(engine.model, engine.model_id, engine.options)
        finally:
            decode.engine.shutdown()
            prefill.engine.shutdown()
            p_tier.close()
            torch.set_num_threads(threads)


def _run(worker, params, prefill_fn=None, also=()) -> list[int]:
    async def go():
        out = []
        async for chunk in worker.generate(params, prefill_fn):
            out.extend(chunk.token_ids)
        for w in (worker, *also):  # background publishes and demotes, in this loop
            await w.drain()
        return out, chunk

    return asyncio.run(go())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("named", [True, False])
def test_prefill_on_another_node_resumes_what_the_decode_node_holds(cluster, named):
    """Turn 2's prefill runs on node "p" and resumes turn 1's state from node "d" when the decode
    worker names its node (``state_node``), token-exact, and then demotes the copy it published
    in p's tiers; without the name it recomputes the prompt and keeps its copy."""
    decode, prefill, server, reference = cluster
    rng = random.Random(5)
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    turn1 = [rng.randrange(4, 260) for _ in range(150)]
    out1, _ = _run(decode, GenerateParams("t1", turn1, sampling, session_id="s"))
    assert decode.counters["local_prefills"] == 1  # turn 1 ran on "d": its turn end is in d's tier
    turn2 = turn1 + out1 + [rng.randrange(4, 260) for _ in range(300)]  # 300 > 200: the pool prefills

    sent = []

    async def prefill_fn(params):
        sent.append((params.state_node, params.state_position))
        return await prefill.prefill(params if named else GenerateParams(
            params.request_id, params.prompt_token_ids, params.sampling, session_id=params.session_id,
            checkpoint_at=params.checkpoint_at))

    out2, last = _run(decode, GenerateParams("t2", turn2, sampling, session_id="s"), prefill_fn, (prefill,))
    want, _ = reference.generate(EngineRequest("ref", turn2, sampling))
    assert out2 == want
    ((node, position),) = sent
    assert node == "d" and 128 <= position <= len(turn1) + len(out1)  # the decode node's resumable prefix
    if named:
        assert prefill.flow.counters["peer_resumes"] == 1 and server.stats().num_fetch_hits > 0
        assert last.num_cached_tokens == position  # the prefill resumed it (its reported reuse)
        # its published turn goes first in p's tiers (tiered NOTE 3): the session lives on "d"
        assert prefill.flow.counters["checkpoints_demoted"] > 0
    else:
        assert prefill.flow.counters["peer_resumes"] == 0 and server.stats().num_fetch_hits == 0
        assert last.num_cached_tokens == 0
        assert prefill.flow.counters["checkpoints_demoted"] == 0


@pytest.mark.timeout(300)
def test_a_peer_resume_that_misses_recomputes(cluster):
    """A named node that no longer holds the prefix (evicted since): the prefill resumes what its
    own node holds (nothing here) and the output is still the reference's."""
    decode, prefill, server, reference = cluster
    rng = random.Random(6)
    sampling = SamplingParams(max_tokens=3, ignore_eos=True)
    prompt = [rng.randrange(4, 260) for _ in range(260)]
    params = GenerateParams("x", prompt, sampling, state_node="d", state_position=192)  # nothing stored there
    handle = asyncio.run(prefill.prefill(params))
    want, _ = reference.generate(EngineRequest("ref", prompt, sampling))
    assert handle.first_token == want[0] and handle.num_cached_tokens == 0
    assert prefill.flow.counters["peer_resume_misses"] == 1 and prefill.flow.counters["peer_resumes"] == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hint", [280, 64])
def test_decode_names_the_routers_node_only_when_it_names_more(cluster, hint):
    """The router names a moved session's last node (``state_node``, router step 4). The decode
    worker passes that name on to the prefill when it names more than its own node's lookup found,
    else names its own node; either way it tells the prefill its node (``decode_node``). A named
    node that misses (not reachable here) recomputes, token-exact."""
    decode, prefill, server, reference = cluster
    rng = random.Random(7)
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    turn1 = [rng.randrange(4, 260) for _ in range(150)]
    out1, _ = _run(decode, GenerateParams("t1", turn1, sampling, session_id="s"))
    turn2 = turn1 + out1 + [rng.randrange(4, 260) for _ in range(300)]
    sent = []

    async def prefill_fn(params):
        sent.append((params.state_node, params.state_position, params.decode_node))
        return await prefill.prefill(params)

    params = GenerateParams("t2", turn2, sampling, session_id="s", state_node="far", state_position=hint)
    out2, _ = _run(decode, params, prefill_fn, (prefill,))
    want, _ = reference.generate(EngineRequest("ref", turn2, sampling))
    assert out2 == want
    ((node, position, decode_node),) = sent
    assert decode_node == "d"
    if hint == 280:  # more than "d" holds (turn 1's 154 tokens): the router's name goes on
        assert (node, position) == ("far", 280)
        assert prefill.flow.counters["peer_resume_misses"] == 1
    else:
        assert node == "d" and 64 < position <= len(turn1) + len(out1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("decode_node", ["d", "p", ""])
def test_a_prefill_for_another_nodes_decode_demotes_what_it_published(cluster, decode_node):
    """The prefill's published turn is the hand-off's source; for a decode replica on another node,
    where the hand-off and the turn end land, this node's tiers evict it first (tiered NOTE 3).
    For a decode on its own node (or none named) it stays as it is."""
    decode, prefill, server, reference = cluster
    rng = random.Random(8)
    prompt = [rng.randrange(4, 260) for _ in range(300)]
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)

    async def go():
        handle = await prefill.prefill(GenerateParams("h", prompt, sampling, session_id="s2",
                                                      decode_node=decode_node))
        await prefill.drain()
        return handle

    t0 = time.time()
    handle = asyncio.run(go())
    assert t0 < handle.computed_at <= time.time()  # when its engine finished the prompt (router.loads NOTE 6)
    assert handle.checkpoints  # the hand-off's points are stored on "p"
    assert (prefill.flow.counters["checkpoints_demoted"] > 0) == (decode_node == "d")
