"""NIXL READs of host memory (skipped when no NIXL package imports)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kv_transfer.transport import available_transports, nixl_transport

pytestmark = pytest.mark.skipif(
    not nixl_transport.is_available(), reason=f"{nixl_transport.unavailable_reason()}"
)

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]


def test_listed_as_available() -> None:
    assert available_transports() == ["grpc", "nixl"]
    assert nixl_transport.unavailable_reason() is None


def test_read_peer_region_in_process() -> None:
    owner = nixl_transport.NixlAgent("owner")
    reader = nixl_transport.NixlAgent("reader")
    try:
        src = bytearray(np.random.default_rng(0).bytes(8 * (1 << 20)))
        region = owner.register(src)
        assert region.num_bytes == len(src)
        dst = bytearray(len(src))
        assert reader.read(region, dst)
        assert dst == src
        part = np.zeros(1000, dtype=np.uint8)
        assert reader.read(region, part, offset=4096)
        assert part.tobytes() == bytes(src[4096:5096])
        with pytest.raises(ValueError):
            reader.read(region, bytearray(10), offset=len(src) - 5)
    finally:
        reader.close()
        owner.close()


def test_read_region_of_another_process() -> None:
    sys.path.insert(0, str(HERE))
    from nixl_owner_main import region_bytes

    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(HERE), *inherited])}
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "nixl_owner_main.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    reader = nixl_transport.NixlAgent("reader-process")
    try:
        line = next(text for text in proc.stdout if text.startswith("REGION "))
        raw = json.loads(line[len("REGION ") :])
        region = nixl_transport.RegionDescriptor(
            raw["agent_name"],
            bytes.fromhex(raw["agent_metadata"]),
            raw["address"],
            raw["num_bytes"],
        )
        dst = bytearray(region.num_bytes)
        assert reader.read(region, dst, timeout_s=10)
        assert dst == region_bytes()
    finally:
        reader.close()
        proc.communicate(input="", timeout=20)
