"""Every OpenAI parameter is served or refused with a 400 naming it (``disagg.api.schemas``
UNSERVED), and log probabilities are served in both endpoints' shapes, streamed or not, also
for a first token sampled by a prefill worker. Real HTTP over the tiny reference engine in
process, disaggregated (prompts above 64 tokens are prefilled remotely).
"""

from __future__ import annotations

import json

import httpx
import pytest

from disagg.api.app import create_app
from tests.helpers import serve_asgi, tiny_backend

MODEL = "disagg-tiny"
PROMPT_IDS = list(range(10, 110))  # 100 tokens: above the local prefill limit


@pytest.fixture(scope="module")
def url():
    with tiny_backend("disaggregated") as backend, serve_asgi(create_app(backend, backend.config.http)) as base:
        yield base


def _body(path: str, **extra) -> dict:
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, **extra}
    if path == "/v1/completions":
        return {"prompt": "hello", **body}
    return {"messages": [{"role": "user", "content": "hello"}], **body}


BOTH = ["/v1/completions", "/v1/chat/completions"]
REFUSED = [  # (endpoints, parameter, a value asking for something not served)
    (BOTH, "presence_penalty", 0.5),
    (BOTH, "frequency_penalty", -1.0),
    (BOTH, "logit_bias", {"50": 10}),
    (["/v1/completions"], "best_of", 3),  # beside n = 1: more samples than answers
    (["/v1/completions"], "suffix", "tail"),
    (["/v1/chat/completions"], "response_format", {"type": "json_object"}),
    (["/v1/chat/completions"], "response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
    (["/v1/chat/completions"], "tools", [{"type": "function", "function": {"name": "f"}}]),
    (["/v1/chat/completions"], "tool_choice", "required"),
    (["/v1/chat/completions"], "parallel_tool_calls", True),
    (["/v1/chat/completions"], "functions", [{"name": "f"}]),
    (["/v1/chat/completions"], "function_call", "auto"),
    (["/v1/chat/completions"], "audio", {"voice": "alloy", "format": "wav"}),
    (["/v1/chat/completions"], "modalities", ["text", "audio"]),
    (["/v1/chat/completions"], "prediction", {"type": "content", "content": "x"}),
    (["/v1/chat/completions"], "reasoning_effort", "high"),
    (["/v1/chat/completions"], "web_search_options", {}),
]
NO_OPS = [  # values that ask for nothing: accepted
    (BOTH, "n", 1), (BOTH, "n", 2), (BOTH, "presence_penalty", 0), (BOTH, "frequency_penalty", 0.0), (BOTH, "logit_bias", {}),
    (["/v1/completions"], "best_of", 1), (["/v1/completions"], "suffix", ""),
    (["/v1/chat/completions"], "response_format", {"type": "text"}), (["/v1/chat/completions"], "tools", []),
    (["/v1/chat/completions"], "tool_choice", "none"), (["/v1/chat/completions"], "modalities", ["text"]),
]


def _cases(table):
    return [pytest.param(path, name, value, id=f"{path.rsplit('/', 1)[1]}-{name}-{json.dumps(value)}")
            for paths, name, value in table for path in paths]


@pytest.mark.parametrize(("path", "name", "value"), _cases(REFUSED))
def test_an_unserved_parameter_is_a_400_naming_it(url, path, name, value):
    r = httpx.post(url + path, json=_body(path, **{name: value}), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == name and name in err["message"] and err["code"] == "unsupported_parameter"


@pytest.mark.parametrize(("path", "name", "value"), _cases(NO_OPS))
def test_a_no_op_value_is_accepted(url, path, name, value):
    r = httpx.post(url + path, json=_body(path, **{name: value}), timeout=60)
    assert r.status_code == 200, r.text


def test_top_logprobs_without_logprobs_is_a_400(url):
    r = httpx.post(url + "/v1/chat/completions", json=_body("/v1/chat/completions", top_logprobs=2), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


@pytest.mark.parametrize("bad", [6, -1, True, "2"])
def test_completion_logprobs_out_of_range_is_a_400(url, bad):
    r = httpx.post(url + "/v1/completions", json=_body("/v1/completions", logprobs=bad), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("logprobs")


def _stream(url: str, path: str, body: dict) -> list[dict]:
    choices = []
    with httpx.stream("POST", url + path, json=body | {"stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices += json.loads(line[6:])["choices"]
    return choices


def _merge_completion(parts: list[dict | None]) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for key in out:
            out[key] += p[key] if p else []
    return out


@pytest.mark.parametrize("prompt", ["hello", PROMPT_IDS], ids=["local-prefill", "remote-prefill"])
def test_completion_logprobs_streamed_and_not(url, prompt):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 3, "return_token_ids": True}
    whole = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    lp = whole["logprobs"]
    ids = whole["token_ids"]
    assert len(ids) == 6 and len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    for top, chosen in zip(lp["top_logprobs"], lp["token_logprobs"], strict=True):
        assert 1 <= len(top) <= 3  # three alternatives (tokens that decode alike share a key)
        assert chosen == pytest.approx(max(top.values()))  # greedy: the chosen token is the likeliest
        assert all(v <= 0 for v in top.values())
    assert lp["text_offset"][0] == 0
    offsets = lp["text_offset"]
    assert all(b - a == len(t) for a, b, t in zip(offsets[:-1], offsets[1:], lp["tokens"][:-1], strict=True))
    streamed = _stream(url, "/v1/completions", body)
    assert _merge_completion([c["logprobs"] for c in streamed]) == lp


@pytest.mark.parametrize("prompt", [[{"role": "user", "content": "hello"}],
                                    [{"role": "user", "content": "x" * 120}]], ids=["local-prefill", "remote-prefill"])
def test_chat_logprobs_streamed_and_not(url, prompt):
    body = {"model": MODEL, "messages": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2}
    whole = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    content = whole["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["logprob"] == entry["logprob"]
    streamed = _stream(url, "/v1/chat/completions", body)
    merged = [e for c in streamed if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert merged == content
    plain = httpx.post(url + "/v1/chat/completions", json=body | {"logprobs": False, "top_logprobs": None},
                       timeout=120).json()["choices"][0]
    assert plain["message"] == whole["message"] and "logprobs" not in plain  # asking changes no token
