"""The serving path and the simulator take the same P/D decisions for the same (decode worker's
resume, prefill pool's loads and resumable prefixes, decode batch).

Serving: a reference ``StatefulWorker`` (tiny CPU model, ``disagg.flow``) whose prefill pool comes
from the Serve request-router adapter (``pool_view``: loads, and per replica the prompt tokens it
could not resume, by the adapter's prefix index) over replicas reporting those loads and their
device-resident sessions as block digests. Serve's replica records are stand-ins
(``SimpleNamespace``: the Serve controller is the system boundary); the remote prefill call is a
recorder that fails, so the worker then prefills locally (the decision is what it did first); the
decode worker's resume is real (an earlier turn of the session left it resident on the engine and
published in its node's host tier, an in-process store that prefill replicas on that node read
too), and so is the decode batch: streams held open on the worker's engine while the case decides.
Simulator: the router the simulator builds (``disagg.tools.sim.simulator.build_router``) over
prefill workers with the same queued tokens, nodes and blocks on device, and a decode worker
holding what the serving worker resumes (device, and its node's host tier) and reporting as many
running decodes.
Both decide from ``disagg.config``'s router settings.
"""

from __future__ import annotations

import asyncio
import random
import time
from types import SimpleNamespace

import pytest
import torch

from disagg.config import load_config
from disagg.engine.async_engine import AsyncEngine
from disagg.engine.factory import build_reference_engine
from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.flow import FlowOptions
from disagg.launch.inprocess import make_local_store
from disagg.messages import GenerateParams
from disagg.router.index import IndexUpdate, PrefixIndex
from disagg.router.types import RouteRequest, WorkerState
from disagg.tools.sim.simulator import build_router
from disagg.workers.tiered import StatefulWorker
from kv_transfer.keys import BlockHasher, KeyExtras

BS = 64  # the engine's and the prefill replicas' block size
# thresholds small enough for a CPU prefill: local <= 64; busy pool (min queue >= 1000) keeps <= 192 local
ROUTER = {"local_prefill_max_tokens": 64, "prefill_busy_tokens": 1000, "busy_local_max_tokens": 192,
          "local_harm_weight": 4}  # the weights the cases below are written for
# (uncached suffix, the prefill replicas' queued prefill tokens, decodes running on the decode worker,
#  prompt tokens the decode worker resumes (on device and, published, in its node's host tier),
#  prompt tokens each prefill replica resumes on its device, cache salt, how many of the prefill
#  replicas (the first ones) share the decode worker's node "n0": the others are on "n1");
# a local prefill weighs suffix x (1 + 4 x running decodes) against the short-suffix limit, against
# the busy pool's limit ("local_prefill_busy"), and ("local_state") against the pool's least queued + uncached work when the decode worker resumes more;
# an idle decode worker (no decode running or on its way) takes a suffix the pool would not start on
# before 4x its length of queued + uncached work ("local_idle", router.local_idle_margin)
CASES = [
    (40, [0.0], 0, 0, [0], "", 0),
    (100, [0.0, 500.0], 0, 0, [0, 0], "", 0),
    (100, [1500.0, 2000.0], 0, 0, [0, 0], "", 0),  # busy pool, medium suffix: local
    (100, [1500.0, 200.0], 0, 0, [0, 0], "", 0),  # one idle replica: not busy
    (300, [5000.0], 0, 0, [0], "", 0),  # busy, but too long to keep local
    (64, [5000.0, 5000.0], 0, 0, [0, 0], "", 0),
    (65, [999.0], 0, 0, [0], "", 0),
    (192, [1000.0], 0, 0, [0], "", 0),
    (193, [1000.0], 0, 0, [0], "", 0),
    (40, [0.0], 1, 0, [0], "", 0),  # 40 x 5 > 64: the decode it would stall sends it to the pool
    (12, [0.0], 1, 0, [0], "", 0),  # 12 x 5 <= 64: still local
    (13, [0.0], 1, 0, [0], "", 0),
    (300, [5000.0], 1, 0, [0], "", 0),  # the pool's queue is 17x the suffix, but a decode runs: disagg
    (100, [1500.0, 2000.0], 2, 0, [0, 0], "", 0),  # a busy pool, but 100 x 9 > 192: two decodes would stall
    (30, [1500.0, 2000.0], 1, 0, [0, 0], "", 0),  # 30 x 5 <= 192: a busy pool keeps it local
    (150, [0.0], 0, 192, [0], "", 0),  # the pool would compute 342: local_state
    (150, [0.0], 1, 192, [0], "", 0),  # 150 x 5 > 0 + 342: disagg
    (150, [500.0], 1, 192, [0], "", 0),  # 150 x 5 <= 500 + 342: local_state
    (150, [0.0, 0.0], 0, 192, [64, 192], "", 0),  # a prefill replica resumes as much: disagg
    (150, [0.0, 300.0], 0, 192, [128, 0], "tenant-a", 0),  # under a salt: 150 <= 0 + 214, local_state
    (150, [0.0], 2, 192, [128], "tenant-a", 0),  # 150 x 9 > 0 + 214: disagg
    (150, [0.0, 0.0], 0, 192, [0, 0], "", 1),  # p0 shares the decode node's host tier: resumes 192, disagg
    (150, [0.0], 0, 192, [0], "tenant-a", 1),  # the same under a salt
    # a session's first turn (every case is one) on a cold, idle decode worker, the pool busy and holding
    # the prompt's first 192 tokens: 300 x 4 <= 5000 + 108, "local_burst" (the pool resumes more, so not
    # "local_idle"); not with a decode running there, nor with a pool that is not busy
    (300, [5000.0], 0, 0, [192], "", 0),
    (300, [5000.0], 1, 0, [192], "", 0),
    (300, [500.0], 0, 0, [192], "", 0),
]


