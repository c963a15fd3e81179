"""Offline hit bound with the cluster's capacities (Belady on the run's future).

The infinite-cache "theoretical" hit (``disagg.tools.sim.metrics``) ignores that
tiers are finite; at long contexts capacity, not placement, decides how much
can be reused. This bound replays a run's requests, in the order they
arrived, against one cache pooled from every tier of the cluster (all
workers' device blocks plus every node's host and disk blocks) run by
Belady's rule: on a miss, keep the block whose next use is furthest away out
(the newcomer itself, when it is the one used last or never again)::

    access     every full block of every prompt, in arrival order
    hit(r)     = q * block_size capped at prompt - 1, q = the furthest resume
                 point <= the prompt's leading run of cached blocks, where a
                 resume point is a multiple of ``checkpoint_every`` blocks or
                 the last full block of an earlier prompt (the simulator's
                 checkpoint positions); every_blocks 0: the last-full-block
                 points only
    bound      = sum_r hit(r)  over the measured requests

It is an optimistic bound, not a placement: one pooled cache (no worker
boundaries, no duplicate device/host copies), checkpoints free of space,
reads free of time. A router's hit / bound near 1 means placement and
eviction lose little to what the capacities allow.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from operator import attrgetter
from typing import TYPE_CHECKING

from disagg.tools.sim.state import checkpoint_units
from disagg.tools.sim.workload import DigestCache, SimRequest

if TYPE_CHECKING:
    from disagg.tools.sim.cost_model import CostModel
    from disagg.tools.sim.metrics import RequestRecord
    from disagg.tools.sim.simulator import ClusterConfig

_NEVER = 1 << 62


def belady_hits(prompts: Sequence[SimRequest], salts: Sequence[int], capacity_blocks: int,
                checkpoint_every: int) -> list[int]:
    """Bound of the resumed tokens of each prompt, replayed in the given order.

    Args:
        prompts: requests in arrival order.
        salts: each request's cache-busting salt (0 without recycling).
        capacity_blocks: the pooled cache, in blocks.
        checkpoint_every: periodic checkpoint spacing in blocks (0: none).
    """
    if capacity_blocks < 0 or checkpoint_every < 0:
        raise ValueError("capacity_blocks and checkpoint_every must be >= 0")
    cache = DigestCache()
    chains = [cache.digests(r.session_id, s, r.hash_ids, r.num_full_blocks) for r, s in zip(prompts, salts,
                                                                                           strict=True)]
    keys = [d for chain in chains for d in chain]
    n = len(keys)
    nxt = [_NEVER] * n
    seen: dict[bytes, int] = {}
    for t in range(n - 1, -1, -1):
        k = keys[t]
        nxt[t] = seen.get(k, _NEVER)
        seen[k] = t
    held: dict[bytes, int] = {}  # key -> its next use
    heap: list[tuple[int, bytes]] = []  # (-next use, key), stale entries skipped
    lfb: set[bytes] = set()  # last full blocks of earlier prompts (resume points)
    out: list[int] = []
    t = 0
    for r, chain in zip(prompts, chains, strict=True):
        lead = -1
        for i, k in enumerate(chain):
            nu = nxt[t]
            t += 1
            if k in held:
                held[k] = nu
                heapq.heappush(heap, (-nu, k))
                continue
            if lead < 0:
                lead = i
            if nu == _NEVER or capacity_blocks == 0:
                continue
            if len(held) >= capacity_blocks:
                while True:
                    neg, far = heap[0]
                    if held.get(far) == -neg:
                        break
                    heapq.heappop(heap)
                if -neg <= nu:
                    continue  # the newcomer is the one used last: bypass
                heapq.heappop(heap)
                del held[far]
            held[k] = nu
            heapq.heappush(heap, (-nu, k))
        lead = len(chain) if lead < 0 else lead
        q = lead
        while q > 0 and not (checkpoint_every and q % checkpoint_every == 0) and chain[q - 1] not in lfb:
            q -= 1
        out.append(min(q * r.block_size, r.input_length - 1))
        if chain:
            lfb.add(chain[-1])
        if len(heap) > 4 * capacity_blocks + 1024:  # drop stale entries now and then
            heap = [(-nu, k) for k, nu in held.items()]
            heapq.heapify(heap)
    return out


def capacity_bound(requests: Sequence[SimRequest], records: Sequence[RequestRecord], cluster: ClusterConfig,
                   cost: CostModel, live_sessions: int) -> int:
    """The bound of a finished run: its finished requests, in the order they arrived, against the
    cluster's pooled capacity (every device, every node's host and disk tiers) less one resume
    checkpoint per live session (``live_sessions``: a closed loop's lanes)."""
    done = sorted((r for r in records if r.finish >= 0), key=attrgetter("arrival"))
    if not done:
        return 0
    by_key = {(r.session_id, r.turn): r for r in requests}
    prompts = [by_key[(r.session_id, r.turn)] for r in done]
    nodes = -(-cluster.num_engines // cluster.workers_per_node)
    pooled = cluster.num_engines * cluster.device_blocks + nodes * (cluster.host_blocks + cluster.disk_blocks)
    units = checkpoint_units(cost, prompts[0].block_size)
    capacity = max(pooled - live_sessions * units, 0)
    return sum(belady_hits(prompts, [r.salt for r in done], capacity, cluster.checkpoint_every_blocks))
