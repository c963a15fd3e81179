"""Tenants never share cached state: the second tenant sending the same prompt gets no cached tokens.

In process, over real HTTP, through both reuse paths: the device tier (resident sessions) and
the host tier (resident sessions off, so every reuse is a load from the host tier).
"""

from __future__ import annotations

import random

import httpx
import pytest
import torch

from disagg.api.app import create_app
from disagg.config import load_config
from disagg.launch.inprocess import InProcessBackend
from tests.helpers import serve_asgi

MODEL = "disagg-tiny"


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 260) for _ in range(n)]


@pytest.fixture(scope="module", params=[True, False], ids=["device-tier", "host-tier"])
def url(request):
    threads = torch.get_num_threads()
    cfg = load_config({"model": {"name": "tiny"},
                       "engine": {"cache_budget_mb": 64, "max_num_batched_tokens": 512, "num_threads": 1,
                                  "resident_sessions": request.param},
                       "transfer": {"host": {"capacity_mb": 256, "pin_memory": False}},  # room: no evictions
                       "router": {"local_prefill_max_tokens": 64}, "deployment": {"mode": "disaggregated"},
                       "http": {"api_keys": ["key-a", "key-b"]}})
    backend = InProcessBackend(cfg)
    with serve_asgi(create_app(backend, cfg.http)) as base:
        yield base
    backend.shutdown()
    torch.set_num_threads(threads)


def _cached(url: str, key: str, prompt: list[int], **extra) -> tuple[int, str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["usage"]["prompt_tokens_details"]["cached_tokens"], out["disagg"]["cached_source"]


def test_second_tenant_gets_no_cached_tokens(url):
    """Tenant a's first turn leaves state at its prompt's end; the same next prompt from tenant b
    (a's prompt plus new tokens, where a would resume) must compute everything."""
    first, follow = _ids(300, 11), _ids(40, 21)
    assert _cached(url, "key-a", first) == (0, "computed")
    assert _cached(url, "key-b", first + follow) == (0, "computed"), "tenant b must not hit tenant a's state"
    assert _cached(url, "key-a", first + follow)[0] >= 256, "the same prompt from tenant a resumes (the cache works)"


def test_an_explicit_cache_salt_only_partitions_within_a_tenant(url):
    first, follow = _ids(300, 12), _ids(40, 22)
    assert _cached(url, "key-a", first, cache_salt="team")[0] == 0
    assert _cached(url, "key-b", first + follow, cache_salt="team")[0] == 0, "the same salt from another key"
    assert _cached(url, "key-a", first + follow, cache_salt="other")[0] == 0, "another salt of the same tenant"
    assert _cached(url, "key-a", first + follow, cache_salt="team")[0] >= 256
