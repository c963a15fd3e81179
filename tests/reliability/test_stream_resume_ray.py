"""Every decode replica killed mid-stream, three times over, on a real local Ray cluster: each
time the stream waits until Serve has started a new replica and it completes token-exact
(``disagg.stream_resume``).

Before, the ingress gave up after ``max_stream_resumes`` (2) replica calls had failed, however
they failed: a stream that lost its replicas three times ended with a 503 error event after a
short answer (the soak's bursts with replica kills lost 77 and 562 tokens so), and so did one
whose continuation calls were sent to replicas already dead.
"""

from __future__ import annotations

import json
import random
import re

import httpx
import pytest
import ray
import torch

from disagg.config import load_config
from disagg.engine.factory import build_reference_engine
from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.launch.local import APP_NAME, free_port, wait_healthy

pytestmark = pytest.mark.ray
MODEL = "disagg-tiny"


@pytest.fixture(scope="module")
def cluster():
    from disagg.launch.local import local_app

    cfg = load_config("deployments/configs/local-cpu.yaml")
    cfg.http.port = free_port()
    cfg.deployment.decode.num_replicas, cfg.deployment.decode.num_cpus = 2, 0.4
    cfg.deployment.stream_resume_timeout_s = 240.0  # a new replica starts in seconds to a minute here
    threads = torch.get_num_threads()
    reference = build_reference_engine(cfg)  # same seeded weights as the replicas
    with local_app(cfg) as url:
        wait_healthy(url)
        yield {"url": url, "reference": reference}
    torch.set_num_threads(threads)


def _decode_replicas() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#DecodeServer#")}


def _stream(url: str, prompt: list[int], n: int, on_tokens) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    tokens: list[int] = []
    last = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():  # as they arrive: ``on_tokens`` runs while the stream is open
            if not line.startswith("data: "):
                continue
            last = line[6:]
            if last == "[DONE]":
                break
            obj = json.loads(last)
            assert "error" not in obj, obj
            for choice in obj["choices"]:
                tokens.extend(choice.get("token_ids") or [])
            if tokens:
                on_tokens()
    assert last == "[DONE]"
    return tokens


def _metric(url: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", httpx.get(url + "/metrics", timeout=60).text, re.M)
    return float(m.group(1)) if m else 0.0


def test_every_decode_replica_killed_three_times_mid_stream_the_stream_completes_exactly(cluster):
    rng = random.Random(5)
    prompt = [rng.randrange(4, 260) for _ in range(200)]
    first = _decode_replicas()
    assert len(first) == 2
    killed: set[str] = set()
    outages = 0

    def kill_all_live():
        """Once tokens come from a replica started after the last outage, take every one down."""
        nonlocal outages
        live = _decode_replicas()
        if outages < 3 and not live <= killed:
            for name in live:
                ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            killed.update(live)
            outages += 1

    got = _stream(cluster["url"], prompt, 400, kill_all_live)
    want, _ = cluster["reference"].generate(EngineRequest("ref", prompt, SamplingParams(max_tokens=400,
                                                                                      ignore_eos=True)))
    assert outages == 3, "the stream outlived three outages of the whole decode pool"
    assert got == want, "no token lost, repeated or changed while no decode replica was up"
    assert _decode_replicas() - killed, "the stream finished on a replica started after the last outage"
    assert _metric(cluster["url"], "disagg_resumed_streams") >= 3
    assert _metric(cluster["url"], "disagg_stream_resume_timeouts") == 0
