"""``disagg serve`` as a user runs it: it talks, and SIGTERM leaves nothing behind.

One subprocess serves the tiny model (aggregated, on a free port, with its own temp
directory so that Ray's session and the HAProxy shim land where this test can see them).
After one request has been served and printed, the test notes every descendant process
(Ray's gcs_server, raylet and workers, HAProxy), sends SIGTERM and checks that the server
exits 0, the port is free, none of those processes runs any more and the shim directory
is gone.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from disagg.launch.local import _haproxy_available, free_port

pytestmark = pytest.mark.ray
ROOT = Path(__file__).parents[2]


def _stat(pid: int) -> tuple[str, str, int] | None:
    """(name, state, start time) of a running process, None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2:].split()
    return text[text.index("(") + 1:text.rindex(")")], rest[0], int(rest[19])


def descendants(root: int) -> dict[int, tuple[str, int]]:
    """Every process under ``root``: pid -> (name, start time)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            st = _stat(child)
            if st is not None:
                found[child] = (st[0], st[2])
                todo.append(child)
    return found


def still_running(procs: dict[int, tuple[str, int]]) -> list[str]:
    left = []
    for pid, (name, start) in procs.items():
        st = _stat(pid)
        if st is not None and st[2] == start and st[1] != "Z":
            left.append(f"{pid} {name}")
    return left


class Output:
    """The server's merged stdout/stderr, read in a thread."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.text = ""
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.text += line

    def wait_for(self, needle: str, timeout_s: float, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + timeout_s
        while needle not in self.text:
            assert proc.poll() is None, f"server exited {proc.returncode}:\n{self.text}"
            assert time.monotonic() < deadline, f"no {needle!r} after {timeout_s} s:\n{self.text}"
            time.sleep(0.2)


def start(port: int, tmp: str, attempts: int = 3) -> tuple[subprocess.Popen, Output]:
    """``disagg serve`` until ready; a start that Ray itself gave up on (its fixed 30 s wait for
    the raylet, missed on an overloaded machine: ``ClusterStartError``) is tried again."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=tmp)
    for attempt in range(attempts):
        proc = subprocess.Popen([sys.executable, "-m", "disagg.launch.cli", "serve", "tiny", "--port", str(port),
                                 "--mode", "aggregated"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=ROOT)
        out = Output(proc)
        try:
            out.wait_for("disagg serving disagg-tiny", 240, proc)
            return proc, out
        except AssertionError:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if "Ray's local cluster did not start" not in out.text or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def test_sigterm_stops_everything_and_frees_the_port():
    import httpx

    port = free_port()
    tmp = tempfile.mkdtemp(prefix="dx")  # short: Ray's socket paths live under it
    proc = None
    try:
        proc, out = start(port, tmp)
        assert f"logs: {tmp}" in out.text  # where the logs are, printed at start
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=180,
                       json={"model": "disagg-tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4})
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        out.wait_for(f"request {rid} prompt=4 cached=0 (computed) out=4", 60, proc)  # one line per request
        procs = descendants(proc.pid)
        names = {name for name, _ in procs.values()}
        assert {"raylet", "gcs_server"} <= names, names
        if _haproxy_available():
            assert "haproxy" in names, names
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, out.text
        assert "stopped in" in out.text
        assert "Traceback" not in out.text
        assert still_running(procs) == []
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: a second server can start here
        assert not list(Path(tmp).glob("disagg-haproxy-*"))
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
