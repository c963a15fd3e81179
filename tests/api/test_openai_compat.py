"""OpenAI conventions the HTTP layer keeps: stop strings never streamed, nullable parameters,
``echo``, ``stream_options`` only with ``stream``, model retrieval, and a non-streamed request
whose client leaves is aborted.

The scripted backend (the engine side of the HTTP layer) makes the output text known; the HTTP
server, SSE framing and byte-level tokenizer are the real ones. The disconnect test runs the
tiny reference engine in process.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from disagg.api.app import _stop_prefix, create_app
from disagg.config import HTTPConfig
from tests.api.test_stream_text import OFFSET, Scripted
from tests.helpers import serve_asgi, tiny_aggregated_backend, tiny_backend


def _text(s: str) -> Scripted:
    return Scripted(list(s.encode()))


def _streamed(url: str, body: dict) -> tuple[list[str], str | None]:
    parts, finish = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    parts.append(c["text"])
                    finish = c["finish_reason"] or finish
    return parts, finish


@pytest.mark.parametrize("stop", [["\n\n"], ["\ncd", "zz"], ["b\n\nc"]])
def test_a_stop_string_split_across_tokens_is_never_streamed(stop):
    """Every stop string here arrives over several tokens; the text before it streams, the stop
    string does not, and the streamed pieces join to the non-streamed text."""
    body = {"model": "disagg-tiny", "prompt": "x", "max_tokens": 50, "stop": stop}
    with serve_asgi(create_app(_text("ab\n\ncd"))) as url:
        whole = httpx.post(url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
        parts, finish = _streamed(url, body)
    want = "ab\n\ncd"[: min(i for i in ("ab\n\ncd".find(s) for s in stop) if i >= 0)]
    assert whole["text"] == want and whole["finish_reason"] == "stop"
    assert "".join(parts) == want and finish == "stop", parts


def test_text_that_only_looks_like_a_stop_start_is_released():
    """A held suffix that turns out not to start a stop string is sent with the next piece, and
    at the end of the stream."""
    body = {"model": "disagg-tiny", "prompt": "x", "max_tokens": 50, "stop": ["ab!"]}
    with serve_asgi(create_app(_text("xabyab"))) as url:
        parts, finish = _streamed(url, body)
    assert "".join(parts) == "xabyab" and finish == "length"
    # held: the longest unsent end that begins a stop string
    assert _stop_prefix("xab", ["ab!"], 0, 3) == 2 and _stop_prefix("xa", ["ab!"], 0, 3) == 1
    assert _stop_prefix("xab", ["ab!"], 2, 3) == 0 and _stop_prefix("xa", ["zz"], 0, 2) == 0


@pytest.fixture(scope="module")
def url():
    with serve_asgi(create_app(_text("hello"))) as u:
        yield u


def _post(url: str, path: str = "/v1/completions", **fields) -> httpx.Response:
    body = {"model": "disagg-tiny", "max_tokens": 5}
    body |= {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(url + path, json=body | fields, timeout=30)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
                                   "max_tokens"])
def test_null_means_the_default(url, path, field):
    r = _post(url, path, **{field: None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_null_for_a_required_field_is_still_an_error(url):
    r = _post(url, prompt=None)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_echo_puts_the_prompt_before_the_completion(url):
    assert _post(url, echo=True).json()["choices"][0]["text"] == "hihello"
    ids = [ord(c) + OFFSET for c in "hey"]
    assert _post(url, prompt=ids, echo=True).json()["choices"][0]["text"] == "heyhello"
    parts, _ = _streamed(url, {"model": "disagg-tiny", "prompt": "hi", "max_tokens": 5, "echo": True})
    assert "".join(parts) == "hihello" and parts[0] == "hi"


def test_stream_options_need_stream(url):
    r = _post(url, stream_options={"include_usage": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text


def test_models_list_and_retrieve(url):
    card = httpx.get(url + "/v1/models").json()["data"][0]
    assert card["id"] == "disagg-tiny" and isinstance(card["created"], int)
    assert httpx.get(url + "/v1/models/disagg-tiny").json() == card
    r = httpx.get(url + "/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_non_streamed_request_whose_client_leaves_is_aborted():
    """The client gives up on a long non-streamed completion: the engine stops generating for it
    and the key's concurrency slot is free for the next request."""
    body = {"model": "disagg-tiny", "prompt": "hold", "max_tokens": 3000, "ignore_eos": True}
    with tiny_aggregated_backend() as backend, \
            serve_asgi(create_app(backend, HTTPConfig(max_concurrent_per_key=1))) as url:
        engine = backend.decode.engine.engine
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=1.0)
        deadline = time.monotonic() + 10
        while engine.stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.stats()["running"], "still generating for a client that left"
        r = httpx.post(url + "/v1/completions", json=body | {"max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text


def test_a_stop_token_as_the_only_token_finishes_with_stop_after_a_remote_prefill():
    """max_tokens=1 and the first token is a stop token: "stop", as the engine itself answers,
    also when the first token comes from the prefill worker (a prompt above the local limit)."""
    with tiny_backend("disaggregated") as backend, serve_asgi(create_app(backend, backend.config.http)) as url:
        body = {"model": "disagg-tiny", "prompt": list(range(10, 110)), "max_tokens": 1, "temperature": 0,
                "return_token_ids": True}
        first = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        assert first["finish_reason"] == "length"
        again = httpx.post(url + "/v1/completions", timeout=120, json=body | {
            "stop_token_ids": first["token_ids"], "cache_salt": "fresh"}).json()
        assert again["disagg"]["cached_source"] == "computed"  # prefilled again, remotely
        assert again["choices"][0]["finish_reason"] == "stop", again


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_lone_surrogate_in_the_prompt_is_a_400(url, path):
    """JSON can carry a lone surrogate ("\\ud800"); no UTF-8 tokenizer encodes it: a clear 400,
    not a 500."""
    field = "prompt" if path == "/v1/completions" else "messages"
    text = '"a\\ud800b"'
    value = text if field == "prompt" else f'[{{"role": "user", "content": {text}}}]'
    body = f'{{"model": "disagg-tiny", "max_tokens": 2, "{field}": {value}}}'
    r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "not valid Unicode" in r.json()["error"]["message"]


class _Recording(Scripted):
    """A scripted backend that keeps the ``GenerateParams`` of each request."""

    def __init__(self, byte_seq: list[int]):
        super().__init__(byte_seq)
        self.params = []

    async def stream(self, params):
        self.params.append(params)
        async for chunk in super().stream(params):
            yield chunk


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_session_end_needs_a_session_and_reaches_the_backend(path, body):
    """``session_end`` without ``session_id`` or ``user`` is a 400 naming it (it would end
    nothing); with either it reaches the backend on the request's params, and a request without
    it carries False. A non-boolean is a 400 too (strict types)."""
    backend = _Recording(list(b"ok"))
    body = body | {"model": "disagg-tiny", "max_tokens": 2}
    with serve_asgi(create_app(backend)) as url:
        r = httpx.post(url + path, json=body | {"session_end": True}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_end", r.text
        r = httpx.post(url + path, json=body | {"session_end": "yes", "session_id": "s"}, timeout=30)
        assert r.status_code == 400, r.text
        assert not backend.params
        for extra in ({"session_id": "s"}, {"user": "u"}):
            r = httpx.post(url + path, json=body | extra | {"session_end": True}, timeout=30)
            assert r.status_code == 200, r.text
        r = httpx.post(url + path, json=body | {"session_id": "s"}, timeout=30)
        assert r.status_code == 200, r.text
    assert [(p.session_id, p.session_end) for p in backend.params] == [("s", True), ("u", True), ("s", False)]
