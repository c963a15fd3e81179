"""Two processes exchange state over gRPC: the server runs in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE))
from state_server_main import OBJECT_SIZES, object_bytes  # noqa: E402

TOKEN = "cross-process-secret"


@pytest.fixture
def peer_process():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(HERE)])}
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "state_server_main.py"), "--token", TOKEN],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), f"peer did not start: {line!r}"
        yield proc, int(line.split()[1])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_two_processes_exchange_state(peer_process, make_client) -> None:
    proc, port = peer_process
    client = make_client(f"127.0.0.1:{port}", token=TOKEN, timeout_s=10.0)
    assert client.wait_ready(10)

    keys = [*OBJECT_SIZES, "mla:absent"]
    assert client.contains(keys) == [True, True, True, False]
    fetched = client.get_many(keys)
    for key in OBJECT_SIZES:
        assert fetched[key] == object_bytes(key), key
    assert fetched["mla:absent"] is None

    mine = np.random.default_rng(7).bytes(5 * (1 << 20) + 3)
    assert client.put_many({"mla:from-child": mine, "kda:empty": b""}) == {
        "mla:from-child": True,
        "kda:empty": True,
    }
    assert client.get_bytes("mla:from-child") == mine
    assert client.delete("kda:empty") is True

    out, _ = proc.communicate(input="", timeout=20)  # closing stdin stops the peer
    assert proc.returncode == 0
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats["store_name"] == "peer-host"
    assert stats["num_push_stored"] == 2
    assert stats["num_bytes_received"] == len(mine)
    assert stats["num_fetch_hits"] == 4 and stats["num_fetch_misses"] == 1
    assert stats["num_auth_failures"] == 0
