"""A P/D decode worker counts the requests on their way to its batch (``disagg.flow`` NOTE 15):
from its decision to send a prompt to the prefill pool until the decode goes to its engine, or
the request ends. Its replica reports them to the router beside the engine's load
(``routing_load``). Real reference workers in one process (``InProcessBackend``); the prefill call
is wrapped to hold it open or make it fail, as a slow or dead prefill replica would."""

from __future__ import annotations

import asyncio
import random

from disagg.config import load_config
from disagg.engine.protocol import SamplingParams
from disagg.launch.inprocess import InProcessBackend
from disagg.messages import GenerateParams


def _backend() -> InProcessBackend:
    return InProcessBackend(load_config({
        "model": {"name": "tiny"}, "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 512, "num_threads": 1},
        "transfer": {"host": {"capacity_mb": 64, "pin_memory": False}},
        "router": {"local_prefill_max_tokens": 64}, "deployment": {"mode": "disaggregated"}}))


def _params(rid: str, n_prompt: int, n_out: int, seed: int) -> GenerateParams:
    rng = random.Random(seed)
    prompt = [rng.randrange(4, 260) for _ in range(n_prompt)]
    return GenerateParams(rid, prompt, SamplingParams(max_tokens=n_out, ignore_eos=True))


def _held_prefill(backend: InProcessBackend, fail: bool = False):
    """Wrap the prefill replica: each call waits for the test's go, then runs (or fails)."""
    real = backend.prefill.prefill
    entered, go = asyncio.Event(), asyncio.Event()

    async def held(params):
        entered.set()
        await go.wait()
        if fail:
            raise ConnectionError("prefill replica gone")
        return await real(params)

    return held, entered, go


def test_a_request_counts_inbound_while_its_prefill_runs_in_the_pool():
    backend = _backend()
    flow = backend.decode.flow

    async def run() -> None:
        held, entered, go = _held_prefill(backend)
        params = _params("r1", 300, 6, 1)
        seen: list[dict] = []

        async def consume() -> list[int]:
            out = []
            async for chunk in backend.decode.generate(params, held):
                seen.append(flow.routing_load())
                out += chunk.token_ids
            return out

        task = asyncio.ensure_future(consume())
        await entered.wait()
        assert flow.routing_load() == {"inbound_decode_requests": 1, "inbound_decode_tokens": 300}
        assert backend.decode.engine.live_requests() == 0  # the engine does not see it yet
        go.set()
        tokens = await task
        assert len(tokens) == 6 and flow.counters["remote_prefills"] == 1
        assert seen[0]["inbound_decode_requests"] == 1  # the first token came from the pool
        assert seen[-1]["inbound_decode_requests"] == 0  # the decode ran on this engine
        assert flow.routing_load() == {"inbound_decode_requests": 0, "inbound_decode_tokens": 0}

    asyncio.run(run())


def test_a_failed_remote_prefill_or_a_client_gone_stops_counting():
    backend = _backend()
    flow = backend.decode.flow
    flow.options.prefill_retries = 0

    async def run() -> None:
        held, entered, go = _held_prefill(backend, fail=True)
        task = asyncio.ensure_future(_drain(backend.decode.generate(_params("r2", 300, 4, 2), held)))
        await entered.wait()
        assert flow.inbound == 1
        go.set()
        assert len(await task) == 4  # prefilled here instead
        assert flow.counters["local_prefills"] == 1 and flow.inbound == 0 and flow.inbound_tokens == 0

        held, entered, go = _held_prefill(backend)
        task = asyncio.ensure_future(_drain(backend.decode.generate(_params("r3", 300, 4, 3), held)))
        await entered.wait()
        assert flow.inbound == 1
        task.cancel()  # the client leaves while the pool prefills
        try:
            await task
        except asyncio.CancelledError:
            pass
        assert flow.inbound == 0 and flow.inbound_tokens == 0

    asyncio.run(run())


async def _drain(chunks) -> list[int]:
    out = []
    async for chunk in chunks:
        out += chunk.token_ids
    return out
