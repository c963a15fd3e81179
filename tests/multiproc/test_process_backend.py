"""Engines in worker processes (one per device) behind the HTTP API, and the
device-to-device state hand-off between them.

On this CPU machine each worker is a real process with its own engine on the
CPU, and the device hand-off shares the prefill's buffers through shared
memory: the same protocol (share, map, copy, fingerprint, release) as CUDA IPC
between two GPUs, which only the GPU benchmark (benchmarks/gpu/two_gpu.py) runs.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
import torch

from disagg.config import load_config
from disagg.engine.protocol import SamplingParams
from disagg.launch.inprocess import InProcessBackend
from disagg.launch.multiproc import ProcessBackend
from disagg.messages import GenerateParams
from kv_transfer.errors import CorruptObjectError
from tests.helpers import serve_asgi

MODEL = "disagg-tiny"


def _cfg(mode: str = "disaggregated"):
    return load_config({
        "model": {"name": "tiny"},
        "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 512, "num_threads": 1},
        "transfer": {"host": {"capacity_mb": 64, "pin_memory": False}},
        "router": {"local_prefill_max_tokens": 32},
        "deployment": {"mode": mode},
    })


def _ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


async def _run(backend, prompt, max_tokens=12, session=None, rid="r"):
    params = GenerateParams(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                            session_id=session)
    out, sources = [], []
    async for chunk in backend.stream(params):
        assert chunk.error is None, chunk.error
        out += chunk.token_ids
        sources.append(chunk.cached_source)
    return out, sources


def _reference(prompts):
    """Greedy outputs of one uninterrupted aggregated engine, no store."""
    backend = InProcessBackend(_cfg("aggregated"), host_tier=False)
    try:
        return [asyncio.run(_run(backend, p, rid=f"ref{i}"))[0] for i, p in enumerate(prompts)]
    finally:
        backend.shutdown()


PROMPTS = [_ids(200, 1), _ids(97, 2), _ids(330, 3)]


@pytest.fixture(scope="module")
def expected():
    return _reference(PROMPTS)


@pytest.mark.parametrize("handoff", ["device", pytest.param("host", marks=pytest.mark.slow)])
def test_1p1d_processes_equal_the_uninterrupted_run(expected, handoff):
    backend = ProcessBackend(_cfg(), ["cpu", "cpu"], layout="1p1d", handoff=handoff)
    try:
        async def go():
            got = [await _run(backend, p, rid=f"{handoff}{i}") for i, p in enumerate(PROMPTS)]
            stats = await backend.raw_stats()
            return got, stats

        got, stats = asyncio.run(go())
        assert [g[0] for g in got] == expected  # token for token, greedy
        decode = stats["decode-0"]["worker"]
        assert decode["remote_prefills"] == 3 and decode["load_failures"] == 0
        if handoff == "device":
            shares = stats["prefill-0"]["device_shares"]
            assert shares["shared"] == 3 and shares["released"] == 3 and shares["live"] == 0
            assert stats["prefill-0"]["worker"]["published_bytes"] == 0  # nothing went through the host tier
        else:
            assert "device_shares" not in stats["prefill-0"]
            assert stats["prefill-0"]["worker"]["published_bytes"] > 0
    finally:
        backend.shutdown()


def test_aggregated_processes_sticky_sessions_and_http(expected):
    backend = ProcessBackend(_cfg("aggregated"), ["cpu", "cpu"], layout="aggregated")
    try:
        from disagg.api.app import create_app

        async def first_turns():
            return [(await _run(backend, p, session=f"s{i}", rid=f"agg{i}"))[0] for i, p in enumerate(PROMPTS)]

        assert asyncio.run(first_turns()) == expected  # token for token, greedy
        assert len({backend._pick(GenerateParams("x", [1], SamplingParams(), session_id=f"s{i}"))
                    for i in range(16)}) == 2  # sessions spread over both workers
        with serve_asgi(create_app(backend)) as url:
            # turn 2 of session s0, over HTTP, lands on the same worker and reuses its resident state
            p2 = PROMPTS[0] + expected[0][:-1]
            r = httpx.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": p2 + _ids(5, 9), "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "user": "s0"}, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(p2) // 16 * 16
            bad = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [10**9], "max_tokens": 2})
            assert bad.status_code == 400 and bad.json()["error"]["type"]
            # the session is over (disagg.flow NOTE 14): every worker is told; the one that served it demotes
            ended = httpx.delete(url + "/v1/sessions/s0", timeout=120)
            assert ended.status_code == 200 and ended.json()["demoted_objects"] > 0, ended.text
            assert httpx.delete(url + "/v1/sessions/s9", timeout=120).json()["demoted_objects"] == 0
    finally:
        backend.shutdown()


@pytest.mark.parametrize("pool_mb", [0, 64])
def test_device_share_fingerprint_rejects_a_torn_copy(pool_mb):
    """A share whose buffer changes after its fingerprint was taken (a torn or misdirected copy) is refused."""
    from disagg.engine.factory import build_reference_engine
    from disagg.engine.protocol import EngineRequest
    from kv_transfer.transport.device_ipc import DeviceShares, open_shared

    engine = build_reference_engine(_cfg())
    req = EngineRequest("a", _ids(150, 4), SamplingParams(max_tokens=1), keep_state=True)
    engine.add_request(req)
    while engine.has_work():
        engine.step()
    state = engine.export_state("a", on_device=True)
    shares = DeviceShares(ttl_s=60, pool_bytes=pool_mb << 20)
    desc = shares.share(state)  # a descriptor is opened once (as by the one decode it was made for)
    ok = open_shared(desc, "cpu")
    assert torch.equal(ok.mla_rows, state.mla_rows) and torch.equal(ok.kda[0].recurrent, state.kda[0].recurrent)
    assert ok.tail is not None and torch.equal(ok.tail.rows, state.tail.rows)
    assert shares.release(desc.share_id) and not shares.release(desc.share_id)
    torn = shares.share(state)
    shares._live[torn.share_id][1][0].view(-1)[7] += 1.0  # the shared buffer changes after its fingerprint
    with pytest.raises(CorruptObjectError):
        open_shared(torn, "cpu")
    assert shares.release(torn.share_id)
    desc2 = shares.share(state)
    assert shares.reap(now=1e18) == 1 and len(shares) == 0  # an unacked share expires
    assert shares.stats()["expired"] == 1 and desc2.nbytes > 0
    assert shares.stats()["pooled"] == (3 if pool_mb else 0)
    if pool_mb:  # every range went back to the pool
        assert shares._pool._free == [(0, pool_mb << 20)]


def test_retention_demotes_through_the_node_store_process():
    """A session's superseded checkpoints are demoted in the host tier that the decode process
    reaches over the node store's socket (``DEMOTE_MANY``), tails the prefill process put included."""
    cfg = _cfg()
    cfg.engine.resident_sessions = False  # every follow-up resumes from the host tier
    cfg.transfer.host.keep_checkpoints = 2
    backend = ProcessBackend(cfg, ["cpu", "cpu"], layout="1p1d", handoff="host")
    try:
        async def go():
            convo, sources = _ids(200, 1), []
            for t in range(4):
                prompt = convo + _ids(150, 10 + t)
                out, src = await _run(backend, prompt, max_tokens=4, session="s", rid=f"ret{t}")
                convo, sources = prompt + out, sources + src[:1]
            return sources, await backend.raw_stats()

        sources, stats = asyncio.run(go())
    finally:
        backend.shutdown()
    decode = stats["decode-0"]
    assert sources == ["computed", "host", "host", "host"]
    # turn 2 began after turn 1's publish and its demotes (flow NOTE 6): turn 0's points are demoted
    points, objects = decode["worker"]["checkpoints_demoted"], decode["store"]["num_retention_demoted"]
    assert points > 0 and objects > points  # unaligned points' tails (put by the prefill process) too
    assert decode["store"]["tier:host"]["num_demoted"] >= objects  # a demote may land between the two reads