def _prompt(i: int, suffix: int, held: int) -> list[int]:
    """Case ``i``'s prompt: the ``held`` tokens its session's earlier turn computed, then the suffix."""
    rng = random.Random(i)
    return [rng.randrange(4, 260) for _ in range(held + suffix)]


def _digests(prompt: list[int], salt: str, tokens: int, model_id: str = "m") -> list[bytes]:
    """The block digests of ``prompt[:tokens]`` (full blocks) that a prefill replica of ``model_id`` reports."""
    return BlockHasher(BS, KeyExtras(model_id, cache_salt=salt)).block_hashes(prompt[:tokens])


def _nodes(loads: list[float], near: int) -> list[str]:
    """The prefill replicas' nodes: the first ``near`` share the decode worker's node."""
    return ["n0" if j < near else "n1" for j in range(len(loads))]


def _serve_router(model_id: str, loads: list[float], prompt: list[int], pool_held: list[int], salt: str,
                  near: int, peer_reads: bool):
    from deployments.request_router import StateAwareRequestRouter

    rr = object.__new__(StateAwareRequestRouter)  # its pure part: no Serve controller
    rr.initialize_state({"peer_reads": peer_reads})
    now = time.time()
    rr._replicas = {f"p{i}": SimpleNamespace(
        replica_id=SimpleNamespace(unique_id=f"p{i}"),
        routing_stats={"role": "prefill", "node_id": node, "time": now, "model_id": model_id, "block_size": BS,
                       "load": {"queued_prefill_tokens": q}, "device_version": 1,  # a session resident there:
                       "device_sessions": [[h.hex() for h in _digests(prompt, salt, k, model_id)]] if k else []})
        for i, (q, k, node) in enumerate(zip(loads, pool_held, _nodes(loads, near), strict=True))}
    return rr


