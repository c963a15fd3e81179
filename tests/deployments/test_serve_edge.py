"""The HTTP edge under abuse, through the whole path: HAProxy front -> ingress replica -> decode
and prefill replicas on a real local Ray cluster (deployments/configs/local-cpu.yaml with a small
admission gate and short client timeouts).

- a non-streamed request whose client leaves stops generating, whether it was queued at the
  gate, in prefill or in decode, on both endpoints (it used to run to max_tokens: Serve's HAProxy
  config spliced late request bodies and never passed the close on);
- overload beyond the gate is shed with 503 + Retry-After (the ingress's Serve limit is derived
  from the gate, so nothing waits out of sight);
- slow bodies get 408 from the app, trickling headers 408 from the front, while /health answers;
- ``disagg serve`` refuses a config the cluster cannot place, at once.

Phases are observed, not timed: the test waits until the engine metrics show the request where
it wants it before leaving.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from disagg.config import load_config
from tests.helpers import free_port

pytestmark = pytest.mark.ray
CONFIG = Path(__file__).parents[2] / "deployments" / "configs" / "local-cpu.yaml"
MODEL = "disagg-tiny"
BODY_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def cluster():
    from disagg.launch.local import local_app, wait_healthy

    cfg = load_config(CONFIG)
    cfg.http.port = free_port()
    cfg.http.max_inflight, cfg.http.max_queued = 2, 2
    cfg.http.body_timeout_s, cfg.http.header_timeout_s = BODY_TIMEOUT_S, 2.0
    cfg.engine.max_num_batched_tokens = 128  # a long prompt prefills in many steps: observable
    cfg = load_config(cfg.model_dump(exclude={"deployment": {"ingress": {"max_ongoing_requests"}}}))  # re-derived
    with local_app(cfg) as url:
        wait_healthy(url)
        yield {"url": url, "port": cfg.http.port, "cfg": cfg}


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {"http_running": 0.0, "http_queued": 0.0}
    for line in text.splitlines():
        if line.startswith("disagg_http_running "):
            out["http_running"] = float(line.split()[-1])
        elif line.startswith("disagg_http_queued "):
            out["http_queued"] = float(line.split()[-1])
        elif m := re.match(r'disagg_engine_requests\{role="(\w+)",state="running"\} (\S+)', line):
            out[m[1]] = float(m[2])
    return out


def _wait(url: str, what, timeout_s: float = 60.0, step_s: float = 0.05) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(url)
        if what(m):
            return m
        assert time.monotonic() < deadline, f"never reached: {m}"
        time.sleep(step_s)


def _idle(m: dict[str, float]) -> bool:
    return m["http_running"] == 0 and m["http_queued"] == 0 and not m.get("decode") and not m.get("prefill")


def _send(port: int, path: str, body: dict) -> socket.socket:
    """A request sent the way most clients send it: headers, then the body in a later write."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode())
    time.sleep(0.05)
    sock.sendall(data)
    return sock


def _body(path: str, prompt_tokens: int, stream: bool = False) -> dict:
    body = {"model": MODEL, "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": stream}
    ids = [(i * 7) % 250 + 4 for i in range(prompt_tokens)]
    if path == "/v1/completions":
        return body | {"prompt": ids}
    return body | {"messages": [{"role": "user", "content": "".join(chr(97 + t % 26) for t in ids)}]}


