"""The per-run HAProxy shim directories of local clusters, and what is left in them.

``disagg.launch.local`` writes one directory per cluster-starting process::

    $TMPDIR/disagg-haproxy-XXXX/
        haproxy-front   the shim Serve starts HAProxy through (deployments.haproxy_front)
        owner           "<pid> <start time>" of the process that made it
        pids            one line per HAProxy the shim started (written by haproxy_front)

At a clean shutdown the owner stops what is left of its HAProxy processes and
removes the directory (``stop_recorded``). An owner that died without one (SIGKILL,
a crash) leaves HAProxy holding the HTTP port; the next ``disagg serve`` finds the
directory, sees its owner gone and stops those processes first (``reap_orphans``).

NOTES
1. A pid is stopped only while ``/proc`` names it HAProxy, and an owner counts as
   alive only with the same pid *and* start time, so a reused pid is never taken for
   the process that was recorded.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import tempfile
import time

PREFIX = "disagg-haproxy-"


def write_owner(folder: str) -> None:
    """Record this process as the owner of ``folder``."""
    with open(os.path.join(folder, "owner"), "w") as f:
        f.write(f"{os.getpid()} {_start_time(os.getpid())}\n")


def stop_recorded(folder: str, timeout_s: float = 3.0) -> list[int]:
    """SIGTERM (then SIGKILL after ``timeout_s``) the HAProxy processes ``folder`` recorded that
    still run (NOTE 1); remove ``folder``. Returns the pids that were running."""
    try:
        with open(os.path.join(folder, "pids")) as f:
            pids = [int(line) for line in f if line.strip().isdigit()]
    except OSError:
        pids = []
    alive = [pid for pid in pids if _is_haproxy(pid)]
    for pid in alive:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(_is_haproxy(pid) for pid in alive) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in alive:
        if _is_haproxy(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    shutil.rmtree(folder, ignore_errors=True)
    return alive


def reap_orphans(tmpdir: str | None = None) -> list[int]:
    """Stop what dead owners left (module docstring); returns the HAProxy pids stopped."""
    stopped = []
    for folder in glob.glob(os.path.join(tmpdir or tempfile.gettempdir(), PREFIX + "*")):
        try:
            with open(os.path.join(folder, "owner")) as f:
                pid, start = (int(v) for v in f.read().split())
        except (OSError, ValueError):
            continue  # no owner recorded: not ours to judge
        if _start_time(pid) != start:
            stopped += stop_recorded(folder)
    return stopped


def _stat(pid: int) -> tuple[str, str, list[str]] | None:
    """(name, state, the fields after the state) of ``pid``, None when it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2 :].split()
    return text[text.index("(") + 1 : text.rindex(")")], rest[0], rest[1:]


def _start_time(pid: int) -> int | None:
    st = _stat(pid)
    return int(st[2][18]) if st is not None and st[1] != "Z" else None  # field 22 of proc(5)


def _is_haproxy(pid: int) -> bool:
    """``pid`` runs HAProxy now (not a zombie)."""
    st = _stat(pid)
    return st is not None and "haproxy" in st[0] and st[1] != "Z"
