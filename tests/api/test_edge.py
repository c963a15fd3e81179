"""The HTTP edge (``disagg.api.limits.EdgeMiddleware``) over real HTTP: checks apply under a
mount's root path, and a client that leaves before its body arrived or while queued at the
gate is let go at once (nothing partial served, its queue place and key count given back).

The backend is scripted (it can hold its requests) so the gate's state is known; the HTTP
server, middleware and app are the real ones.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from disagg.api.app import create_app
from disagg.config import HTTPConfig
from disagg.launch.local import free_port
from disagg.messages import StreamChunk
from tests.api.test_stream_text import OFFSET
from tests.helpers import serve_asgi


class _Held:
    """A backend whose requests wait for ``release`` (set from any thread)."""

    model_name, max_model_len, vocab_size = "disagg-tiny", 4096, 260

    def __init__(self, hold: bool = False):
        from disagg.config import load_config
        from disagg.engine.factory import build_tokenizer

        self.tokenizer = build_tokenizer(load_config({"model": {"name": "tiny"}}))
        self.prompts: list[str] = []
        self.hold = threading.Event()
        if not hold:
            self.hold.set()

    async def stream(self, params):
        self.prompts.append(self.tokenizer.decode(params.prompt_token_ids))
        while not self.hold.is_set():
            await asyncio.sleep(0.01)
        yield StreamChunk([ord("A") + OFFSET], True, "length", len(params.prompt_token_ids))

    async def stats(self) -> dict:
        return {}


def _raw_post(url: str, prompt: str, extra_length: int = 0) -> socket.socket:
    """A POST sent by hand, its socket left open (the caller closes it to leave)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "disagg-tiny", "prompt": prompt, "max_tokens": 2}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % (len(body) + extra_length) + body)
    return sock


def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_checks_apply_under_a_root_path():
    """Mounted under a prefix (uvicorn --root-path, a Serve route_prefix), the scope's path
    carries it: the API key is still required."""
    app = create_app(_Held(), HTTPConfig(api_keys=["secret"]))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off", root_path="/agg"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _until(lambda: server.started)
    try:
        body = {"model": "disagg-tiny", "prompt": "hi", "max_tokens": 2}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=10)
        assert r.status_code == 401, r.text
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=10,
                       headers={"Authorization": "Bearer secret"})
        assert r.status_code == 200, r.text
    finally:
        server.should_exit = True
        thread.join(5)


@pytest.mark.parametrize("per_key", [0, 2])
def test_a_client_that_leaves_while_queued_gives_its_place_back(per_key):
    backend = _Held(hold=True)
    app = create_app(backend, HTTPConfig(max_inflight=1, max_queued=1, queue_timeout_s=30,
                                         max_concurrent_per_key=per_key))
    gate = app.state.gate
    with serve_asgi(app) as url:
        body = {"model": "disagg-tiny", "prompt": "hold", "max_tokens": 2}
        holder = threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json=body, timeout=60),
                                  daemon=True)
        holder.start()
        _until(lambda: gate.num_running == 1)
        gone = _raw_post(url, "gone")
        _until(lambda: gate.num_queued == 1)
        gone.close()
        _until(lambda: gate.num_queued == 0)  # its place is free again, long before the 30 s timeout
        live: dict = {}
        waiter = threading.Thread(target=lambda: live.update(r=httpx.post(
            url + "/v1/completions", json=dict(body, prompt="live"), timeout=30)), daemon=True)
        waiter.start()
        _until(lambda: gate.num_queued == 1)  # queued, not refused (503) nor over its key (429)
        backend.hold.set()
        holder.join(10)
        waiter.join(10)
    assert live["r"].status_code == 200, live["r"].text
    assert "gone" not in "".join(backend.prompts) and gate.num_running == 0


def test_a_body_that_never_fully_arrives_is_not_served():
    backend = _Held()
    with serve_asgi(create_app(backend, HTTPConfig())) as url:
        sock = _raw_post(url, "partial", extra_length=500)  # 500 bytes promised, never sent
        time.sleep(0.3)
        sock.close()
        time.sleep(0.5)
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert backend.prompts == []


def test_a_session_end_needs_the_key_and_counts_against_its_rate():
    """DELETE /v1/sessions/{id} is behind the API key and the key's rate limit (it fans out to every
    decode replica), not the admission gate; the tenant's salt reaches the backend, never the key."""
    class _Ends(_Held):
        def __init__(self):
            super().__init__()
            self.ended: list[tuple[str, str]] = []

        async def end_session(self, session_id, cache_salt=""):
            self.ended.append((session_id, cache_salt))
            return 3

    backend = _Ends()
    app = create_app(backend, HTTPConfig(api_keys=["secret"], rate_limit_per_key=0.01, rate_burst_per_key=1))
    auth = {"Authorization": "Bearer secret"}
    with serve_asgi(app) as url:
        assert httpx.delete(url + "/v1/sessions/s1", timeout=30).status_code == 401
        ok = httpx.delete(url + "/v1/sessions/s1", headers=auth, timeout=30)
        assert ok.status_code == 200 and ok.json() == {"id": "s1", "object": "session", "ended": True,
                                                        "demoted_objects": 3}
        limited = httpx.delete(url + "/v1/sessions/s2", headers=auth, timeout=30)
        assert limited.status_code == 429 and limited.json()["error"]["code"]
    assert len(backend.ended) == 1 and backend.ended[0][0] == "s1"
    salt = backend.ended[0][1]
    assert salt and "secret" not in salt  # the tenant's salt (disagg.api.limits.tenant_salt)
