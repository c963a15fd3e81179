"""Every fault injected on a real local Ray cluster; each request's output equals the
uninterrupted run (the reference engine with the replicas' seeded weights, in this process).

One cluster for the module: 2 prefill + 2 decode replicas, API keys, a small host tier, and
fault rules that each target one session prefix, so each test picks its fault by its session id:

    kill-decode*   the decode replica exits after 3 streamed tokens (first such request per replica)
    kill-prefill*  the prefill replica exits on its first such request
    drop* / delay* / corrupt*   every state load of the session fails / stalls 60 s / reads a flipped byte

The fault ledger (one JSON line per fault and per recovery, written by the replicas) shows that
each fault really happened and how it was survived.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import time

import httpx
import pytest
import torch

from disagg.config import load_config
from disagg.engine.factory import build_reference_engine
from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.faults import read_ledger
from disagg.launch.local import APP_NAME, free_port, wait_healthy

pytestmark = pytest.mark.ray
MODEL = "disagg-tiny"
KEY = {"Authorization": "Bearer key-a"}
RULES = [
    {"fault": "kill_decode", "nth": 1, "session_prefix": "kill-decode", "after_tokens": 3},
    {"fault": "kill_prefill", "nth": 1, "session_prefix": "kill-prefill"},
    {"fault": "drop", "rate": 1.0, "session_prefix": "drop"},
    {"fault": "delay", "rate": 1.0, "session_prefix": "delay", "delay_s": 60.0},
    {"fault": "corrupt", "rate": 1.0, "session_prefix": "corrupt"},
]
HOST_MB = 16


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 260) for _ in range(n)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from disagg.launch.local import local_app

    ledger = str(tmp_path_factory.mktemp("faults") / "ledger.jsonl")
    cfg = load_config("deployments/configs/local-cpu.yaml")
    cfg.http.port = free_port()
    cfg.http.api_keys = ["key-a", "key-b"]
    for role in (cfg.deployment.prefill, cfg.deployment.decode):
        role.num_replicas, role.num_cpus = 2, 0.5
    cfg.router.local_prefill_max_tokens = 64
    cfg.router.stats_period_s = 0.5
    cfg.transfer.host.capacity_mb = HOST_MB
    cfg.transfer.load_deadline_s = 2.0
    cfg.deployment.graceful_shutdown_timeout_s = 120.0  # longer than the drained stream below
    cfg.faults = cfg.faults.model_validate({"enabled": True, "rules": RULES, "ledger_path": ledger})
    threads = torch.get_num_threads()
    reference = build_reference_engine(cfg)  # same seeded weights as the replicas
    with local_app(cfg) as url:
        wait_healthy(url)
        yield {"url": url, "ledger": ledger, "reference": reference, "cfg": cfg}
    torch.set_num_threads(threads)


def _want(cluster, prompt: list[int], n: int) -> list[int]:
    tokens, _ = cluster["reference"].generate(EngineRequest(f"ref-{random.random()}", prompt,
                                                            SamplingParams(max_tokens=n, ignore_eos=True)))
    return tokens


def _complete(url: str, prompt: list[int], session: str, n: int = 8, headers=KEY) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "session_id": session, "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, prompt: list[int], session: str, n: int, on_first=None) -> list[int]:
    """Token ids of a streamed completion, in the order the client received them."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "session_id": session, "return_token_ids": True, "stream": True}
    tokens: list[int] = []
    last = None
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=KEY, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():  # as they arrive: ``on_first`` runs while the stream is open
            if not line.startswith("data: "):
                continue
            last = line[6:]
            if last == "[DONE]":
                break
            obj = json.loads(last)
            assert "error" not in obj, obj
            for choice in obj["choices"]:
                tokens.extend(choice.get("token_ids") or [])
                if on_first is not None and tokens:
                    on_first()
                    on_first = None
    assert last == "[DONE]"
    return tokens


def _events(cluster, session: str) -> list[dict]:
    return [e for e in read_ledger(cluster["ledger"]) if (e.get("session_id") or "").startswith(session)]


def _metric(url: str, pattern: str) -> float:
    m = re.search(r"^" + pattern + r" (\S+)$", httpx.get(url + "/metrics", timeout=30).text, re.M)
    return float(m.group(1)) if m else 0.0


def test_decode_replica_dying_mid_stream_continues_on_another(cluster):
    prompt = _ids(300, 41)
    got = _stream(cluster["url"], prompt, "kill-decode-1", 16)
    assert got == _want(cluster, prompt, 16), "no token lost, repeated or changed across the replica's death"
    kills = [e for e in _events(cluster, "kill-decode-1") if e.get("fault") == "kill_decode"]
    assert len(kills) == 1 and kills[0]["after_tokens"] >= 3, "the replica died after streaming tokens"
    assert _metric(cluster["url"], "disagg_resumed_streams") >= 1


def test_prefill_replica_dying_is_retried_on_another(cluster):
    prompt = _ids(300, 42)
    out = _complete(cluster["url"], prompt, "kill-prefill-1")
    assert out["choices"][0]["token_ids"] == _want(cluster, prompt, 8)
    events = _events(cluster, "kill-prefill-1")
    kill = [e for e in events if e.get("fault") == "kill_prefill"]
    retried = [e for e in events if e.get("recovery") == "prefill_retried"]
    assert len(kill) == 1 and len(retried) == 1, events
    assert retried[0]["prefill_replica"] != kill[0]["replica"], "the retry ran on another prefill replica"


