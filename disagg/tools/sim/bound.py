"""Offline hit bound with the cluster's capacities (Belady on the run's future).

The infinite-cache "theoretical" hit (``disagg.tools.sim.metrics``) ignores that
tiers are finite; at long contexts capacity, not placement, decides how much
can be reused. This bound replays a run's requests, in the order they
arrived, against one cache pooled from every tier of the cluster (all
workers' device blocks plus every node's host and disk blocks) run by
Belady's rule: on a miss, keep the block whose next use is furthest away out
(the newcomer itself, when it is the one used last or never again)::

    access     every full block of every prompt: looked up when the run admitted
               its prefill (its arrival, or its first step where the engine looks
               its device up again: Simulator NOTE 8), stored from its prefill's
               end on (capacity_bound; belady_hits: at once without times); where
               engines cache chunks (Simulator NOTE 11), a chunk's leading blocks
               from the chunk's end on, with a resume point there
    hit(r)     = q * block_size capped at prompt - 1 (or, past it, an earlier
                 prompt's end inside the block after the leading run), q = the furthest resume
                 point <= the prompt's leading run of cached blocks, where a
                 resume point is a multiple of ``checkpoint_every`` blocks or
                 the last full block of an earlier prompt (the simulator's
                 checkpoint positions); every_blocks 0: the last-full-block
                 points only (``capacity_bound`` with learned placement:
                 every block boundary)
    bound      = sum_r hit(r)  over the measured requests

It is an optimistic bound, not a placement: one pooled cache (no worker
boundaries, no duplicate device/host copies), checkpoints free of space,
reads free of time. It keeps one thing of time: a prompt's blocks exist from
the end of its prefill on (``capacity_bound``: a run's own admission and
prefill-end times), so a session admitted while another computes the prefix
they share cannot resume it, in the bound as in the run (the suite's sessions
start together; with every block boundary a resume point, a 2K system prompt
sent by 32 sessions at once was counted as 31 resumes nobody could make).
A router's hit / bound near 1 means placement and eviction lose little to
what the capacities allow.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from operator import attrgetter
from typing import TYPE_CHECKING

from disagg.tools.sim.state import checkpoint_units
from disagg.tools.sim.workload import DigestCache, SimRequest

if TYPE_CHECKING:
    from disagg.costs.model import CostModel
    from disagg.tools.sim.metrics import RequestRecord
    from disagg.tools.sim.simulator import ClusterConfig

_NEVER = 1 << 62


def belady_hits(prompts: Sequence[SimRequest], salts: Sequence[int], capacity_blocks: int,
                checkpoint_every: int, times: Sequence[tuple[float, float]] | None = None,
                chunks: Sequence[Sequence[tuple[float, int]] | None] | None = None) -> list[int]:
    """Bound of the resumed tokens of each prompt.

    Args:
        prompts: requests in arrival order.
        salts: each request's cache-busting salt (0 without recycling).
        capacity_blocks: the pooled cache, in blocks.
        checkpoint_every: periodic checkpoint spacing in blocks (0: none).
        times: per prompt (lookup, ready): it looks its blocks up at ``lookup`` (its arrival or
            admission) and they exist from ``ready`` on (its prefill's end), in time order, an
            insert before a lookup at the same time; None: each prompt is looked up and inserted
            at once, in the given order.
        chunks: per prompt, with ``times``, (time, blocks) of its prefill's chunks cached before
            ``ready`` (Simulator NOTE 11): its first ``blocks`` blocks exist from ``time`` on, with
            a resume point at their end; None or an entry None: none.
    """
    if capacity_blocks < 0 or checkpoint_every < 0:
        raise ValueError("capacity_blocks and checkpoint_every must be >= 0")
    if times is not None and len(times) != len(prompts):
        raise ValueError("one (arrival, ready) pair per prompt")
    if chunks is not None and (times is None or len(chunks) != len(prompts)):
        raise ValueError("chunks need times, and one entry per prompt")
    cache = DigestCache()
    alls = [cache.digests(r.session_id, s, r.hash_ids, min(-(-r.input_length // r.block_size), len(r.hash_ids)))
            for r, s in zip(prompts, salts, strict=True)]
    chains = [d[: r.num_full_blocks] for d, r in zip(alls, prompts, strict=True)]
    # events (time, kind, prompt, blocks inserted): kind 0 a lookup, 1 an insert
    if times is None:
        events = [(i, 0, i, -1) for i in range(len(prompts))] + [(i, 1, i, -1) for i in range(len(prompts))]
        events.sort()
    else:  # at a tie: others' inserts, then lookups, then the inserts of prompts ready on arrival
        order = [(a, 1, i, -1) for i, (a, _) in enumerate(times)] \
            + [(r, 0, i, -1) if r > a else (a, 2, i, -1) for i, (a, r) in enumerate(times)]
        for i, parts in enumerate(chunks or ()):  # a running prefill's chunks: inserts of a leading part
            order.extend((t, 0, i, n) for t, n in parts or () if t < times[i][1])
        events = [(t, 0 if kind == 1 else 1, i, n) for t, kind, i, n in sorted(order)]
    lookups = [i for _, kind, i, _ in events if kind == 0]
    keys = [d for i in lookups for d in chains[i]]  # every lookup access, in event order
    n = len(keys)
    nxt = [_NEVER] * n  # the key's next lookup access after access t
    upcoming: dict[bytes, int] = {}  # key -> its next lookup access from the current event on
    for t in range(n - 1, -1, -1):
        k = keys[t]
        nxt[t] = upcoming.get(k, _NEVER)
        upcoming[k] = t
    held: dict[bytes, int] = {}  # key -> its next use
    heap: list[tuple[int, bytes]] = []  # (-next use, key), stale entries skipped
    lfb: set[bytes] = set()  # last full blocks of earlier prompts (resume points)
    ends: dict[bytes, int] = {}  # an earlier prompt's partial last block -> its tokens (a prompt end)
    out = [0] * len(prompts)
    t = 0
    for _, kind, i, part in events:
        chain, r = chains[i], prompts[i]
        if kind == 0:  # lookup: the leading run held now, back to a resume point
            lead = -1
            for j, k in enumerate(chain):
                nu = nxt[t]
                upcoming[k] = nu
                t += 1
                if k in held:
                    held[k] = nu
                    heapq.heappush(heap, (-nu, k))
                elif lead < 0:
                    lead = j
            q = len(chain) if lead < 0 else lead
            while q > 0 and not (checkpoint_every and q % checkpoint_every == 0) and chain[q - 1] not in lfb:
                q -= 1
            hit = q * r.block_size
            held_run = len(chain) if lead < 0 else lead
            if held_run < len(alls[i]) and alls[i][held_run] in ends:  # an earlier prompt ended in that block
                hit = max(hit, held_run * r.block_size + ends[alls[i][held_run]])
            out[i] = min(hit, r.input_length - 1)
            continue
        if part >= 0:  # a chunk's end: its leading blocks, with a resume point there
            chain = chain[:part]
        for k in chain:  # insert: Belady's rule, bypassing a newcomer used last or never
            nu = upcoming.get(k, _NEVER)
            if k in held:
                held[k] = nu
                heapq.heappush(heap, (-nu, k))
                continue
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
        if chain:
            lfb.add(chain[-1])
        if part >= 0:
            continue
        off = r.input_length % r.block_size
        if off and len(alls[i]) > len(chain):
            tail = alls[i][len(chain)]
            ends[tail] = max(ends.get(tail, 0), off)
        if len(heap) > 4 * capacity_blocks + 1024:  # drop stale entries now and then
            heap = [(-nu, k) for k, nu in held.items()]
            heapq.heapify(heap)
    return out


def capacity_bound(requests: Sequence[SimRequest], records: Sequence[RequestRecord], cluster: ClusterConfig,
                   cost: CostModel, live_sessions: int) -> int:
    """The bound of a finished run: its finished requests, in the order they arrived, against the
    cluster's pooled capacity (every device, every node's host and disk tiers) less one resume
    checkpoint per live session (``live_sessions``: a closed loop's lanes). With learned checkpoint
    placement a prefill may keep a checkpoint at any block boundary, so every boundary is a resume
    point of the bound; else the cluster's periodic ones (and last full blocks)."""
    return sum(capacity_bound_per_request(requests, records, cluster, cost, live_sessions))


def capacity_bound_per_request(requests: Sequence[SimRequest], records: Sequence[RequestRecord],
                               cluster: ClusterConfig, cost: CostModel, live_sessions: int) -> list[int]:
    """``capacity_bound``'s hits per finished request, in the order they arrived."""
    done = sorted((r for r in records if r.finish >= 0), key=attrgetter("arrival"))
    if not done:
        return []
    by_key = {(r.session_id, r.turn): r for r in requests}
    prompts = [by_key[(r.session_id, r.turn)] for r in done]
    nodes = -(-cluster.num_engines // cluster.workers_per_node)
    pooled = cluster.num_engines * cluster.device_blocks + nodes * (cluster.host_blocks + cluster.disk_blocks)
    units = checkpoint_units(cost, prompts[0].block_size)
    capacity = max(pooled - live_sessions * units, 0)
    # looked up where the run's engine looked its device up last (Simulator NOTE 8: admission), ready
    # once its prefill stored it (a P/D hand-off's first token comes later)
    times = [(look, max(r.stored if r.stored >= 0 else r.first_token, look))
             for r in done for look in (max(r.arrival, r.admitted),)]
    every = 1 if cluster.learned_checkpoints else cluster.checkpoint_every_blocks  # learned: any boundary
    chunks = [r.chunks for r in done] if any(r.chunks for r in done) else None  # Simulator NOTE 11
    return belady_hits(prompts, [r.salt for r in done], capacity, every, times, chunks)
