"""The OpenAI HTTP surface over real HTTP, with in-process prefill/decode workers (no Ray)."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest

from disagg.config import load_config
from disagg.launch.inprocess import InProcessBackend
from tests.helpers import serve_asgi

MODEL = "disagg-tiny"


def _cfg(mode: str, **http):
    return load_config({
        "model": {"name": "tiny"},
        "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 512},
        "transfer": {"host": {"capacity_mb": 64, "pin_memory": False}},
        "router": {"local_prefill_max_tokens": 64},
        "deployment": {"mode": mode},
        "http": http,
    })


@pytest.fixture(scope="module")
def servers():
    from disagg.api.app import create_app

    backends = {m: InProcessBackend(_cfg(m)) for m in ("disaggregated", "aggregated")}
    with serve_asgi(create_app(backends["disaggregated"], backends["disaggregated"].config.http)) as d_url, \
            serve_asgi(create_app(backends["aggregated"], backends["aggregated"].config.http)) as a_url:
        yield {"disaggregated": d_url, "aggregated": a_url, "backends": backends}
    for b in backends.values():
        b.shutdown()


def _ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


def test_openai_client_completion_and_stream(servers):
    client = openai.OpenAI(base_url=servers["disaggregated"] + "/v1", api_key="none")
    r = client.completions.create(model=MODEL, prompt="Hello, disaggregated world", max_tokens=8, temperature=0)
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt="Hello, disaggregated world", max_tokens=8,
                                       temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_completions_stream(servers):
    client = openai.OpenAI(base_url=servers["aggregated"] + "/v1", api_key="none")
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    parts = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == full.choices[0].message.content
    assert [m.id for m in client.models.list().data] == [MODEL]


def _complete(url: str, prompt: list[int], session: str, n: int = 12) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "session_id": session, "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_disaggregated_equals_aggregated_over_multi_turn_sessions(servers):
    for s in range(2):
        prompts = {m: _ids(300, s) for m in ("disaggregated", "aggregated")}
        for turn in range(3):
            out = {m: _complete(servers[m], prompts[m], f"s{s}") for m in prompts}
            d, a = out["disaggregated"], out["aggregated"]
            assert d["choices"][0]["token_ids"] == a["choices"][0]["token_ids"], f"session {s} turn {turn}"
            if turn > 0:  # the conversation so far was computed before: its state is reused
                assert d["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompts["disaggregated"]) - 200
            new = _ids(150, 100 * s + turn)
            for m in prompts:
                prompts[m] = prompts[m] + out[m]["choices"][0]["token_ids"] + new
    decode = servers["backends"]["disaggregated"].decode
    assert decode.counters["remote_prefills"] >= 2  # the long first turns went to the prefill worker
    assert decode.counters["load_failures"] == 0


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"model": "nope", "prompt": "x"}, 404, "model_not_found"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, None),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, None),
    ({"model": MODEL, "prompt": [1, 2, 99999]}, 400, None),
    ({"model": MODEL, "prompt": []}, 400, None),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**7}, 400, "context_length_exceeded"),
    ({"model": MODEL}, 400, None),
])
def test_bad_requests_get_openai_errors(servers, body, status, code):
    r = httpx.post(servers["disaggregated"] + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code:
        assert err["code"] == code


def test_oversize_and_malformed_bodies(servers):
    url = servers["disaggregated"] + "/v1/completions"
    r = httpx.post(url, content=b"{" + b" " * (5 << 20) + b"}", headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_metrics_report_sources_and_tiers(servers):
    text = httpx.get(servers["disaggregated"] + "/metrics").text
    assert "disagg_ttft_seconds_bucket" in text
    sources = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("disagg_prompt_tokens_total{")}
    assert sources["computed"] > 0
    assert sources["device"] + sources["host"] > 0  # later turns reused state
    assert 'disagg_tier_used_bytes{tier="host"}' in text


def test_stream_error_shape_and_done_marker(servers):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", servers["aggregated"] + "/v1/completions", json=body) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(json.loads(ln[6:])["object"] == "text_completion" for ln in lines[:-1])


def test_delete_session_ends_it_over_http(servers):
    """DELETE /v1/sessions/{id} (``disagg.flow`` NOTE 14) over real HTTP and a real worker: after two
    turns of a session, its private state is demoted on the decode worker's node (the answer counts
    the objects) and a later turn of it is still served and resumes (from the device here: that
    demoted objects stay readable is tests/reuse/test_session_end.py's); an unknown session
    demotes nothing; an oversize or empty id is a 400."""
    url = servers["aggregated"]
    backend = servers["backends"]["aggregated"]
    prompt = _ids(400, 7)
    first = _complete(url, prompt, "del-1")
    prompt2 = prompt + first["choices"][0]["token_ids"] + _ids(80, 8)
    _complete(url, prompt2, "del-1")
    r = httpx.delete(url + "/v1/sessions/del-1", timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == "del-1" and body["object"] == "session" and body["ended"] is True
    assert body["demoted_objects"] >= 400 // backend.block_size
    assert backend.decode.counters["sessions_ended_later"] == 1
    r = httpx.delete(url + "/v1/sessions/never-seen", timeout=60)
    assert r.status_code == 200 and r.json()["demoted_objects"] == 0
    again = _complete(url, prompt2 + _ids(8, 9), "del-1")  # a client that ends a session may still send
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for bad in ("x" * 300, ""):
        r = httpx.delete(url + "/v1/sessions/" + bad, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", (bad[:5], r.text)


def test_delete_session_without_session_state_is_a_501():
    """A backend that keeps no session state (no ``end_session``) answers 501, OpenAI-style."""
    from disagg.api.app import create_app

    class NoSessions:
        model_name, max_model_len, tokenizer = MODEL, 64, None

        async def stats(self):
            return {}

    with serve_asgi(create_app(NoSessions())) as url:
        r = httpx.delete(url + "/v1/sessions/s1", timeout=30)
    assert r.status_code == 501 and r.json()["error"]["code"] == "not_implemented"
