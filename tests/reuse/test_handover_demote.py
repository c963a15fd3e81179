"""One copy after a cross-node hand-off (``disagg.flow`` NOTE 12): once the decode worker has
loaded a prefill replica's hand-off from another node, that node's tiers evict the prompt's
private MLA blocks first, over its gRPC state service; a shared prefix stays as it was.

Real engines (tiny CPU model), real host tiers, a real gRPC state server and client on loopback;
no Ray cluster. The prefill worker runs on node "p", whose host tier is served; the decode worker
on node "d" reads "p" through the state service. Outputs are compared token for token with the
reference engine's.
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
from disagg.flow import FlowOptions
from disagg.messages import GenerateParams
from disagg.router.decider import DeciderConfig
from disagg.workers.tiered import StatefulWorker
from kv_transfer.store import StateStore
from kv_transfer.tiers.host import HostTier
from tests.reuse.peer_util import TOKEN_ENV, served_tier

TOKEN = "handover-demote-2b81"


@pytest.fixture(params=["p", "d"], ids=["prefill-on-another-node", "prefill-on-the-same-node"])
def cluster(monkeypatch, request):
    """(decode worker on "d", prefill worker on ``request.param`` whose tier is served, its server,
    its host tier, reference)."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    threads = torch.get_num_threads()
    cfg = load_config({"model": {"name": "tiny"},
                       "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 512, "num_threads": 1}})
    engine = build_reference_engine(cfg)
    with served_tier() as (p_tier, server, remote):
        same = request.param == "d"
        d_tier = p_tier if same else HostTier(64 << 20, pin_memory=False)
        peer = StateStore([d_tier, remote], engine.layout, write_behind=False)  # "p" as node "d" reads it

        def copy():
            return AsyncEngine(ReferenceEngine(engine.model, engine.model_id, engine.options))

        # every prompt of these tests is longer than 200 tokens: the decode worker sends it to the pool
        decode = StatefulWorker(copy(), StateStore([d_tier], engine.layout), "decode-d", "d",
                                options=FlowOptions(DeciderConfig(local_prefill_max_tokens=200, local_harm_weight=0)),
                                peer_stores=lambda node: peer if node == "p" else None)
        prefill = StatefulWorker(copy(), StateStore([p_tier], engine.layout), "prefill", request.param)
        try:
            yield decode, prefill, server, p_tier, ReferenceEngine(engine.model, engine.model_id, engine.options)
        finally:
            decode.engine.shutdown()
            prefill.engine.shutdown()
            if not same:
                d_tier.close()
            torch.set_num_threads(threads)


def _turn(decode, prefill, params) -> list[int]:
    async def go():
        out = []
        async for chunk in decode.generate(params, prefill.prefill):
            out.extend(chunk.token_ids)
        for w in (decode, prefill):  # background publishes and demotes, in this loop
            await w.drain()
        return out

    return asyncio.run(go())


@pytest.mark.timeout(300)
def test_the_prefill_node_evicts_a_handed_over_prompt_first_but_not_its_shared_prefix(cluster):
    """Session "a" sends a 128-token system prompt and its own text; session "b" the same system
    prompt and other text. Each turn's prefill runs in the pool: from node "p", the decode worker
    demotes there every block of "a"'s prompt (no other session had sent any) and the blocks of
    "b"'s past the shared system prompt; the blocks stay readable. From its own node it demotes
    nothing. Both outputs are the reference's."""
    decode, prefill, server, p_tier, reference = cluster
    remote = prefill.node_id == "p"
    rng = random.Random(12)
    sampling = SamplingParams(max_tokens=3, ignore_eos=True)
    system = [rng.randrange(4, 260) for _ in range(128)]
    bs = decode.engine.block_size
    store = prefill.store
    demoted = 0
    for session in ("a", "b"):
        prompt = system + [rng.randrange(4, 260) for _ in range(250)]
        out = _turn(decode, prefill, GenerateParams(session, prompt, sampling, session_id=session))
        assert out == reference.generate(EngineRequest("ref", prompt, sampling))[0]
        assert decode.counters["remote_prefills"] == (1 if session == "a" else 2)
        private = len(prompt) // bs - (len(system) // bs if session == "b" else 0)
        demoted += private if remote else 0
        assert decode.counters["handed_over_demoted"] == demoted
        assert server.stats().num_demoted == demoted
        keys = store.block_keys(decode.hasher.block_hashes(prompt))
        assert all(p_tier.contains(keys))  # demoted, not dropped
    assert p_tier.stats()["num_demoted"] >= demoted
    if remote:  # the shared system prompt was demoted once, with "a"'s blocks, and not with "b"'s
        assert demoted == 2 * (len(prompt) // bs) - len(system) // bs


@pytest.mark.timeout(300)
def test_a_failed_demote_leaves_the_turn_whole(cluster, monkeypatch):
    """A state service that fails the demote (its host tier raises) costs nothing but the order:
    the turn's output is the reference's and nothing is counted demoted."""
    decode, prefill, server, p_tier, reference = cluster

    def broken(keys):
        raise RuntimeError("tier down")

    monkeypatch.setattr(p_tier, "demote", broken)
    rng = random.Random(13)
    sampling = SamplingParams(max_tokens=3, ignore_eos=True)
    prompt = [rng.randrange(4, 260) for _ in range(300)]
    out = _turn(decode, prefill, GenerateParams("x", prompt, sampling, session_id="x"))
    assert out == reference.generate(EngineRequest("ref", prompt, sampling))[0]
    assert decode.counters["handed_over_demoted"] == 0
    assert decode.counters["remote_prefills"] == 1
