"""Run the application on a local Ray cluster (``disagg serve`` / ``demo``, tests)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator

from disagg.config import AppConfig

log = logging.getLogger(__name__)
APP_NAME = "disagg"


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ray Serve's latency-oriented settings: user code and handle routing on the replica's own event
# loop (no cross-thread hop per streamed token), gRPC between deployments, no per-request logs
# on stderr. Measured on the CPU machine: per-token overhead 5.6 ms -> 0.4 ms (benchmarks/serve_bench.py).
SERVE_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_LOG_TO_STDERR": "0",
}


def wait_healthy(url: str, timeout_s: float = 300.0) -> None:
    """Block until ``url``/health answers 200 (replicas up), or raise TimeoutError."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")


def _init_ray() -> bool:
    import ray

    for key, value in SERVE_ENV.items():  # the local cluster's processes inherit these
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        return False
    # logical CPUs: the embedded default packs ingress + prefill + decode onto small machines
    ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, namespace="disagg",
             log_to_driver=os.environ.get("DISAGG_RAY_LOGS", "0") == "1")
    return True


@contextlib.contextmanager
def local_app(cfg: AppConfig, name: str = APP_NAME) -> Iterator[str]:
    """Serve ``cfg`` on a local Ray cluster; yields the base URL; tears everything down."""
    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.node_store import shutdown_node_stores

    started = _init_ray()
    try:
        serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
        serve.run(build_app(cfg), name=name, route_prefix="/", blocking=False)
        yield f"http://{cfg.http.host}:{cfg.http.port}"
    finally:
        with contextlib.suppress(Exception):
            serve.delete(name)
        with contextlib.suppress(Exception):
            shutdown_node_stores()
        with contextlib.suppress(Exception):
            serve.shutdown()
        if started:
            ray.shutdown()


def serve_forever(cfg: AppConfig) -> None:
    with local_app(cfg) as url:
        print(f"disagg serving {cfg.model.openai_name} ({cfg.deployment.mode}) at {url}/v1  (Ctrl-C to stop)",
              flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("shutting down", flush=True)
