"""``benchmarks/session_end_replay.py`` at a small size: it runs every client kind through real
serving (in-process backend, tiny CPU model, an LRU host tier too small for every session), every
kind's greedy outputs are identical (a signal only reorders eviction), and a client that says
when its sessions end resumes more than one that never does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_the_replay_runs_every_client_kind_and_the_outputs_agree():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "session_end_replay.py"), "--sessions", "8", "--live", "3",
         "--min-turns", "2", "--max-turns", "4", "--host-mb", "8"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {m[1]: float(m[2]) for m in re.finditer(r"^\s*(none|turn|delete)\s+([0-9.]+)", out.stdout, re.M)}
    assert set(rows) == {"none", "turn", "delete"}, out.stdout
    assert "greedy outputs identical across client kinds: True" in out.stdout
    assert rows["turn"] > rows["none"] and rows["delete"] > rows["none"], rows  # deterministic: one request at a time
