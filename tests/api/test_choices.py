"""``n`` choices (``disagg.api.choices``): both endpoints, streamed and not, through real HTTP and
the OpenAI client, over the tiny reference engine in process, disaggregated (prompts above 64
tokens are prefilled remotely and their state published, as on the cluster).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading

import httpx
import openai
import pytest

from disagg.api.app import create_app
from disagg.messages import StreamChunk
from tests.api.test_stream_text import OFFSET, Scripted
from tests.helpers import serve_asgi, tiny_backend

MODEL = "disagg-tiny"
PROMPT = [(7 * i) % 250 + 5 for i in range(300)]  # 300 tokens: 4 full blocks of 64 and a tail
PATHS = ["/v1/completions", "/v1/chat/completions"]


@pytest.fixture(scope="module")
def url():
    with tiny_backend("disaggregated", http={"max_n": 8}) as backend, \
            serve_asgi(create_app(backend, backend.config.http)) as base:
        yield base


def _body(path: str, **extra) -> dict:
    body = {"model": MODEL, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True, **extra}
    if path == "/v1/completions":
        return {"prompt": PROMPT, **body}
    return {"messages": [{"role": "user", "content": "tell me about blocks and checkpoints"}], **body}


def _whole(url: str, path: str, **extra) -> dict:
    r = httpx.post(url + path, json=_body(path, **extra), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(url: str, path: str, **extra) -> tuple[dict[int, list[int]], dict[int, str], dict | None]:
    """Token ids and finish reasons by choice index, and the usage chunk."""
    tokens: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    usage = None
    body = _body(path, stream=True, stream_options={"include_usage": True}, **extra)
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            usage = obj.get("usage") or usage
            for c in obj["choices"]:
                tokens.setdefault(c["index"], []).extend(c.get("token_ids") or [])
                if c["finish_reason"]:
                    finish[c["index"]] = c["finish_reason"]
    return tokens, finish, usage


def _ids(body: dict) -> list[list[int]]:
    assert [c["index"] for c in body["choices"]] == list(range(len(body["choices"])))
    return [c["token_ids"] for c in body["choices"]]


@pytest.mark.parametrize("path", PATHS)
def test_greedy_choices_are_equal_and_usage_counts_the_prompt_once(url, path):
    one = _whole(url, path, temperature=0)
    three = _whole(url, path, temperature=0, n=3)
    assert _ids(three) == [one["choices"][0]["token_ids"]] * 3
    u = three["usage"]
    assert u["prompt_tokens"] == one["usage"]["prompt_tokens"] and u["completion_tokens"] == 3 * 8
    assert u["total_tokens"] == u["prompt_tokens"] + 24


@pytest.mark.parametrize("path", PATHS)
def test_streamed_choices_carry_their_index_and_equal_the_whole_response(url, path):
    whole = _whole(url, path, temperature=1.0, seed=11, n=3)
    tokens, finish, usage = _streamed(url, path, temperature=1.0, seed=11, n=3)
    assert [tokens[i] for i in range(3)] == _ids(whole)
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert usage["completion_tokens"] == 24 and usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]


def test_seeded_choices_are_reproducible_differ_and_follow_vllm_seeds(url):
    """Choice i of seed s samples as a single request with seed s + i (choices NOTE 2)."""
    path = "/v1/completions"
    a = _ids(_whole(url, path, temperature=2.0, seed=5, n=4, max_tokens=16))
    b = _ids(_whole(url, path, temperature=2.0, seed=5, n=4, max_tokens=16))
    assert a == b, "a seeded request is reproducible"
    assert len({tuple(x) for x in a}) > 1, "its choices are different sampling streams"
    singles = [_ids(_whole(url, path, temperature=2.0, seed=5 + i, max_tokens=16))[0] for i in range(4)]
    assert singles == a


def test_the_prompt_is_computed_once_and_reused_by_the_other_choices(url):
    """Choices 1.. resume from the prompt state choice 0's prefill published: the prompt's 4 full
    blocks (256 of 300 tokens) are cached for each of them."""
    body = _whole(url, "/v1/completions", temperature=0, n=4, prompt=[t + 1 for t in PROMPT])
    cached = [c["cached_tokens"] for c in body["disagg"]["choices"]]
    assert cached[0] == 0, "the first choice computed the prompt"
    assert cached[1:] == [256] * 3, cached


@pytest.mark.parametrize(("extra", "param"), [({"n": 9}, "n"), ({"n": 2, "best_of": 3}, "best_of"),
                                              ({"best_of": 2}, "best_of")])
def test_n_above_the_bound_and_best_of_above_n_are_400s(url, extra, param):
    r = httpx.post(url + "/v1/completions", json=_body("/v1/completions", **extra), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_best_of_equal_to_n_is_n(url):
    body = _whole(url, "/v1/completions", temperature=0, n=2, best_of=2)
    assert len(body["choices"]) == 2


def test_the_openai_client_gets_n_choices_streamed_or_not(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    r = client.completions.create(model=MODEL, prompt="Hello, disaggregated world", max_tokens=6, temperature=0.9,
                                  seed=3, n=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 18
    parts = client.completions.create(model=MODEL, prompt="Hello, disaggregated world", max_tokens=6,
                                      temperature=0.9, seed=3, n=3, stream=True, extra_body={"ignore_eos": True})
    text: dict[int, str] = {}
    for chunk in parts:
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + c.text
    assert [text[i] for i in range(3)] == [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    msgs = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0, n=2,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content
    assert chat.usage.completion_tokens == 10


class _Held(Scripted):
    """A backend whose generations each send one token and then wait until ``release`` is set
    (a scripted engine: the admission gate is what is observed)."""

    def __init__(self):
        super().__init__([ord("x")])
        self.release = threading.Event()

    async def stream(self, params):
        yield StreamChunk([ord("x") + OFFSET], False, None, len(params.prompt_token_ids))
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        yield StreamChunk([ord("y") + OFFSET], True, "length", len(params.prompt_token_ids))


def test_each_choice_holds_a_running_slot_at_the_gate():
    backend = _Held()
    with serve_asgi(create_app(backend)) as base:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 4, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # in flight now
            during = httpx.get(base + "/metrics", timeout=30).text
            backend.release.set()
            assert "data: [DONE]" in list(lines)
        after = httpx.get(base + "/metrics", timeout=30).text
    running = [float(re.search(r"^disagg_http_running (\S+)$", m, re.M).group(1)) for m in (during, after)]
    assert running == [4.0, 0.0]
