"""Serves a DictByteStore preloaded with deterministic objects (a test peer process).

Prints ``PORT <n>`` once bound, serves until stdin closes, then prints the
server's stats as one JSON line and exits. Not a test module.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from kv_transfer.tiers.memory import DictByteStore
from kv_transfer.transport.grpc_transport import StateServer, StateServerConfig

OBJECT_SIZES = {"mla:one": 1, "mla:odd": 3 * (1 << 20) + 7, "kda:ckpt": 123_457}


def object_bytes(key: str) -> bytes:
    """The preloaded object for ``key``; the same bytes in every process."""
    return np.random.default_rng(sum(key.encode())).bytes(OBJECT_SIZES[key])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--token", required=True)
    args = parser.parse_args()
    store = DictByteStore("peer-host")
    for key in OBJECT_SIZES:
        store.put_bytes(key, object_bytes(key))
    server = StateServer(store, StateServerConfig(token=args.token, address="127.0.0.1:0"))
    port = server.start()
    print(f"PORT {port}", flush=True)
    sys.stdin.read()  # serve until the parent closes our stdin
    server.stop(grace=1.0)
    print(server.stats().encode().decode(), flush=True)


if __name__ == "__main__":
    main()