def test_a_worker_process_recalls_what_the_other_ones_device_holds():
    """``transfer.host.victim`` across processes (``kv_transfer.tiers.host`` NOTE 9 over the node's
    socket): worker X's device holds a document the node's host tier let go; a question on it
    from a session placed on worker Y recalls it, X writes it back between two of its steps, and
    Y resumes the whole document from the host tier, token-exact against an unshared run."""
    cfg = load_config({
        "model": {"name": "tiny"},
        "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 512, "num_threads": 1},
        "transfer": {"host": {"capacity_mb": 64, "pin_memory": False, "victim": True, "recall_ms": 5000}},
        "deployment": {"mode": "aggregated"},
    })
    doc, question = _ids(6 * 64 + 20, 31), _ids(30, 32)  # 6 blocks and a tail
    backend = ProcessBackend(cfg, ["cpu", "cpu"], layout="aggregated")
    try:
        def pick(session):
            return backend._pick(GenerateParams("x", [1], SamplingParams(), session_id=session))

        x = pick("s0")
        other = next(f"s{i}" for i in range(1, 64) if pick(f"s{i}") != x)

        async def go():
            await _run(backend, doc, max_tokens=3, session="s0", rid="first")
            deadline = time.monotonic() + 30  # X holds its resident session's keys just after the turn
            while backend.host.num_held() < 6 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            for key in backend.host.keys():  # the tier let it go; X's device holds it
                backend.host.delete(key)
            params = GenerateParams("second", doc + question, SamplingParams(max_tokens=8, ignore_eos=True),
                                    session_id=other)
            out, last = [], None
            async for chunk in backend.stream(params):
                assert chunk.error is None, chunk.error
                out += chunk.token_ids
                last = chunk
            return out, last

        out, last = asyncio.run(go())
        assert last.num_cached_tokens == len(doc) and last.cached_source == "host"
        assert backend.host.stats()["num_recalled_keys"] >= 6
    finally:
        backend.shutdown()
    assert out == _reference([doc + question])[0][:8]  # greedy: the first 8 of its 12 tokens
