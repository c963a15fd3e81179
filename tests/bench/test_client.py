"""The streaming client over real HTTP against the controlled-timing test server."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import numpy as np
import pytest

from disagg.tools.bench.client import OpenAIClient, RequestResult
from disagg.tools.bench.metrics import summarize
from disagg.tools.bench.testserver import TestServerConfig, TestServerProcess


def _run(coro):
    return asyncio.run(coro)


async def _complete(url: str, prompts: list, max_tokens: int, **kw: Any) -> list[RequestResult]:
    async with OpenAIClient(url, model="m", **kw) as client:
        return [await client.complete(p, max_tokens) for p in prompts]


TRANSPORTS = pytest.mark.parametrize("transport", ["raw", "aiohttp"])


@TRANSPORTS
def test_ttft_and_itl_match_controlled_timings(transport: str) -> None:
    """Set TTFT 50 ms and ITL 20 ms: never early, and the ITL that the server really kept.

    The server runs in its own process (a server thread would share the GIL with the
    client). It keeps its schedule on an idle machine and falls behind on a busy one (TTFT
    p50 150 ms, ITL 17.5 ms, seen with other jobs on 2 cores), so upper bounds on the set
    values would test the machine; the client is held to what the server did (its own
    record). TTFT accuracy against the server's kernel stamps is
    test_client_times_agree_with_server_times'. The first request opens the connection and
    warms both sides up: not measured.
    """
    prompts = [list(range(100 + i)) for i in range(8)]
    with TestServerProcess(TestServerConfig(ttft_ms=50, itl_ms=20, record_timings=True)) as server:
        results, timings = _run(_complete_with_timings(server.url, prompts, 10, transport))
    served_itl_ms = []
    for r in results[1:]:
        assert r.ok, r.error_detail
        assert r.output_tokens == 10 and len(r.chunk_ns) == 10
        assert r.ttft_ms >= 50 and r.e2e_ms >= 230  # never early; late only by scheduling
        assert r.itl_ms == pytest.approx((r.e2e_ms - r.ttft_ms) / (10 - 1))
        sent = timings[r.request_id]["tx_ns"] or timings[r.request_id]["write_ns"]
        served_itl_ms.append((sent[-1] - sent[0]) / 1e6 / (10 - 1))
    # Medians resist the odd descheduled read. A client that falls behind reads several
    # tokens at once, each stamped when the newest arrived (rawhttp NOTE 1); on a busy
    # machine that moved the p50 ITL by up to ~6 ms: 8 ms still fails an ITL off by 10.
    s = summarize(results[1:])
    assert s.itl_ms.p50 == pytest.approx(float(np.median(served_itl_ms)), abs=8.0)


async def _complete_with_timings(
    url: str, prompts: list, max_tokens: int, transport: str
) -> tuple[list[RequestResult], dict]:
    async with OpenAIClient(url, model="m", transport=transport) as client:
        results = [await client.complete(p, max_tokens) for p in prompts]
        return results, json.loads(await client.get_text("/debug/timings"))


async def _with_server_times(url: str, n: int, transport: str) -> tuple[list[RequestResult], dict]:
    async with OpenAIClient(url, model="m", transport=transport, send_stamps=True) as client:
        results = [await client.complete(list(range(50)), 8) for _ in range(n)]
        return results, json.loads(await client.get_text("/debug/timings"))


def test_client_times_agree_with_server_times() -> None:
    """Harness error against the server's own record (server in a child process).

    Truth per chunk: the kernel's transmit stamp of its write on the server
    (the write time where the kernel gives none); per request: the kernel's
    transmit stamp of the request (raw transport). The raw transport's
    stamps come from the kernel too, so only its per-read granularity is
    left; aiohttp's come from its event loop and include the handler-side
    path, so its TTFT is only checked from the server's handler start.
    """
    config = TestServerConfig(ttft_ms=10, itl_ms=5, record_timings=True)
    with TestServerProcess(config) as server:
        raw, timings = _run(_with_server_times(server.url, 12, "raw"))
        loop, loop_timings = _run(_with_server_times(server.url, 12, "aiohttp"))
    ttft_err, itl_err, rx_err = [], [], []
    for r in raw[1:]:
        t = timings[r.request_id]
        sent = t["tx_ns"] or t["write_ns"]
        assert r.send_kernel_ns is not None and r.send_ns <= r.send_kernel_ns
        ttft_err.append(r.ttft_ms - (sent[0] - r.send_kernel_ns) / 1e6)
        itl_err.append(r.itl_ms - (sent[-1] - sent[0]) / 1e6 / 7)
        rx_err += [(c - w) / 1e6 for c, w in zip(r.chunk_ns, sent, strict=True)]
    assert abs(float(np.median(ttft_err))) < 0.5
    assert abs(float(np.median(itl_err))) < 0.1
    assert abs(float(np.median(rx_err))) < 0.2  # a chunk is stamped when it arrived
    loop_err = []
    for r in loop[1:]:
        t = loop_timings[r.request_id]
        loop_err.append(r.ttft_ms - (t["write_ns"][0] - t["recv_ns"]) / 1e6)
    # aiohttp's stamps include its loop's delay: positive, a few ms (6 on a busy machine);
    # below 20 ms, so a stamp taken at the end of the response (35 ms after the first
    # token here) still fails.
    assert 0 < float(np.median(loop_err)) < 20.0


@TRANSPORTS
def test_usage_and_cached_tokens(server_factory, transport: str) -> None:
    server = server_factory(cache_block_size=16)
    prompts = [list(range(100)), list(range(100)), list(range(40))]
    a, b, c = _run(_complete(server.url, prompts, 3, transport=transport))
    assert (a.prompt_tokens, a.cached_tokens) == (100, 0)
    assert (b.prompt_tokens, b.cached_tokens) == (100, 96)  # 6 full blocks of 16
    assert c.cached_tokens == 32


async def _metrics(url: str) -> str:
    async with OpenAIClient(url, model="m") as client:
        await client.complete(list(range(64)), 2)
        await client.complete(list(range(64)), 2)
        return await client.get_text("/metrics")


def test_metrics_endpoint(server_factory) -> None:
    text = _run(_metrics(server_factory().url))
    assert 'disagg_prompt_tokens_total{source="device"} 48.0' in text  # the repeat but its last block
    assert 'disagg_prompt_tokens_total{source="computed"} 80.0' in text


@TRANSPORTS
def test_text_prompts_and_chat(server_factory, transport: str) -> None:
    server = server_factory()
    kw = {"prompt_mode": "text", "transport": transport}
    (r,) = _run(_complete(server.url, ["alpha beta gamma"], 4, **kw))
    assert r.ok and r.prompt_tokens == 3 and r.output_tokens == 4
    (c,) = _run(_complete(server.url, ["alpha beta"], 5, endpoint="chat", **kw))
    assert c.ok and c.output_tokens == 5 and len(c.chunk_ns) == 5
    with pytest.raises(ValueError, match="text prompts"):
        OpenAIClient(server.url, endpoint="chat", prompt_mode="tokens")


@TRANSPORTS
def test_api_key_header(server_factory, transport: str) -> None:
    server = server_factory(api_key="sekrit")
    (bad,) = _run(_complete(server.url, [[1, 2]], 2, transport=transport))
    (good,) = _run(_complete(server.url, [[1, 2]], 2, api_key="sekrit", transport=transport))
    assert bad.error == "http_4xx" and bad.status == 401 and good.ok


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@TRANSPORTS
def test_failures_are_recorded_with_their_class(server_factory, transport: str) -> None:
    kw = {"transport": transport}
    five = server_factory(fail_every=2)
    r = _run(_complete(five.url, [[1], [1]], 2, **kw))
    assert r[0].ok and r[1].error == "http_5xx" and r[1].status == 500
    broken = server_factory(fail_every=1, break_after=3, itl_ms=1)
    (b,) = _run(_complete(broken.url, [[1, 2, 3]], 10, **kw))
    assert b.error == "stream_broken" and len(b.chunk_ns) == 3
    (bad,) = _run(_complete(five.url, [None], 2, **kw))
    assert bad.error == "http_4xx" and bad.status == 400
    (conn,) = _run(_complete(f"http://127.0.0.1:{_free_port()}", [[1]], 2, **kw))
    assert conn.error == "connect" and conn.status is None
    slow = server_factory(ttft_ms=2000)
    (t,) = _run(_complete(slow.url, [[1]], 2, read_timeout_s=0.2, **kw))
    assert t.error == "timeout"


async def _concurrent(url: str, n: int) -> tuple[list[RequestResult], dict]:
    async with OpenAIClient(url, model="m", max_connections=n) as client:
        results = await asyncio.gather(*(client.complete([i, i + 1], 20) for i in range(n)))
        return results, json.loads(await client.get_text("/debug/timings"))


def test_many_concurrent_streams(server_factory) -> None:
    """32 streams at once: every ITL matches what the server sent (its own record).

    The server shares this process (a thread), so its pacing drifts from the
    set 5 ms under load; the client must report what was sent, not the setting.
    """
    server = server_factory(ttft_ms=20, itl_ms=5, record_timings=True)
    results, timings = _run(_concurrent(server.url, 32))
    assert all(r.ok and r.output_tokens == 20 for r in results)
    errors = []
    for r in results:
        sent = timings[r.request_id]["tx_ns"] or timings[r.request_id]["write_ns"]
        errors.append(r.itl_ms - (sent[-1] - sent[0]) / 1e6 / 19)
    assert abs(float(np.median(errors))) < 0.25