def _serving_decisions(cfg, peer_reads: bool) -> list[str]:
    reference = build_reference_engine(cfg)
    engine = AsyncEngine(reference)
    store = make_local_store(cfg, reference.layout)  # the decode node's host tier: turn ends are published there
    worker = StatefulWorker(engine, store, "decode-0", "n0", options=FlowOptions.from_config(cfg, prefill_retries=0))
    rng = random.Random(0)
    out = []

    async def refuse(params):  # the remote prefill: recorded, then failed (the worker prefills here)
        called.append(params.request_id)
        raise ConnectionError("no prefill replica in this test")

    async def earlier_turn(params: GenerateParams, held: int) -> None:
        """The session's earlier turn, prefilled here (no pool): its state stays resident on the engine."""
        turn = GenerateParams(f"{params.request_id}-t0", params.prompt_token_ids[:held], params.sampling,
                              session_id=params.session_id, cache_salt=params.cache_salt)
        chunks = [c async for c in worker.generate(turn)]
        await worker.flow.drain()  # its turn end is published (the engine releases it, still resident)
        assert chunks[-1].finished
        assert await engine.resident_length(params.prompt_token_ids, params.cache_salt) == held
        hasher = worker.hasher.with_salt(params.cache_salt)
        assert store.resumable_length(params.prompt_token_ids, hasher, len(params.prompt_token_ids) - 1).position == held

    async def run(params, batch: int, held: int):
        if held:
            await earlier_turn(params, held)
        held_streams = []  # ``batch`` streams generating on the engine while this request decides
        for j in range(batch):
            prompt = [rng.randrange(4, 260) for _ in range(8)]
            stream = engine.generate(EngineRequest(f"{params.request_id}-bg{j}", prompt,
                                                   SamplingParams(max_tokens=200, ignore_eos=True)))
            await stream.__anext__()  # admitted and decoding
            held_streams.append(stream)
        try:
            assert engine.live_requests() == batch and worker.flow.unfinished == 0  # the earlier turn's is done
            before.update(worker.flow.decisions)
            return [c async for c in worker.generate(params, refuse)]
        finally:
            for stream in held_streams:
                await stream.aclose()  # aborts it

    try:
        for i, (suffix, loads, batch, held, pool_held, salt, near) in enumerate(CASES):
            called: list[str] = []
            prompt = _prompt(i, suffix, held)
            # replicas of the same model: the view takes the flow's prompt digests (its key space)
            pool = _serve_router(engine.model_id, loads, prompt, pool_held, salt, near, peer_reads)
            worker.flow.prefill_pool = pool.pool_view
            before: dict[str, int] = {}
            chunks = asyncio.run(run(GenerateParams(f"r{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                                                    session_id=f"s{i}", cache_salt=salt, first_turn=True),
                                     batch, held))  # the ingress marks it: new to the router, as in the simulator
            assert chunks[-1].finished and chunks[-1].num_cached_tokens == held  # the resume was real
            (reason,) = [r for r, n in worker.flow.decisions.items() if n != before.get(r, 0)]
            assert (reason == "disagg") == bool(called)  # it asked the prefill pool exactly when it decided to
            out.append(reason)
    finally:
        engine.shutdown()
    return out


def _simulator_decisions(cfg, peer_reads: bool) -> list[str]:
    now = 100.0
    index = PrefixIndex()
    router = build_router("state_aware", index, lambda: now,
                          router_config={"decider": cfg.router.decider_params(), "peer_reads": peer_reads})
    out = []
    for i, (suffix, loads, batch, held, pool_held, salt, near) in enumerate(CASES):
        prompt = _prompt(i, suffix, held)
        hashes = _digests(prompt, salt, len(prompt))
        workers = [WorkerState(f"p{j}", "prefill", node, queued_prefill_tokens=q, updated_at=now)
                   for j, (q, node) in enumerate(zip(loads, _nodes(loads, near), strict=True))]
        workers.append(WorkerState("d0", "decode", "n0", running_decode_requests=batch, updated_at=now))
        for w in workers:  # on their nodes before the node's tier reports (index NOTE 3)
            index.add_worker(w.worker_id, w.node_id)
        # on device there: the blocks, and a checkpoint at the last; d0's turn end also in n0's host tier
        for tier, reporter, tokens in [("device", "d0", held), ("host", "n0", held),
                                       *(("device", f"p{j}", k) for j, k in enumerate(pool_held))]:
            for h in hashes[:tokens // BS]:
                index.apply_update(IndexUpdate("stored", "mla", h, tier, reporter))
            if tokens:
                index.apply_update(IndexUpdate("stored", "kda", hashes[tokens // BS - 1], tier, reporter))
        effective = router.effective_loads(workers, now)
        assert [effective[f"p{j}"].prefill_tokens for j in range(len(loads))] == loads
        decision = router.route(RouteRequest(f"r{i}", f"s{i}", hashes, len(prompt), BS, cache_salt=salt), workers)
        assert (decision.prefill_worker is not None) == decision.reason.startswith("disagg/")
        out.append(decision.reason.split("/")[0])
    return out


EXPECTED = ["local_short_suffix", "disagg", "local_prefill_busy", "disagg", "local_idle",
            "local_short_suffix", "local_idle", "local_prefill_busy", "local_idle",
            "disagg", "local_short_suffix", "disagg", "disagg", "disagg", "local_prefill_busy",
            "local_state", "disagg", "local_state", "disagg", "local_state", "disagg",
            "disagg", "disagg", "local_burst", "disagg", "disagg"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("peer_reads", [False, True])
def test_serving_path_and_simulator_decide_alike(peer_reads):
    """With ``peer_reads`` a prefill replica on another node resumes what the decode worker's node
    holds (``disagg.flow`` NOTE 10), so the decode worker never resumes more than the pool: the
    ``local_state`` cases go to the pool."""
    cfg = load_config({"model": {"name": "tiny"}, "router": ROUTER,
                       "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 512, "num_threads": 1}})
    threads = torch.get_num_threads()
    try:
        serving = _serving_decisions(cfg, peer_reads)
    finally:
        torch.set_num_threads(threads)  # the engine factory set one thread for this process
    assert serving == _simulator_decisions(cfg, peer_reads)
    if not peer_reads:  # the sequence exercises every rule of the decider
        assert set(serving) == {"local_short_suffix", "local_prefill_busy", "local_state", "local_idle",
                                "local_burst", "disagg"}
        assert serving == EXPECTED
    else:
        assert serving == [r.replace("local_state", "disagg") for r in EXPECTED]
