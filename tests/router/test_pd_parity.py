"""The serving path and the simulator take the same P/D decisions for the same (suffix, loads,
decode batch).

Serving: a reference ``StatefulWorker`` (tiny CPU model, ``disagg.flow``) whose prefill pool's
loads come from the Serve request-router adapter (``pool_loads``) over replicas reporting those
loads. Serve's replica records are stand-ins (``SimpleNamespace``: the Serve controller is the
system boundary); the remote prefill call is a recorder that fails, so the worker then prefills
locally (the decision is what it did first); the decode batch is real: streams held open on the
worker's engine while the case decides. Simulator: the router the simulator builds
(``disagg.tools.sim.simulator.build_router``) over prefill workers with the same queued tokens, and a decode worker reporting as many running decodes.
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
from disagg.messages import GenerateParams
from disagg.router.index import PrefixIndex
from disagg.router.types import RouteRequest, WorkerState
from disagg.tools.sim.simulator import build_router
from disagg.workers.tiered import StatefulWorker

# thresholds small enough for a CPU prefill: local <= 64; busy pool (min queue >= 1000) keeps <= 192 local
# "local_idle" needs the prefill pool's resumable tokens, which serving's flow does not pass: off on both
# sides here (a fresh prompt ties the pool and the decode worker, where the rule would apply)
ROUTER = {"local_prefill_max_tokens": 64, "prefill_busy_tokens": 1000, "busy_local_max_tokens": 192,
          "local_idle_margin": 0}
# (uncached suffix, the prefill replicas' queued prefill tokens, decodes running on the decode worker);
# a local prefill weighs suffix x (1 + 4 x running decodes) against the short-suffix limit
CASES = [
    (40, [0.0], 0),
    (100, [0.0, 500.0], 0),
    (100, [1500.0, 2000.0], 0),  # busy pool, medium suffix: local
    (100, [1500.0, 200.0], 0),  # one idle replica: not busy
    (300, [5000.0], 0),  # busy, but too long to keep local
    (64, [5000.0, 5000.0], 0),
    (65, [999.0], 0),
    (192, [1000.0], 0),
    (193, [1000.0], 0),
    (40, [0.0], 1),  # 40 x 5 > 64: the decode it would stall sends it to the pool
    (12, [0.0], 1),  # 12 x 5 <= 64: still local
    (13, [0.0], 1),
    (100, [1500.0, 2000.0], 2),  # a busy pool keeps a medium suffix local whatever the batch
]


def _serve_router(loads: list[float]):
    from deployments.request_router import StateAwareRequestRouter

    rr = object.__new__(StateAwareRequestRouter)  # its pure part: no Serve controller
    rr.initialize_state()
    now = time.time()
    rr._replicas = {f"p{i}": SimpleNamespace(
        replica_id=SimpleNamespace(unique_id=f"p{i}"),
        routing_stats={"role": "prefill", "node_id": "n0", "time": now, "model_id": "m", "block_size": 64,
                       "load": {"queued_prefill_tokens": q}}) for i, q in enumerate(loads)}
    return rr


def _serving_decisions(cfg) -> list[str]:
    engine = AsyncEngine(build_reference_engine(cfg))
    worker = StatefulWorker(engine, None, "decode-0", options=FlowOptions.from_config(cfg, prefill_retries=0))
    rng = random.Random(0)
    out = []

    async def refuse(params):  # the remote prefill: recorded, then failed (the worker prefills here)
        called.append(params.request_id)
        raise ConnectionError("no prefill replica in this test")

    async def run(params, batch: int):
        held = []  # ``batch`` streams generating on the engine while this request decides
        for j in range(batch):
            prompt = [rng.randrange(4, 260) for _ in range(8)]
            stream = engine.generate(EngineRequest(f"{params.request_id}-bg{j}", prompt,
                                                   SamplingParams(max_tokens=200, ignore_eos=True)))
            await stream.__anext__()  # admitted and decoding
            held.append(stream)
        try:
            assert engine.live_requests() == batch
            return [c async for c in worker.generate(params, refuse)]
        finally:
            for stream in held:
                await stream.aclose()  # aborts it

    try:
        for i, (suffix, loads, batch) in enumerate(CASES):
            called: list[str] = []
            worker.flow.prefill_loads = _serve_router(loads).pool_loads
            before = dict(worker.flow.decisions)
            prompt = [rng.randrange(4, 260) for _ in range(suffix)]  # a fresh prompt: nothing cached
            chunks = asyncio.run(run(GenerateParams(f"r{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                                                    session_id=f"s{i}"), batch))
            assert chunks[-1].finished and chunks[-1].num_cached_tokens == 0
            (reason,) = [r for r, n in worker.flow.decisions.items() if n != before.get(r, 0)]
            assert (reason == "disagg") == bool(called)  # it asked the prefill pool exactly when it decided to
            out.append(reason)
    finally:
        engine.shutdown()
    return out


def _simulator_decisions(cfg) -> list[str]:
    now = 100.0
    router = build_router("state_aware", PrefixIndex(), lambda: now,
                          router_config={"decider": cfg.router.decider_params()})
    out = []
    for i, (suffix, loads, batch) in enumerate(CASES):
        workers = [WorkerState(f"p{j}", "prefill", "n0", queued_prefill_tokens=q, updated_at=now)
                   for j, q in enumerate(loads)] + [WorkerState("d0", "decode", "n0", running_decode_requests=batch,
                                                                updated_at=now)]
        effective = router.effective_loads(workers, now)
        assert [effective[f"p{j}"].prefill_tokens for j in range(len(loads))] == loads
        decision = router.route(RouteRequest(f"r{i}", f"s{i}", [], suffix, 64), workers)
        assert (decision.prefill_worker is not None) == decision.reason.startswith("disagg/")
        out.append(decision.reason.split("/")[0])
    return out


@pytest.mark.timeout(300)
def test_serving_path_and_simulator_decide_alike():
    cfg = load_config({"model": {"name": "tiny"}, "router": ROUTER,
                       "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 512, "num_threads": 1}})
    threads = torch.get_num_threads()
    try:
        serving = _serving_decisions(cfg)
    finally:
        torch.set_num_threads(threads)  # the engine factory set one thread for this process
    assert serving == _simulator_decisions(cfg)
    # the sequence exercises every rule of the decider
    assert set(serving) == {"local_short_suffix", "local_prefill_busy", "disagg"}
    assert serving == ["local_short_suffix", "disagg", "local_prefill_busy", "disagg", "disagg",
                       "local_short_suffix", "disagg", "local_prefill_busy", "disagg",
                       "disagg", "local_short_suffix", "disagg", "local_prefill_busy"]
