"""The app the chart describes, run for real: the cpu-smoke serveConfigV2 on a local Ray
node that advertises what the chart's worker pod advertises, with the API key read
from a file holding the chart's Secret data (what the pod mounts)."""

from __future__ import annotations

import httpx
import pytest

from disagg.launch.deploy import validate_serve_config
from tests.deploy.chart import (
    example_values,
    one,
    ray_resources_param,
    render_objects,
    serve_config,
    worker_groups,
)
from tests.helpers import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_cpu_smoke_release_serves_with_its_key(tmp_path):
    import ray

    from disagg.launch.local import local_app, wait_healthy

    objs = render_objects(example_values("cpu-smoke"))
    rs, secret = one(objs, "RayService"), one(objs, "Secret")
    cfg = validate_serve_config(serve_config(rs))
    (group,) = worker_groups(rs).values()
    advertised = ray_resources_param(group["rayStartParams"]["resources"])
    keys = tmp_path / "api-keys"
    keys.write_text(secret["stringData"]["api-keys"])
    cfg.http.host, cfg.http.port, cfg.http.api_keys_file = "127.0.0.1", free_port(), str(keys)
    # one Ray node standing in for the pod: its CPUs and the role resources it advertises
    ray.init(address="local", num_cpus=int(float(group["rayStartParams"]["num-cpus"])) + 1, resources=advertised,
             include_dashboard=False, namespace="disagg")
    try:
        with local_app(cfg) as url:
            wait_healthy(url, timeout_s=600)
            assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
            auth = {"Authorization": "Bearer smoke-test-key-0001"}
            r = httpx.post(url + "/v1/completions", headers=auth, timeout=300, json={
                "model": cfg.model.openai_name, "prompt": list(range(3, 40)), "max_tokens": 4,
                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
            # each replica holds one unit of its role's resource: they were placed by it
            free = ray.available_resources()
            assert advertised["disagg_prefill"] - free.get("disagg_prefill", 0) == cfg.deployment.prefill.num_replicas
            assert advertised["disagg_decode"] - free.get("disagg_decode", 0) == cfg.deployment.decode.num_replicas
    finally:
        ray.shutdown()
