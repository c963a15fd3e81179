"""The Serve application on a real local Ray cluster, through real HTTP."""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from disagg.config import load_config
from tests.helpers import free_port

pytestmark = pytest.mark.ray
CONFIGS = sorted((Path(__file__).parents[2] / "deployments" / "configs").glob("*.yaml"))
MODEL = "disagg-tiny"


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster():
    from ray import serve

    from deployments.app import build_app
    from disagg.launch.local import local_app, wait_healthy

    cfg = load_config(CONFIGS[[p.name for p in CONFIGS].index("local-cpu.yaml")])
    cfg.http.port = free_port()
    cfg.router.local_prefill_max_tokens = 64
    agg = cfg.model_copy(deep=True)
    agg.deployment.mode = "aggregated"
    with local_app(cfg) as url:
        serve.run(build_app(agg), name="agg", route_prefix="/agg", blocking=False)
        wait_healthy(url)
        wait_healthy(url + "/agg")
        yield {"url": url, "agg": url + "/agg"}



def _complete(base: str, prompt: list[int], session: str, n: int = 10) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "session_id": session, "return_token_ids": True}
    r = httpx.post(base + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _sources(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=30).text
    return {m[1]: float(m[2]) for m in re.finditer(r'disagg_prompt_tokens_total\{source="(\w+)"\} (\S+)', text)}


def test_openai_client_stream_and_not(cluster):
    client = openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="none", timeout=300)
    whole = client.completions.create(model=MODEL, prompt="Ray Serve", max_tokens=6, temperature=0)
    parts = list(client.completions.create(model=MODEL, prompt="Ray Serve", max_tokens=6, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
    assert parts[-1].usage.completion_tokens == whole.usage.completion_tokens
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].message.role == "assistant"


def test_multi_turn_disaggregated_equals_aggregated_and_resumes_state(cluster):
    before = _sources(cluster["url"])
    prompts = {"url": _ids(400, 1), "agg": _ids(400, 1)}
    for turn in range(3):
        out = {k: _complete(cluster[k], prompts[k], "sess-a") for k in prompts}
        assert out["url"]["choices"][0]["token_ids"] == out["agg"]["choices"][0]["token_ids"], f"turn {turn}"
        if turn:
            cached = out["url"]["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= len(prompts["url"]) - 200, "turn 2+ must resume the conversation's state"
        for k in prompts:
            prompts[k] = prompts[k] + out[k]["choices"][0]["token_ids"] + _ids(120, 50 + turn)
    after = _sources(cluster["url"])
    reused = sum(after.get(s, 0) - before.get(s, 0) for s in ("device", "host", "disk", "peer"))
    assert reused > 0
    assert after.get("host", 0) > before.get("host", 0), "the prefill replica resumed from the host tier"


def test_delete_session_reaches_every_decode_replica(cluster):
    """DELETE /v1/sessions/{id} through Serve (``disagg.flow`` NOTE 14): the ingress tells each decode
    replica its router knows, each demotes what its ledger saw of the session; the decode replica
    that served it holds its blocks, so some are demoted; an unknown session demotes nothing."""
    prompt = _ids(400, 61)
    first = _complete(cluster["url"], prompt, "sess-del")
    _complete(cluster["url"], prompt + first["choices"][0]["token_ids"] + _ids(100, 62), "sess-del")
    r = httpx.delete(cluster["url"] + "/v1/sessions/sess-del", timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["ended"] is True and r.json()["demoted_objects"] > 0
    r = httpx.delete(cluster["url"] + "/v1/sessions/sess-never", timeout=120)
    assert r.status_code == 200 and r.json()["demoted_objects"] == 0


def test_concurrent_sessions_match_sequential_results(cluster):
    prompts = [_ids(150 + 40 * i, 200 + i) for i in range(4)]
    sequential = [_complete(cluster["agg"], p, f"seq{i}")["choices"][0]["token_ids"] for i, p in enumerate(prompts)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda ip: _complete(cluster["url"], ip[1], f"conc{ip[0]}"), enumerate(prompts)))
    assert [r["choices"][0]["token_ids"] for r in results] == sequential


def test_client_disconnect_cancels_and_frees(cluster):
    body = {"model": MODEL, "prompt": _ids(100, 9), "max_tokens": 3000, "ignore_eos": True, "stream": True,
            "session_id": "gone"}
    with httpx.stream("POST", cluster["url"] + "/v1/completions", json=body, timeout=120) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n >= 3:
                break
    deadline = time.monotonic() + 30
    running = None
    while time.monotonic() < deadline:
        text = httpx.get(cluster["url"] + "/metrics", timeout=30).text
        m = re.search(r'disagg_engine_requests\{role="decode",state="running"\} (\S+)', text)
        running = float(m.group(1)) if m else None
        if running == 0:
            break
        time.sleep(0.5)
    assert running == 0, "the abandoned request is still running"


def test_first_token_stamps_line_up_along_the_path(cluster):
    """The stamps serve_bench's hop table is built from: every hop present and in path order."""
    from ray import serve

    body = {"model": MODEL, "prompt": _ids(80, 11), "max_tokens": 4, "ignore_eos": True, "stream": True}
    t_send = time.perf_counter()
    with httpx.stream("POST", cluster["agg"] + "/v1/completions", json=body, timeout=300) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    t_recv = time.perf_counter()
    rid = events[0]["id"]
    stamps = {}
    for deployment in ("Ingress", "DecodeServer"):
        found = serve.get_deployment_handle(deployment, app_name="agg").timings.remote([rid]).result()
        stamps.update(found[rid])
    order = ["http_in", "handler", "call", "entry", "admit", "step_start", "step_end", "first_out", "first_yield",
             "chunk_in", "body_out"]
    times = [t_send, *(stamps[k] for k in order), t_recv]
    assert times == sorted(times), dict(zip(order, times[1:-1], strict=True))
    assert 0 < stamps["step_cpu"] <= stamps["step_end"] - stamps["step_start"] + 0.01  # CPU within the wall


def test_haproxy_stats_page_listens_on_loopback_only(cluster):
    import os

    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        pytest.skip("Serve's Python proxy is the HTTP front here (no HAProxy binary)")
    port = int(os.environ["RAY_SERVE_HAPROXY_STATS_PORT"])
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in list(f)[1:]:
                local, state = row.split()[1], row.split()[3]
                addr, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # LISTEN
                    listening.add(addr)
    assert listening == {"0100007F"}, listening  # 127.0.0.1 and nothing else (no 0.0.0.0, no ::)
    assert httpx.get(f"http://127.0.0.1:{port}/stats", timeout=10).status_code == 200


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_serve_configs_parse_and_build(path):
    from deployments.app import build_app

    cfg = load_config(path)
    app = build_app(cfg)
    assert app is not None
    if cfg.engine.backend == "reference":  # vLLM presets serve under their model's own name
        assert cfg.model.openai_name.startswith("disagg-")
