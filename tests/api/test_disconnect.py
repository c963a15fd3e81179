"""A client that disconnects mid-stream stops its generation at once (real HTTP server, the
in-process backend over the reference engine).

Starlette cancels the streaming task on a disconnect under an anyio cancel scope, which cancels
every await in the ``finally`` blocks that unwind it; the abort must not be one of them
(``disagg.engine.async_engine`` NOTE 4). Before that, the engine went on generating all 3,000
tokens for nobody.
"""

from __future__ import annotations

import time

import httpx
import pytest

from disagg.api.app import create_app
from disagg.config import HTTPConfig
from tests.helpers import serve_asgi, tiny_aggregated_backend


@pytest.fixture(scope="module")
def backend():
    with tiny_aggregated_backend() as b:
        yield b


@pytest.mark.parametrize("n", [1, 3])  # n choices: every one of them stops
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_aborts_the_generation(backend, path, n):
    engine = backend.decode.engine.engine
    body = {"model": "disagg-tiny", "max_tokens": 3000, "ignore_eos": True, "stream": True, "n": n}
    body |= {"prompt": "hold"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hold"}]}
    with serve_asgi(create_app(backend, HTTPConfig())) as url:
        before = engine.stats()["decode_tokens"]
        with httpx.stream("POST", url + path, json=body, timeout=60) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events >= 3 * n:
                    break
        deadline = time.monotonic() + 30
        while engine.stats()["running"] or engine.stats()["held"]:
            assert time.monotonic() < deadline, "the abandoned request is still in the engine"
            time.sleep(0.01)
        generated = engine.stats()["decode_tokens"] - before
    assert generated < 300 * n, f"{generated} tokens generated after the client left (of {3000 * n} asked)"


def test_an_abandoned_non_streamed_request_stops_every_choice(backend):
    engine = backend.decode.engine.engine
    body = {"model": "disagg-tiny", "prompt": "hold", "max_tokens": 3000, "ignore_eos": True, "n": 3}
    with serve_asgi(create_app(backend, HTTPConfig())) as url:
        before = engine.stats()["decode_tokens"]
        with pytest.raises(httpx.ReadTimeout):  # the client leaves after 1 s
            httpx.post(url + "/v1/completions", json=body, timeout=1.0)
        deadline = time.monotonic() + 30
        while engine.stats()["running"] or engine.stats()["held"]:
            assert time.monotonic() < deadline, "a choice of the abandoned request is still in the engine"
            time.sleep(0.01)
        generated = engine.stats()["decode_tokens"] - before
    assert generated < 3 * 3000 / 2, f"{generated} tokens generated for nobody (of 9000 asked)"
