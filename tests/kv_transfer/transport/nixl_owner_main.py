"""Registers a deterministic host buffer with NIXL and publishes its descriptor.

Prints one JSON line (the RegionDescriptor, metadata hex-encoded), keeps the
buffer registered until stdin closes. Not a test module.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from kv_transfer.transport.nixl_transport import NixlAgent

NUM_BYTES = 4 * (1 << 20) + 11


def region_bytes() -> bytes:
    return np.random.default_rng(42).bytes(NUM_BYTES)


def main() -> None:
    agent = NixlAgent("owner-process")
    buffer = bytearray(region_bytes())
    d = agent.register(buffer)
    record = {
        "agent_name": d.agent_name,
        "agent_metadata": d.agent_metadata.hex(),
        "address": d.address,
        "num_bytes": d.num_bytes,
    }
    print("REGION " + json.dumps(record), flush=True)
    sys.stdin.read()
    agent.close()


if __name__ == "__main__":
    main()
