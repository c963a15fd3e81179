"""What a recall's message costs on a miss, against the lookup's own ``contains`` of the same keys.

A worker that misses blocks past its resume point recalls them from its node mates' devices
(``kv_transfer.tiers.host`` NOTE 9, ``StateStore.recall``): two keys a block (the MLA block and
the KDA state at its end) and up to 126 tail keys, in one round trip over the node's socket,
also when no device holds any of them. This times that round trip (``HostTierClient.recall``
with no wait) for cold prompts of several lengths, nothing held and half held by another
connection (no listener, so it returns at once), each rep beside a ``contains`` of the same keys::

    python benchmarks/recall_message.py --tokens 8192,32768,131072
"""

from __future__ import annotations

import argparse
import statistics
import time

from kv_transfer.tiers.host import HostTier
from kv_transfer.tiers.host_ipc import HostTierClient, HostTierServer


def keys_of(num_blocks: int) -> list[str]:
    """Key names shaped as the store's (64 hex digits a digest), two a block and 126 tails."""
    return ([f"mla/{i:064x}/0" for i in range(num_blocks)] + [f"kda/{i:064x}/0" for i in range(num_blocks)]
            + [f"tail/{i:064x}" for i in range(126)])


def paired_ms(reader: HostTierClient, keys: list[str], reps: int) -> tuple[float, float]:
    """Median ms of a recall (no wait) and of a ``contains`` of ``keys``, taken in turn each rep."""
    recall, contains = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        reader.recall(keys, 0.0)
        t1 = time.perf_counter()
        reader.contains(keys)
        recall.append(t1 - t0)
        contains.append(time.perf_counter() - t1)
    return statistics.median(recall) * 1e3, statistics.median(contains) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="8192,32768,131072", help="comma list of cold prompt lengths")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    print(f"{'tokens':>8} {'keys':>6} {'held':>5} {'recall ms':>10} {'contains ms':>12} {'recall/contains':>16}")
    with HostTier(64 << 20, slab_bytes=1 << 20) as tier:
        server = HostTierServer(tier)
        reader, holder = HostTierClient(server.socket_path), HostTierClient(server.socket_path)
        try:
            for tokens in (int(t) for t in args.tokens.split(",")):
                blocks = tokens // args.block_size
                keys = keys_of(blocks)
                for held in (False, True):
                    if held:
                        holder.hold(keys[: blocks // 2])
                    recall, contains = paired_ms(reader, keys, args.reps)
                    if held:
                        holder.unhold(keys[: blocks // 2])
                    print(f"{tokens:>8} {len(keys):>6} {'half' if held else 'none':>5} {recall:>10.2f} "
                          f"{contains:>12.2f} {recall / contains:>16.2f}")
        finally:
            reader.close()
            holder.close()
            server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