PATHS = ["/v1/completions", "/v1/chat/completions"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_an_abandoned_request_stops_generating(cluster, path, phase):
    url = cluster["url"]
    _wait(url, _idle)
    sock = _send(cluster["port"], path, _body(path, 2500 if phase == "prefill" else 20))
    if phase == "prefill":  # remote prefill of a long prompt, in 128-token steps
        _wait(url, lambda m: m.get("prefill", 0) >= 1, step_s=0.02)
    else:
        _wait(url, lambda m: m.get("decode", 0) >= 1 and not m.get("prefill"))
        time.sleep(1.0)  # well into its 3,000 tokens
    sock.close()
    _wait(url, _idle, timeout_s=10.0)  # the goal: nothing of it runs 10 s after its client left


@pytest.mark.parametrize("path", PATHS)
def test_an_abandoned_request_queued_at_the_gate_leaves_the_queue(cluster, path):
    url = cluster["url"]
    _wait(url, _idle)
    holders = [_send(cluster["port"], "/v1/completions", _body("/v1/completions", 20, stream=True)) for _ in range(2)]
    try:
        _wait(url, lambda m: m["http_running"] == 2)
        sock = _send(cluster["port"], path, _body(path, 20))
        _wait(url, lambda m: m["http_queued"] == 1)
        sock.close()
        _wait(url, lambda m: m["http_queued"] == 0 and m["http_running"] == 2, timeout_s=10.0)
    finally:
        for h in holders:
            h.close()
    _wait(url, _idle, timeout_s=10.0)


def test_overload_is_shed_with_503_and_retry_after(cluster):
    """Gate: 2 running, 2 queued. Ten streams at once: 4 admitted or queued, the rest 503.

    An admitted stream holds its slot until every sibling has its answer (or 10 s pass, should
    queued streams answer only once admitted): one that closed at its first event freed a slot
    a late sibling on a loaded machine could take, and fewer than six were shed."""
    url = cluster["url"]
    _wait(url, _idle)
    body = _body("/v1/completions", 20, stream=True)
    answered, cond = [0], threading.Condition()
    with httpx.Client(timeout=60) as client:
        def one(_):
            with client.stream("POST", url + "/v1/completions", json=body) as r:
                with cond:
                    answered[0] += 1
                    cond.notify_all()
                if r.status_code == 200:
                    next(r.iter_lines())  # admitted: its first event
                    with cond:  # hold the slot until all ten answered
                        cond.wait_for(lambda: answered[0] >= 10, timeout=10.0)
                return r.status_code, r.headers.get("retry-after")

        with concurrent.futures.ThreadPoolExecutor(10) as ex:
            futures = [ex.submit(one, i) for i in range(10)]
            time.sleep(0.5)
            answers = [f.result(timeout=120) for f in futures]
    shed = [a for a in answers if a[0] == 503]
    assert all(a[0] in (200, 503) for a in answers), answers
    assert len(shed) >= 6 and all(retry == "1" for _, retry in shed), answers
    _wait(url, _idle, timeout_s=10.0)


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    return data


def test_a_slow_body_gets_408_while_health_stays_fast(cluster):
    data = json.dumps(_body("/v1/completions", 20)).encode()
    sock = socket.create_connection(("127.0.0.1", cluster["port"]), timeout=60)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data[:5])
    t0 = time.monotonic()
    sock.settimeout(1.0)
    reply = b""
    for i in range(5, len(data)):  # a byte a second: never idle for the front's timeout client
        try:
            reply = sock.recv(65536)
            break
        except TimeoutError:
            sock.sendall(data[i:i + 1])
            r = httpx.get(cluster["url"] + "/health", timeout=5)
            assert r.status_code == 200 and r.elapsed.total_seconds() < 1.0
    sock.settimeout(60)
    reply += _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert time.monotonic() - t0 < BODY_TIMEOUT_S + 10


def test_trickling_headers_get_408_from_the_front(cluster):
    sock = socket.create_connection(("127.0.0.1", cluster["port"]), timeout=60)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\n")
    t0 = time.monotonic()
    sock.settimeout(0.5)
    reply = b""
    while time.monotonic() - t0 < 30:
        try:
            reply = sock.recv(65536)
            break
        except TimeoutError:
            sock.sendall(b"X-Trickle: 1\r\n")
    sock.settimeout(60)
    reply += _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


def test_a_config_the_cluster_cannot_place_is_refused_at_once(cluster):
    from disagg.launch.local import PlacementError, local_app

    big = cluster["cfg"].model_copy(deep=True)
    big.deployment.decode.num_cpus = 10_000
    t0 = time.monotonic()
    with pytest.raises(PlacementError, match="CPU: replicas ask for"):
        with local_app(big, name="too-big"):
            pass
    assert time.monotonic() - t0 < 30
    assert httpx.get(cluster["url"] + "/health", timeout=10).status_code == 200  # the running app is untouched
