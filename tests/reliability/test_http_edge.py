"""The HTTP edge over real HTTP with the in-process backend: keys, limits, shedding, refusals."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import time

import httpx
import pytest

from disagg.api.app import create_app
from disagg.config import HTTPConfig
from tests.helpers import serve_asgi, tiny_aggregated_backend

MODEL = "disagg-tiny"
KEYS = ["key-a", "key-b"]


@pytest.fixture(scope="module")
def backend():
    with tiny_aggregated_backend() as b:
        yield b


@pytest.fixture(scope="module")
def serve(backend):
    """serve(**http) -> base URL of an app over the shared backend with those HTTP settings."""
    with contextlib.ExitStack() as stack:
        yield lambda **http: stack.enter_context(serve_asgi(create_app(backend, HTTPConfig(**http))))


def _auth(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _post(url: str, key: str | None = "key-a", **body) -> httpx.Response:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, **body}
    return httpx.post(url + "/v1/completions", json=body, headers=_auth(key), timeout=60)


def _is_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


@contextlib.contextmanager
def _held(url: str, key: str | None = "key-a"):
    """A streaming request that holds its slots until the block ends (then the client disconnects)."""
    body = {"model": MODEL, "prompt": "hold", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=_auth(key), timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(ln for ln in lines if ln.startswith("data: "))  # admitted and generating
        yield


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/models"])
@pytest.mark.parametrize("header", [None, "Bearer wrong", "Bearer key-a-but-longer", "Basic key-a", "key-a"])
def test_missing_or_wrong_key_is_401(serve, path, header):
    url = serve(api_keys=KEYS)
    headers = {"Authorization": header} if header else {}
    body = {"model": MODEL, "prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    if path == "/v1/models":
        r = httpx.get(url + path, headers=headers)
    else:
        r = httpx.post(url + path, json=body, headers=headers)
    _is_openai_error(r, 401, "invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"


def test_right_keys_pass_and_health_stays_open(serve):
    url = serve(api_keys=KEYS)
    for key in KEYS:
        assert _post(url, key).status_code == 200
    assert httpx.get(url + "/health").status_code == 200


def test_chunked_oversize_body_is_413_without_content_length(serve):
    url = serve(api_keys=KEYS, max_body_bytes=1 << 16)

    def chunks():
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(64):
            yield b"x" * 4096
        yield b'"}'

    r = httpx.post(url + "/v1/completions", content=chunks(), headers={**_auth("key-a"),
                                                                       "content-type": "application/json"})
    assert "content-length" not in r.request.headers  # sent chunked: only the streamed count can catch it
    _is_openai_error(r, 413, "body_too_large")


def test_per_key_concurrency_limit_is_429_and_other_keys_go_on(serve):
    url = serve(api_keys=KEYS, max_concurrent_per_key=1)
    with _held(url, "key-a"):
        r = _post(url, "key-a")
        _is_openai_error(r, 429, "concurrency_limit_exceeded")
        assert r.headers["retry-after"] == "1"
        assert _post(url, "key-b").status_code == 200
    deadline = time.monotonic() + 30  # the disconnect frees key-a's slot
    while _post(url, "key-a").status_code != 200:
        assert time.monotonic() < deadline, "the held stream never released its key's slot"
        time.sleep(0.1)


def test_per_key_rate_limit_is_429_with_retry_after(serve):
    url = serve(api_keys=KEYS, rate_limit_per_key=0.1, rate_burst_per_key=2)
    assert [_post(url, "key-a").status_code for _ in range(2)] == [200, 200]
    r = _post(url, "key-a")
    _is_openai_error(r, 429, "rate_limit_exceeded")
    assert 1 <= int(r.headers["retry-after"]) <= 10
    assert _post(url, "key-b").status_code == 200


def test_full_queue_sheds_503_and_queued_requests_still_finish(serve):
    url = serve(max_inflight=1, max_queued=1, queue_timeout_s=60)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with _held(url, None):
            queued = pool.submit(_post, url, None)
            deadline = time.monotonic() + 10
            while "disagg_http_queued 1.0" not in httpx.get(url + "/metrics").text:
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.05)
            r = _post(url, None)  # one running, one queued: no room
            _is_openai_error(r, 503, "overloaded")
            assert r.headers["retry-after"] == "1"
            assert not queued.done()
        assert queued.result(timeout=60).status_code == 200
    metrics = httpx.get(url + "/metrics").text
    assert 'disagg_http_rejections_total{reason="overloaded"}' in metrics


def test_queue_wait_is_bounded_by_its_timeout(serve):
    url = serve(max_inflight=1, max_queued=4, queue_timeout_s=0.3)
    with _held(url, None):
        t0 = time.monotonic()
        r = _post(url, None)
        waited = time.monotonic() - t0
    _is_openai_error(r, 503, "overloaded")
    assert waited >= 0.3


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/v1/nothing", 404), ("GET", "/nowhere", 404),
                                                         ("GET", "/v1/completions", 405)])
def test_unknown_routes_and_methods_are_openai_errors(serve, method, path, status):
    url = serve()
    _is_openai_error(httpx.request(method, url + path), status)


@pytest.mark.parametrize("raw", [
    b'{"model": "disagg-tiny", "prompt": "x", "temperature": NaN}',
    b'{"model": "disagg-tiny", "prompt": "x", "top_p": Infinity}',
    b'{"model": "disagg-tiny", "prompt": [""]}',
    b'{"model": "disagg-tiny", "prompt": "x", "stop_token_ids": [' + b",".join([b"1"] * 300) + b"]}",
    b'{"model": "disagg-tiny", "prompt": [1, true]}',
    b'{"model": "disagg-tiny", "prompt": "x", "n": 17}',  # above http.max_n
    b'{"model": "disagg-tiny", "prompt": "x", "n": 2, "best_of": 3}',
    b'["not", "an", "object"]',
    b'"text"',
    b"",
])
def test_bad_completion_bodies_are_400(serve, raw):
    r = httpx.post(serve() + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    _is_openai_error(r, 400)


@pytest.mark.parametrize("content", [
    [{"type": "image_url", "image_url": {"url": "x"}}],
    [{"type": "text", "text": 7}],
    [{"type": "text"}],
    [7],
])
def test_unsupported_chat_content_is_400(serve, content):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    r = httpx.post(serve() + "/v1/chat/completions", json=body)
    _is_openai_error(r, 400)


def test_text_content_parts_are_served(serve):
    body = {"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "!"}]}]}
    r = httpx.post(serve() + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_openapi_documents_the_errors_returned(serve):
    schema = httpx.get(serve(api_keys=KEYS, openapi=True) + "/openapi.json", headers=_auth("key-a")).json()
    op = schema["paths"]["/v1/completions"]["post"]
    assert {"400", "401", "404", "413", "429", "503"} <= set(op["responses"]) and "422" not in op["responses"]
    assert op["security"] == [{"bearer": []}]
    assert json.dumps(schema).count("HTTPValidationError") == 0


def test_openapi_is_off_by_default_and_behind_the_key_when_on(serve):
    off = serve(api_keys=KEYS)
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(off + path, headers=_auth("key-a")).status_code == 404
    on = serve(api_keys=KEYS, openapi=True)
    _is_openai_error(httpx.get(on + "/openapi.json"), 401, "invalid_api_key")
    assert httpx.get(on + "/openapi.json", headers=_auth("key-a")).status_code == 200
    assert httpx.get(on + "/docs", headers=_auth("key-a")).status_code == 404  # its page loads a CDN's scripts


@pytest.mark.parametrize("second", ["Bearer key-a", "Bearer key-b", "Bearer wrong"])
def test_two_authorization_headers_are_400_whichever_would_match(serve, second):
    url = serve(api_keys=KEYS)
    headers = [("Authorization", "Bearer key-a"), ("Authorization", second)]
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
    _is_openai_error(r, 400, "duplicate_credentials")
    assert httpx.get(url + "/v1/models", headers=headers).status_code == 400


def test_a_body_that_trickles_in_gets_408_and_the_connection_closed(serve):
    """One byte every 0.3 s: never idle long, never done. The app's deadline counts from the
    request's arrival, however the bytes come (limits NOTE 5)."""
    import socket

    url = serve(body_timeout_s=1.5)
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    body = json.dumps({"model": MODEL, "prompt": "x" * 200, "max_tokens": 2}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
    t0 = time.monotonic()
    sent = 10
    reply = b""
    sock.settimeout(0.3)
    while sent < len(body) and time.monotonic() - t0 < 20:
        try:
            sock.sendall(body[sent:sent + 1])
            sent += 1
            reply += sock.recv(65536)
            if reply:
                break
        except TimeoutError:
            continue
        except OSError:
            break
    sock.settimeout(30)
    # The server closes after its 408. A byte that reached it after it stopped reading turns that
    # close into a reset: the 408 still reads, and the stream then ends in ECONNRESET, not EOF.
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b'"code":"request_timeout"' in reply.replace(b" ", b"")
    assert sent < len(body)  # refused before the body was complete
    assert httpx.get(url + "/health").status_code == 200


@pytest.mark.parametrize("field", ["user", "session_id", "cache_salt", "model", "stop"])
def test_free_text_fields_are_bounded(serve, field):
    from disagg.api.schemas import MAX_FIELD_CHARS

    url = serve()
    long = "u" * (MAX_FIELD_CHARS + 1)
    r = _post(url, None, **{field: [long] if field == "stop" else long})
    err = _is_openai_error(r, 400)
    assert err["param"].startswith(field), err
    ok = "u" * MAX_FIELD_CHARS
    if field != "model":
        assert _post(url, None, **{field: ok}).status_code == 200
