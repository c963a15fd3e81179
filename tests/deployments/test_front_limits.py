"""The HTTP front's bounds on clients, enforced by the real HAProxy binary (bundled with ray[serve]
on Linux) running the config ``deployments.haproxy_front.front_limits`` makes of a Serve-shaped
one, in front of a real uvicorn app. No Ray: what Serve adds (its template) is checked in
test_haproxy_front.py, the whole path in tests/deployments/test_serve_edge.py.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time

import httpx
import pytest

from deployments import haproxy_front
from disagg.launch.local import free_port
from tests.helpers import serve_asgi

# keep-alive 5 s: the per-address cap test holds answered connections idle while it checks the cap
LIMITS = haproxy_front.FrontLimits(header_timeout_s=1, body_timeout_s=2, keep_alive_timeout_s=5,
                                   max_connections_per_client=4)
# Serve's defaults as it renders them (ray/serve/_private/haproxy_templates.py), abridged
SERVE_CFG = """global
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 3600s
    option abortonclose
    option splice-request
    option splice-response
    option http-no-delay
    option idle-close-on-response
frontend http_frontend
    bind 127.0.0.1:{front}
    default_backend app
backend app
    http-reuse always
    timeout http-keep-alive 90s
    server r1 127.0.0.1:{app} check
"""


class _App:
    """Records what each request saw after its body: a disconnect, or nothing yet."""

    def __init__(self):
        self.after_body: list[str] = []
        self.paths: list[str] = []  # every request that reached the app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        self.paths.append(scope["path"])
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/hold":  # a non-streamed request that takes long: did its client leave?
            message = await asyncio.wait_for(receive(), 30)
            self.after_body.append(message["type"])
            return
        if scope["path"] == "/slow":  # a response that starts late and pauses past every client timeout
            await asyncio.sleep(LIMITS.body_timeout_s + 1)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for _ in range(2):
                await send({"type": "http.response.body", "body": b"x", "more_body": True})
                await asyncio.sleep(LIMITS.body_timeout_s + 1)
            await send({"type": "http.response.body", "body": b"x"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    try:
        binary = haproxy_front.real_binary()
    except FileNotFoundError:
        pytest.skip("no HAProxy binary on this machine")
    app = _App()
    with serve_asgi(app) as url:
        port = free_port()
        cfg = tmp_path_factory.mktemp("front") / "haproxy.cfg"
        cfg.write_text(haproxy_front.front_limits(SERVE_CFG.format(front=port, app=url.rsplit(":", 1)[1]), LIMITS))
        proc = subprocess.Popen([binary, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
                time.sleep(0.1)
            yield {"port": port, "app": app}
        finally:
            proc.terminate()
            proc.wait(10)


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
    return sock


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _read_response(sock: socket.socket) -> bytes:
    """One whole response of the test app: the head, then its 2-byte body (TCP may split them)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < 2:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    return data


def test_headers_that_trickle_get_408_and_the_connection_closed(front):
    sock = _connect(front["port"])
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
    t0 = time.monotonic()
    for _ in range(10):  # a header line every 0.5 s: never idle, never done
        time.sleep(0.5)
        try:
            sock.sendall(b"X-Slow: 1\r\n")
        except OSError:
            break
    reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:80]
    assert time.monotonic() - t0 < 10 * 0.5 + 1


def test_an_idle_keep_alive_connection_is_closed(front):
    sock = _connect(front["port"])
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _read_response(sock).startswith(b"HTTP/1.1 200")
    t0 = time.monotonic()
    assert _read_all(sock) == b""  # closed by the front, not by us
    assert time.monotonic() - t0 < 20


def test_connections_per_address_are_capped_and_other_addresses_unaffected(front):
    held = []
    try:  # each a live connection the front accepted, its request sent at once (the header timeout is 1 s)
        for _ in range(LIMITS.max_connections_per_client):
            held.append(sock := _connect(front["port"], "127.0.0.2"))
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        with pytest.raises(OSError):  # refused at accept: reset (maybe at connect), or closed before any reply
            extra = _connect(front["port"], "127.0.0.2")
            extra.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            if _read_all(extra) == b"":
                raise ConnectionResetError("closed")
        assert httpx.get(f"http://127.0.0.1:{front['port']}/", timeout=10).status_code == 200
    finally:
        for sock in held:
            sock.close()


def test_a_client_that_leaves_after_a_late_body_is_seen_leaving(front):
    """With Serve's ``option splice-request`` the late body was spliced and the close never reached
    the app: a non-streamed generation ran on for nobody."""
    front["app"].after_body.clear()
    sock = _connect(front["port"])
    sock.sendall(b"POST /hold HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n")
    time.sleep(0.2)  # the body comes in a later segment than the headers
    sock.sendall(b"{}")
    time.sleep(0.5)
    sock.close()
    deadline = time.monotonic() + 20
    while not front["app"].after_body:
        assert time.monotonic() < deadline, "the app never saw the client leave"
        time.sleep(0.05)
    assert front["app"].after_body == ["http.disconnect"]


def test_a_slow_response_outlives_the_client_timeouts(front):
    """``timeout client`` bounds a client that stops sending its request, not one waiting for a
    generation (a long prefill, pauses between tokens)."""
    r = httpx.get(f"http://127.0.0.1:{front['port']}/slow", timeout=60)
    assert r.status_code == 200 and r.content == b"xxx"


def test_a_slow_small_body_is_held_and_refused_at_the_front(front):
    """A body that trickles in is buffered by the front (option http-buffer-request) and refused
    there: it never reaches the app, where it would hold one of the ingress's Serve slots."""
    front["app"].paths.clear()
    sock = _connect(front["port"])
    sock.sendall(b"POST /slow-body HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"{" * 10)
    t0 = time.monotonic()
    sock.settimeout(0.3)
    reply = b""
    while time.monotonic() - t0 < 20:
        try:
            reply = sock.recv(65536)
            break
        except TimeoutError:
            sock.sendall(b" ")
    sock.settimeout(30)
    reply += _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:80]
    assert "/slow-body" not in front["app"].paths


def test_a_body_larger_than_the_buffer_goes_through(front):
    r = httpx.post(f"http://127.0.0.1:{front['port']}/big", content=b"x" * (200 << 10), timeout=30)
    assert r.status_code == 200 and r.content == b"ok"
