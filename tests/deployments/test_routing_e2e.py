"""State-aware routing on a real local Ray cluster: turns land where their state is, and survive its loss."""

from __future__ import annotations

import random
import re
import time

import httpx
import pytest
import ray

from disagg.config import load_config
from disagg.engine.factory import build_reference_engine
from disagg.engine.protocol import EngineRequest, SamplingParams
from disagg.launch.local import free_port, wait_healthy

pytestmark = pytest.mark.ray
MODEL = "disagg-tiny"


def _cfg():
    cfg = load_config("deployments/configs/local-cpu.yaml")
    cfg.http.port = free_port()
    cfg.deployment.decode.num_replicas = 2
    cfg.deployment.decode.num_cpus = 0.5
    cfg.deployment.prefill.num_cpus = 0.5
    cfg.router.policy = "state_aware"
    cfg.router.stats_period_s = 0.5
    cfg.router.local_prefill_max_tokens = 64
    return cfg


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 260) for _ in range(n)]


def _complete(url: str, prompt: list[int], session: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "session_id": session, "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()



def _kill_replica(replica_id: str) -> None:
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if replica_id in actor["name"] and "DecodeServer" in actor["name"]:
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            return
    raise AssertionError(f"no actor for replica {replica_id}")


def test_turns_follow_their_state_and_survive_losing_it():
    from disagg.launch.local import local_app

    cfg = _cfg()
    reference = build_reference_engine(cfg)  # same seeded weights as the replicas
    with local_app(cfg) as url:
        wait_healthy(url)
        sessions = {f"s{i}": _ids(300, i) for i in range(4)}
        salt = {s: 100 + i for i, s in enumerate(sessions)}
        first = {s: _complete(url, p, s) for s, p in sessions.items()}
        time.sleep(1.5)  # let replicas report their device-resident sessions
        placed = {}
        for s, r in first.items():
            sessions[s] = sessions[s] + r["choices"][0]["token_ids"] + _ids(40, salt[s])
            # the router no longer counts the previous turn (its predictions go when it ends, NOTE 4
            # of disagg.router.loads, and reports taken before its end stop counting it, NOTE 6); the
            # wait lets the replicas report the other sessions' turn ends as device-resident
            time.sleep(4 * cfg.router.stats_period_s)
            r2 = _complete(url, sessions[s], s)
            assert r2["disagg"]["replica"] == r["disagg"]["replica"], "turn 2 must land where its state is"
            assert r2["disagg"]["cached_source"] == "device"
            assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(sessions[s]) - 41
            placed[s] = r2
            sessions[s] = sessions[s] + r2["choices"][0]["token_ids"] + _ids(40, 50 + salt[s])
        assert len({r["disagg"]["replica"] for r in placed.values()}) == 2, "sessions spread over both replicas"
        metrics = httpx.get(url + "/metrics", timeout=30).text
        decisions = sum(float(v) for v in re.findall(r'^disagg_route_decisions\{reason="[^"]+"\} (\S+)$', metrics, re.M))
        assert decisions >= 8, "router decisions are exported"
        realized = float(re.search(r'disagg_route_cached_tokens\{kind="realized"\} (\S+)', metrics).group(1))
        assert realized >= sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in placed.values())
        # the ingress names the replica that ran each request as the router names its pick: the
        # turns above ran where routed; a first turn (no state to wait for) may go down the ranks
        # when its pick answers Serve's probe late (deployments.request_router NOTE 1)
        overridden = float(re.search(r'^disagg_route_overridden (\S+)$', metrics, re.M).group(1))
        assert overridden <= len(first), "requests counted as run elsewhere than routed"
        # the decode pool's router placed with the prefill pool's view, as its router in the
        # ingress sees it (deployments.request_router NOTE 2)
        views = dict(re.findall(r'^disagg_route_pool_views\{outcome="(\w+)"\} (\S+)$', metrics, re.M))
        assert float(views.get("read", 0)) >= len(placed), views

        victim = placed["s0"]["disagg"]["replica"]
        _kill_replica(victim)
        time.sleep(1.0)
        for s in ("s0", "s1"):
            r3 = _complete(url, sessions[s], s)
            assert r3["disagg"]["replica"] != victim
            want, _ = reference.generate(EngineRequest(f"ref-{s}", sessions[s],
                                                       SamplingParams(max_tokens=8, ignore_eos=True)))
            assert r3["choices"][0]["token_ids"] == want, f"session {s} after losing its replica"
            if placed[s]["disagg"]["replica"] == victim:
                # its turn-end state was published to the node's host tier before the replica died
                assert r3["disagg"]["cached_source"] in ("host", "device")
                assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