@pytest.mark.parametrize("fault", ["drop", "delay", "corrupt"])
def test_faulty_state_transfer_recomputes(cluster, fault):
    prompt = _ids(300, 43 + len(fault))
    checksum_before = _metric(cluster["url"], "disagg_checksum_failures")
    t0 = time.monotonic()
    out = _complete(cluster["url"], prompt, f"{fault}-1")
    elapsed = time.monotonic() - t0
    assert out["choices"][0]["token_ids"] == _want(cluster, prompt, 8)
    events = _events(cluster, f"{fault}-1")
    assert any(e.get("fault") == fault for e in events), events
    assert any(e.get("recovery") == "load_recomputed" and e["after"] == fault for e in events), events
    if fault == "delay":
        assert elapsed < 60, "the 2 s load deadline cut the 60 s stall short"
    if fault == "corrupt":
        # the replica that caught it reports the count in its stats, which /metrics asks of every replica
        deadline = time.monotonic() + 60
        while _metric(cluster["url"], "disagg_checksum_failures") <= checksum_before:
            assert time.monotonic() < deadline, "no replica reported the checksum failure"
            time.sleep(0.5)


def test_tenants_do_not_share_state_on_the_cluster(cluster):
    """Tenant a resumes its own state, and tenant b, sending the same tokens under the same session
    id right after, resumes none of it. a's follow-up comes first: the host tier here is 16 MB of
    4 MB slabs, so a's checkpoints can be evicted by the next publishes (b's); next to b's request,
    a's hit shows that what b did not get was there to get."""
    url = cluster["url"]
    first, follow = _ids(300, 51), _ids(40, 52)
    assert _complete(url, first, "tenant-1")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    mine = _complete(url, first + follow, "tenant-1")
    assert mine["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256, ("tenant a resumes its own state",
                                                                            mine.get("disagg"))
    other = _complete(url, first + follow, "tenant-1", headers={"Authorization": "Bearer key-b"})
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "tenant b must not hit tenant a's state"
    assert other["choices"][0]["token_ids"] == mine["choices"][0]["token_ids"], "same tokens, same output"
    for headers in ({}, {"Authorization": "Bearer key-c"}, {"Authorization": "key-a"}):
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_full_host_tier_evicts_and_stays_within_capacity(cluster):
    url = cluster["url"]
    prompts = {f"fill-{i}": _ids(320, 60 + i) for i in range(6)}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        outs = dict(zip(prompts, pool.map(lambda s: _complete(url, prompts[s], s), prompts), strict=True))
    for s, out in outs.items():
        assert out["choices"][0]["token_ids"] == _want(cluster, prompts[s], 8), s
    text = httpx.get(url + "/metrics", timeout=30).text
    used = float(re.search(r'disagg_tier_used_bytes\{tier="host"\} (\S+)', text).group(1))
    capacity = float(re.search(r'disagg_tier_capacity_bytes\{tier="host"\} (\S+)', text).group(1))
    evictions = float(re.search(r'disagg_tier_evictions\{tier="host"\} (\S+)', text).group(1))
    assert capacity == HOST_MB << 20 and 0 < used <= capacity
    assert evictions > 0, "the tier filled up and evicted instead of growing"


def test_shutdown_drains_streams_in_flight(cluster):
    """Deleting the application mid-stream lets the stream run to its end and its turn-end state
    reach the host tier before the decode replica exits (graceful drain); runs last.

    The delete starts at the stream's first token (``_stream`` reads events as they arrive) and
    ``serve.delete`` returns only once every replica has exited. The host tier is emptied first:
    the fill test left this module's 16 MiB tier (four 4 MiB slabs) full, and there a put can be
    refused or a fresh piece lose its slab (backpressure and eviction, not a lost publish).
    """
    import ray
    from ray import serve

    from deployments.node_store import connect_node_store, node_store_actor
    from disagg.api.limits import tenant_salt
    from kv_transfer.keys import BlockHasher, KeyExtras

    node_id = ray.get_runtime_context().get_node_id()
    ray.get(node_store_actor(cluster["cfg"], node_id).clear.remote(), timeout=60)
    prompt, n = _ids(120, 71), 160
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        deleting = []
        got = _stream(cluster["url"], prompt, "drain-1", n,
                      on_first=lambda: deleting.append(pool.submit(serve.delete, APP_NAME)))
        assert deleting, "the stream produced no token"
        deleting[0].result(timeout=300)
    assert got == _want(cluster, prompt, n), "the stream ran to its end while the app shut down"
    ref = cluster["reference"]
    store = connect_node_store(cluster["cfg"], node_id, ref.layout)
    hasher = BlockHasher(ref.block_size, KeyExtras(ref.model_id)).with_salt(tenant_salt("key-a"))
    tokens = prompt + got
    end = len(tokens) - 1  # the last sampled token is never computed
    point = store.resumable_length(tokens, hasher, end)
    assert point.position == end, "the turn end was published before the decode replica exited"
