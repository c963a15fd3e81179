"""What the prefill side holds for a hand-off is given back however the request ends: a held
engine request cancelled before its publish, and a device hand-off the decode side never opens
(a one-token answer, a stop token first, a client that leaves after the first token). Also: the
in-process backend configures its workers as the deployments do.

The device hand-off runs on CPU through shared memory (``kv_transfer.transport.device_ipc``).
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from disagg.config import load_config
from disagg.engine.async_engine import AsyncEngine
from disagg.engine.factory import build_reference_engine
from disagg.engine.protocol import SamplingParams
from disagg.engine.reference.engine import ReferenceEngine
from disagg.flow import FlowOptions
from disagg.launch.inprocess import InProcessBackend
from disagg.messages import GenerateParams
from disagg.router.decider import DeciderConfig
from disagg.workers.tiered import StatefulWorker
from kv_transfer.transport.device_ipc import DeviceShares

_OPTIONS = FlowOptions(DeciderConfig(local_prefill_max_tokens=64))


def _cfg(mode: str = "disaggregated", **extra):
    return load_config({"model": {"name": "tiny"},
                        "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 512, "num_threads": 1},
                        "transfer": {"host": {"capacity_mb": 64, "pin_memory": False}},
                        "router": {"local_prefill_max_tokens": 64}, "deployment": {"mode": mode}, **extra})


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 260) for _ in range(n)]


def _params(rid: str, prompt: list[int], n: int, **sampling) -> GenerateParams:
    return GenerateParams(rid, prompt, SamplingParams(max_tokens=n, **sampling))


def test_a_prefill_cancelled_before_its_publish_releases_its_held_state():
    """The client leaves while the prefill worker, its engine request finished and held, waits
    for the engine (a long step in progress, stretched here): the held blocks come back."""
    backend = InProcessBackend(_cfg())
    eng = backend.prefill.engine.engine
    positions = eng.checkpoint_positions

    def slow(rid):
        time.sleep(0.3)
        return positions(rid)

    eng.checkpoint_positions = slow

    async def run() -> None:
        async def consume() -> None:
            async for _ in backend.stream(_params("c1", _ids(300, 3), 8, ignore_eos=True)):
                pass

        task = asyncio.ensure_future(consume())
        while not eng._held:  # the prefill's request finished: held for the publish
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if not eng.stats()["held"]:
                break
            await asyncio.sleep(0.01)

    try:
        asyncio.run(run())
        assert eng.stats()["held"] == 0
    finally:
        backend.shutdown()


@pytest.fixture
def device_pair():
    """A prefill worker that hands off through device shares, and a decode worker."""
    engine = build_reference_engine(_cfg())
    shares = DeviceShares(pool_bytes=64 << 20)
    prefill = StatefulWorker(AsyncEngine(ReferenceEngine(engine.model, engine.model_id, engine.options)), None,
                             "prefill-0", options=_OPTIONS, device_shares=shares)
    decode = StatefulWorker(AsyncEngine(engine), None, "decode-0", options=_OPTIONS)

    async def release(handle) -> None:
        shares.release(handle.device_state.share_id)

    yield prefill, decode, shares, release
    prefill.engine.shutdown()
    decode.engine.shutdown()


def _stream(decode, prefill, release, params, take: int | None = None) -> list[int]:
    async def run() -> list[int]:
        out: list[int] = []
        gen = decode.generate(params, prefill.prefill, release)
        async for chunk in gen:
            out.extend(chunk.token_ids)
            if take is not None and len(out) >= take:
                break
        await gen.aclose()
        await asyncio.sleep(0.05)  # the spawned release runs
        return out

    return asyncio.run(run())


@pytest.mark.parametrize("ending", ["whole stream", "one token", "stop token first", "client leaves"])
def test_a_device_hand_off_is_released_however_the_request_ends(device_pair, ending):
    prefill, decode, shares, release = device_pair
    prompt = _ids(200, 2)
    if ending == "whole stream":
        _stream(decode, prefill, release, _params("a", prompt, 4, ignore_eos=True))
    elif ending == "one token":
        _stream(decode, prefill, release, _params("b", prompt, 1))
    elif ending == "stop token first":
        first = _stream(decode, prefill, release, _params("c0", prompt, 1))[0]
        assert len(shares) == 0
        _stream(decode, prefill, release, _params("c", prompt, 4, stop_token_ids=(first,)))
    else:
        _stream(decode, prefill, release, _params("d", prompt, 8, ignore_eos=True), take=1)
    assert len(shares) == 0, shares.stats()


def test_the_in_process_backend_configures_its_workers_like_the_deployments():
    """The load deadline and fault rules apply in process too; without a store there is no
    prefill worker (its state could not reach the decode worker: it would be computed twice)."""
    backend = InProcessBackend(_cfg(transfer={"host": {"capacity_mb": 64, "pin_memory": False},
                                              "load_deadline_s": 0.5},
                                    faults={"enabled": True, "rules": [{"fault": "drop", "nth": 1}]}))
    try:
        assert backend.decode.flow.options.load_deadline_s == backend.prefill.flow.options.load_deadline_s == 0.5
        # the first load is dropped: the decode worker recomputes, counted, with the same tokens
        out = asyncio.run(_drain(backend, _params("f", _ids(300, 5), 4, ignore_eos=True)))
        assert backend.decode.counters["remote_prefills"] == 1 and backend.decode.counters["load_failures"] >= 1
        assert backend.decode.faults is not None
        assert len(out) == 4
    finally:
        backend.shutdown()
    no_store = InProcessBackend(_cfg(), host_tier=False)
    try:
        assert no_store.prefill is None
        asyncio.run(_drain(no_store, _params("x", _ids(300, 1), 4, ignore_eos=True)))
        assert no_store.decode.counters["load_failures"] == 0 and no_store.decode.counters["local_prefills"] == 1
    finally:
        no_store.shutdown()


async def _drain(backend, params) -> list[int]:
    out: list[int] = []
    async for chunk in backend.stream(params):
        assert chunk.error is None, chunk.error
        out.extend(chunk.token_ids)
    return out
