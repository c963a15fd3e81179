"""Discrete-event simulator: a trace, a cluster of simulated engines, one router.

Event queue: a heap of (time, seq, callback, args); time in float seconds,
seq breaks ties in scheduling order, so a run is a pure function of its
inputs and seed.

A request's path (the real system's, with costs from ``CostModel``):

    send --request_overhead--> route --> prefill worker P: resume (blocks and a
    checkpoint from device / host / disk: bytes / bw + latency, off the engine's
    critical path; NOTE 1) -> chunked prefill -> store blocks + checkpoints (device,
    write-through to the node's host tier)
      local (P == D):  first token at prefill end, join P's decode batch
      disagg (P != D): P publishes the state to its host tier and returns the
                       first token (+ publish time + disagg_overhead); D loads the
                       state it lacks (NOTE 2; same node: host link, else remote
                       link) and joins its decode batch
    last token -> finish -> (closed loop) next turn after the think time

Every cache change becomes an update of the router's ``PrefixIndex`` (see
``disagg.tools.sim.state``), so the router sees what a deployed router would see.
Workers' ``WorkerState``s are updated in place (live stats); with
``stats_period_s`` > 0 the router reads copies refreshed that often.

Scale: per request the simulator does a few C-speed passes over the
prompt's blocks (digests are extended incrementally per session), and a
decode event costs O(log batch), so a run's cost is dominated by the
router's own decision time (see docs/sim.md for measured rates).

NOTES
1. Peer reads (``ClusterConfig.peer_reads``, P/D): a prefill for decode worker D on
   another node may resume from D's node tiers (host, disk) over the remote link,
   as the serving prefill reads the node that the decode replica names
   (``GenerateParams.state_node``); it does when they resume further than P's own
   tiers. D's node keeps its sessions: every hand-off to D is stored there. A session whose
   decode moved to another node left its state on its last node: the router names that node
   (``RouteDecision.state_node``, router step 4) and the target, prefill or local, reads it
   from there instead, when it resumes further.
2. Delta hand-off: the decode worker loads only the blocks after the leading ones its device
   holds (the session's earlier turns, decoded there), plus the tail and checkpoint, as the
   serving flow does (``disagg.flow`` NOTE 11).
3. A hand-off to a decode worker on another node leaves the session's copies in the prefill
   node's shared tiers evicted first (retention ``on_handed_off``): its next turn finds it on
   D's node (or, moved, through the node the router names), so a second copy would only push
   out the sessions that node serves. The prefill worker's device keeps its copy (its next
   turn may prefill there again). Serving does the same in two steps: the prefill demotes the
   points it published for the turn as it publishes them (``disagg/workers/tiered.py`` NOTE 3;
   one evicted before the decode loads it is a recompute), and the decode replica, once it has
   loaded the hand-off, demotes the prompt's private MLA blocks there (``disagg.flow`` NOTE 12:
   private as far as its ledger knows; the simulator knows it from the whole run).
4. Spill to the pool (``ClusterConfig.spill_to_pool``, P/D, on by default as serving's
   ``transfer.spill`` is, deployments.node_store NOTE 2): the last tier of a node without
   prefill workers (its disk, else its host) writes what it evicts to the host tier of a node
   with prefill workers (node k of those without: the ((k mod m)+1)-th of the m with), where a
   prefill worker resumes it from its own node. The write is taken as background traffic: it
   costs no time. What the retention demoted (cache NOTE 4: ended sessions' objects,
   superseded checkpoints) is not spilled: nothing is expected to read it again. At 64 workers
   the decode nodes' host tiers are the ones that fill, while the pool's nodes hold a quarter
   of the cluster's host capacity (docs/router.md, "Round 7"). A spilled object enters the
   receiving host tier as its newest, as in serving's default (LRU) host tier; its S3-FIFO
   puts it in the small FIFO instead, where it cannot push the receiver's re-read state out.
5. Learned checkpoint placement (``ClusterConfig.learned_checkpoints``; serving's
   ``engine.learned_checkpoints``, on by default there): besides the policy's points (serving:
   the prompt end and the last full block, no periodic ones), a prefill keeps a checkpoint where
   ``disagg.reuse.placement.CheckpointPlacement`` puts one, the same class serving runs: each
   decode-side worker (the flow that plans the prefill, ``disagg.flow`` NOTE 7) has its own,
   which learns from the follow-ups it serves how far back from their predecessors' last full
   block they diverge, with its cold-start prior, the branch point where a prompt stops sharing
   another session's blocks and points at powers of two in a prompt's unseen part. Where serving
   asks its worker's ledger, the simulator uses the run's: the prefix any earlier prompt sent
   (``bound``), the session that sent a block first (``branch``), and the resume point itself
   (for the ledger's furthest published point). The state-aware router learns the distances from
   every session's follow-ups and names them in its decision (``RouteDecision.checkpoint_back``,
   placement NOTE 4); the worker's placement uses them in place of its own, as serving's flow does.
6. Write-back host tiers (``ClusterConfig.host_write`` "back"; not what serving does, which
   writes every turn's state through to the node's host tier): a store goes to the device only,
   and what a device evicts (demoted objects aside) is written to its node's host tier, at no
   cost, so a node's host and devices hold mostly different objects and the node keeps more
   sessions. A prefill's hand-off to a decode worker still publishes to the prefill node's host
   tier (the decode worker loads it from there). A session's state on one worker's device is
   not readable by the other workers of its node until that device evicts it.
7. A session's last turn, marked by its client (``ClusterConfig.session_ends``, closed loop:
   the API's ``session_end``): serving's flow publishes no turn end for it (``disagg.flow``
   NOTE 13), so its stores write nothing through to a host tier: the device keeps the state
   while the turn runs, and the retention demotes it when the turn ends. A prefill's hand-off
   still publishes on the prefill node (the decode worker loads it from there). Clients that
   end a session only after its last turn's answer (``session_end_after``: the API's ``DELETE
   /v1/sessions/{id}``, ``disagg.flow`` NOTE 14) leave that turn written like any other, and
   the retention demotes it all the same.
8. A device looked up again at admission: a prefill whose plan found no state to resume
   (planned at routing) looks its worker's device up again in the step that gives it its
   first chunk, and resumes what the device holds by then (``admit``). Serving's engines do: the reference
   engine adopts a resident session when it admits a request that brought no state
   (``ReferenceEngine._admit``), vLLM's scheduler matches its prefix cache when it schedules a
   request. So a request queued behind another that computes the prefix they share resumes it,
   once that prefill has stored it (one that starts beside it, in the same step, does not).
   Planned at routing alone, the sessions of a burst that share a prompt each recomputed it,
   however long they had waited behind its first computation (docs/router.md, "Round 22").
9. What the router is told of a request's output (``ClusterConfig.output_hint``): "none" (the
   default) tells it nothing, as a serving client that sends ``max_tokens`` or nothing tells it
   a cap at most; the state-aware router learns what sessions generate from the requests that
   finish (``disagg.router.outputs``). "exact" hands it each request's true output length, an
   oracle no serving router has (rounds 1-23 ran with it; docs/router.md, "Round 24").
   The baselines read no output length either way.
10. Where reuse is lost (``ClusterConfig.explain_misses``): when a request is placed, the
   simulator also measures the furthest any worker could have resumed it then (each worker's
   device and its node's tiers, a dry resume: ``RequestRecord.reach_tokens``), how many of its
   leading full blocks some tier of the cluster held (``stored_tokens``), and whether the first
   block none held had been stored before (``gap_stored_before``: evicted, else still being
   computed). ``metrics.reuse_lost`` splits the tokens an infinite cache would have resumed and
   the run did not into placement, checkpoint, evicted and in flight. It also notes which rule
   kept each checkpoint a prefill stored (``RequestRecord.kept``: the engine's own, the learned
   placement's branch, back or start points, ``CheckpointPlacement.placed``, or a chunk's) and
   which one each resume started from (``resumed_from``); ``metrics.checkpoint_use`` counts them
   per kind. It reads every tier of the cluster per request, so it is off unless asked for
   (``disagg sim run --explain-misses``).
11. A prefill's chunks cached as they complete (``ClusterConfig.chunk_cache``, off by default):
   when a step computes a chunk of a prefill that is not done, the worker's device keeps the
   blocks computed so far and the KDA checkpoint at the chunk's end (a block boundary), as
   vLLM's prefix caching for hybrid models does ("align" mode: chunks end on block boundaries
   and the state at each is cached). A request admitted in a later step (NOTE 8), or routed
   there meanwhile, resumes that part; the rest is stored when the prefill ends, as without
   it. Only the device: the host tier is written when the prefill ends. The reference engine
   caches a prefill when it ends, so serving on it is the default; the engine profiles of
   vLLM engines (``h200-small``, ``mi355x-k3``) are closer with it.
12. Victim host tiers (``ClusterConfig.host_write`` "victim", the default where nodes have a host tier;
   serving's ``transfer.host.victim``, its default on the reference engine): stores
   write through as in serving, but a node's host tier lets go first of what a device of the
   node holds, and what the last device holding an object evicts goes back to the host tier
   (cache NOTE 5), so a full node keeps about its host tier plus its devices, not its host
   tier alone. Only the devices of workers that decode count: a P/D prefill worker's device
   holds prompts whose sessions live on their decode nodes (NOTE 3), and writing back what it
   evicts filled the prefill nodes' host tiers with them (the issue's trace, P/D at 16
   workers: hit/bound 0.915 with them counted, 0.960 without). A worker resumes from its
   node's other devices too, over the node's links (``NodeView``; charged as host-tier reads,
   and as remote ones for a peer read of another node), as serving's device hand-off reads a
   peer GPU of its host (``disagg.workers.tiered`` NOTE 1). Those are its decoding devices: a
   P/D prefill device answers no recall in serving (``disagg.workers.holds`` NOTE 4), and read
   here it gave the policies that spread load reuse serving has not (the held-out `rag/pd`:
   `round_robin`'s TTFT P90 0.066 s read so, 0.610 s without; docs/router.md "Round 44"). The router's index sees the node's
   host tier as the node reads it: an object stays published there while a decoding device of
   the node holds it (without that, on the held-out `docqa/agg` the router sent questions away from the
   node mates of the devices holding their documents: placement lost 0.024 of the reuse). On the
   issue's own trace at 16 workers, written through, the run loses 0.077 of the infinite
   cache's reuse to eviction while Belady on the pooled capacity loses 0.002; with the host
   tier enlarged by the devices' room the loss is gone, which is what this arrangement
   reaches without more memory (docs/router.md, "Round 40"). Serving reads a node mate's device
   by recalling it (``kv_transfer.tiers.host`` NOTE 9: the mate writes it back into the host tier,
   the reader loads it there), and keeps a held key's eviction from the index until its last
   holder lets it go; here what a worker reads from a mate's device (not from the host tier)
   costs a host-tier transfer more, the write-back before the read (``StateModel.resume``), and
   the wait for the holder's step to end is not modelled. "victim-own" is serving
   with ``transfer.host.recall_ms`` 0 (``disagg.workers.holds``): the same tiers, but a worker
   reads its own device and the host tier only, and the index is told of the host tier alone.

Garbage collection: the event loop runs with Python's cyclic collector
paused (reference counting still frees everything at once). A run allocates
millions of long-lived objects (index rows, records, digest lists) and next
to no cyclic garbage (about 300 objects in a 37,000-request run), so every
full collection walked the whole heap for nothing, and in a forked domain
process (``disagg.tools.sim.shard``) it also copied the parent's pages.
"""

from __future__ import annotations

import copy
import gc
import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from disagg.config import KEEP_TURNS
from disagg.costs.model import CostModel
from disagg.reuse.placement import CheckpointPlacement
from disagg.router.baselines import BASELINES
from disagg.router.calibration import with_engine_costs
from disagg.router.index import PrefixIndex
from disagg.router.router import StateAwareRouter
from disagg.router.types import RouteRequest, WorkerState
from disagg.tools.sim.cache import LRUTier, NodeView, PolicyTier, VictimHost
from disagg.tools.sim.driver import Driver, ReplayConfig
from disagg.tools.sim.metrics import RequestRecord, bench_summary, summarize
from disagg.tools.sim.retention import RETENTION_POLICIES, SessionRetention
from disagg.tools.sim.state import TIER_NAMES, CheckpointPolicy, PromptState, Resume, StateModel
from disagg.tools.sim.worker import SimJob, SimWorker
from disagg.tools.sim.workload import DigestCache, SimRequest, tail_digest

HOST_POLICIES = ("lru", "s3fifo", "arc")  # serving's host tier policies (transfer.host.policy)
HOST_WRITES = ("through", "back", "victim", "victim-own")  # NOTE 6, NOTE 12
OUTPUT_HINTS = ("none", "exact")  # NOTE 9
_K = b"K"  # an aligned checkpoint's key: "K" + the digest of the block it ends (disagg.tools.sim.state)

__all__ = ["HOST_POLICIES", "HOST_WRITES", "OUTPUT_HINTS", "TIER_NAMES", "ClusterConfig", "SimResult", "Simulator", "build_router"]


@dataclass(slots=True)
class ClusterConfig:
    num_workers: int = 4  # aggregated workers (used when num_prefill == num_decode == 0)
    num_prefill: int = 0  # P/D: prefill workers
    num_decode: int = 0  # P/D: decode workers
    workers_per_node: int = 8  # workers sharing a host (and disk) tier
    gpus_per_worker: int = 1  # GPUs of one engine replica (TP x DCP): tokens/s/GPU divides by these
    device_blocks: int = 4096  # device cache per worker, in blocks
    host_blocks: int = 65536  # host tier per node (0 = none)
    disk_blocks: int = 0  # disk tier per node (0 = none)
    checkpoint_every_blocks: int = 16  # periodic KDA checkpoints (0 = off)
    checkpoint_last_full_block: bool = True  # a checkpoint at the prompt's last full block
    checkpoint_prompt_end: bool = False  # a checkpoint at the prompt end (MLA tail when unaligned)
    stats_period_s: float = 0.0  # router sees stats this stale (0 = live)
    macro_steps: int = 64  # decode steps per event at most
    node_compute_slots: float = 0.0  # engines a node runs at full speed at once (0: no sharing; CPU nodes)
    retention: str = "lru"  # tier eviction order: RETENTION_POLICIES (disagg.tools.sim.retention)
    peer_reads: bool = True  # P/D: a prefill reads its decode worker's node tiers (Simulator NOTE 1)
    spill_to_pool: bool = True  # P/D: decode nodes' evictions go to a prefill node's host tier (NOTE 4)
    learned_checkpoints: bool = False  # serving's learned checkpoint placement (NOTE 5)
    speculative_first: bool = False  # serving's transfer.host.speculative_first (retention "checkpoints"/"session")
    keep_turns: int | str = KEEP_TURNS  # serving's transfer.host.keep_turns: 0, N or "auto" (retention NOTE 4)
    host_policy: str = "lru"  # host tiers: "lru" (LRUTier, serving's default policy) or another of serving's
    # policies (cache.PolicyTier)
    host_write: str = "victim"  # "victim" (default): NOTE 12 (serving's transfer.host.victim), where the
    # node has a host tier (without one, "through"); "through": every store writes the host tier too;
    # "back": NOTE 6; "victim-own": NOTE 12 without reads of node mates' devices (serving's with recall_ms 0)
    session_ends: bool = False  # clients mark each session's last turn (the API's session_end; retention)
    session_end_after: bool = False  # ... after its answer instead (DELETE /v1/sessions/{id}): written (NOTE 7)
    output_hint: str = "none"  # what clients tell the router of a request's output: OUTPUT_HINTS (NOTE 9)
    explain_misses: bool = False  # measure where each request's reuse is lost (NOTE 10; costs time)
    chunk_cache: bool = False  # engines cache each prefill chunk as it completes (NOTE 11; vLLM's)

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 0 or self.num_workers <= 0:
            raise ValueError("worker counts must be positive")
        if (self.num_prefill == 0) != (self.num_decode == 0):
            raise ValueError("P/D needs both prefill and decode workers")
        if self.workers_per_node <= 0 or self.device_blocks <= 0 or self.gpus_per_worker <= 0:
            raise ValueError("workers_per_node, gpus_per_worker and device_blocks must be positive")
        if self.host_blocks < 0 or self.disk_blocks < 0 or self.stats_period_s < 0 or self.macro_steps < 1:
            raise ValueError("tier sizes and stats_period_s must be >= 0, macro_steps >= 1")
        if self.node_compute_slots < 0:
            raise ValueError("node_compute_slots must be >= 0")
        if self.host_policy not in HOST_POLICIES:
            raise ValueError(f"host_policy must be one of {HOST_POLICIES}")
        if self.retention not in RETENTION_POLICIES:
            raise ValueError(f"retention must be one of {RETENTION_POLICIES}")
        if self.host_write not in HOST_WRITES:
            raise ValueError(f"host_write must be one of {HOST_WRITES}")
        if self.host_write.startswith("victim") and not self.host_blocks:
            self.host_write = "through"  # NOTE 12 keeps a host tier apart from the devices: none here
        if self.session_ends and self.retention == "lru":
            raise ValueError("session_ends needs a retention that tracks sessions (checkpoints or session)")
        if self.output_hint not in OUTPUT_HINTS:
            raise ValueError(f"output_hint must be one of {OUTPUT_HINTS}")
        if self.session_end_after and not self.session_ends:
            raise ValueError("session_end_after is how clients end sessions: it needs session_ends")

    def roles(self) -> list[str]:
        if self.num_prefill:
            return ["prefill"] * self.num_prefill + ["decode"] * self.num_decode
        return ["both"] * self.num_workers

    @property
    def num_engines(self) -> int:
        return self.num_prefill + self.num_decode if self.num_prefill else self.num_workers

    @property
    def num_gpus(self) -> int:
        return self.num_engines * self.gpus_per_worker

    def checkpoint_policy(self) -> CheckpointPolicy:
        return CheckpointPolicy(self.checkpoint_every_blocks, self.checkpoint_last_full_block,
                                self.checkpoint_prompt_end, self.learned_checkpoints)


ROUTER_COSTS = ("engine", "builtin")


def build_router(policy: str, index: PrefixIndex, clock: Callable[[], float], seed: int = 0,
                 router_config: dict | None = None, cost: CostModel | None = None,
                 router_costs: str = "engine") -> Any:
    """Our router ("state_aware") or a baseline from ``BASELINES``. ``router_costs`` "engine": the
    state-aware router prices time with ``cost``, the engine simulated (``router_config`` over it;
    ``disagg.router.calibration``); "builtin": with its scorers' built-in constants."""
    if router_costs not in ROUTER_COSTS:
        raise ValueError(f"router_costs must be one of {ROUTER_COSTS}, got {router_costs!r}")
    if policy == "state_aware":
        if router_costs == "engine" and cost is not None:
            router_config = with_engine_costs(router_config, cost.to_dict())
        return StateAwareRouter(index, router_config, clock=clock)
    if policy not in BASELINES:
        raise ValueError(f"unknown policy {policy!r}; known: state_aware, {', '.join(BASELINES)}")
    return BASELINES[policy](index, seed)


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]  # one per sent request (finish < 0: never finished)
    summary: dict[str, float]  # aggregate metrics of every request (see disagg.tools.sim.metrics)
    router_metrics: dict[str, Any] = field(default_factory=dict)  # router counters, if any
    num_events: int = 0  # index updates published
    num_gpus: int = 1  # GPUs of the cluster
    theoretical_hit: float | None = None  # benchmark definition, measured requests
    sim_events: int = 0  # events the simulator processed
    queue_avgs: dict[str, float] = field(default_factory=dict)  # prefill-capable worker -> time-avg queue
    prefill_work: dict[str, int] = field(default_factory=dict)  # prefill-capable worker -> tokens computed

    def bench_summary(self, usd_per_gpu_hour: float | None = None):
        """The benchmark's ``RunSummary`` of the measured (non-warm-up) requests."""
        return bench_summary(self.records, self.num_gpus, self.theoretical_hit, usd_per_gpu_hour)


class Simulator:
    def __init__(
        self,
        requests: list[SimRequest],
        policy: str = "state_aware",
        cluster: ClusterConfig | None = None,
        cost: CostModel | None = None,
        mode: str = "closed",
        lanes: int = 8,
        lane_stagger_s: float = 0.25,
        seed: int = 0,
        router_config: dict | None = None,
        replay: ReplayConfig | None = None,
        shared_ids: frozenset[int] | set[int] = frozenset(),
        router_costs: str = "engine",
    ):
        if mode not in ("closed", "open"):
            raise ValueError("mode must be 'closed' or 'open'")
        if not requests:
            raise ValueError("no requests to simulate")
        self.requests = requests
        self.cluster = c = cluster or ClusterConfig()
        self.cost = cost or CostModel()
        self.replay = replay or ReplayConfig(mode=mode, concurrency=lanes, lane_stagger_s=lane_stagger_s,
                                             session_order="session_id", seed=seed)
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = 0
        self.num_sim_events = 0
        self.index = PrefixIndex()
        self.router = build_router(policy, self.index, lambda: self.now, seed, router_config, self.cost, router_costs)
        self.records: list[RequestRecord] = []
        self.block_size = bs = requests[0].block_size
        if any(r.block_size != bs for r in requests):
            raise ValueError("every request of a simulated trace needs the same block_size")
        self.state = StateModel(self.cost, c.checkpoint_policy(), bs, self.index)
        self.digests = DigestCache(shared_ids)
        self._seen: dict[bytes, tuple[str, int]] = {}  # every digest sent -> the session that sent it first
        self._placement: dict[str, tuple[CheckpointPlacement, dict[tuple[str, int], int]]] = {}  # NOTE 5
        self._theory = [0, 0]  # measured requests: blocks seen before, blocks
        self._ends: dict[tuple[str, int], deque[int]] = {}  # (session, salt) -> recent unaligned prompt ends
        self._rid = 0
        self._snapshot: list[WorkerState] | None = None
        self.retention = SessionRetention(c.retention, client_ends=c.session_ends, keep_turns=c.keep_turns)
        self._ever_stored: set[bytes] = set()  # NOTE 10: every full block a prefill stored
        self._ckpt_kind: dict[bytes, str] = {}  # NOTE 10: checkpoint key -> the rule that last kept it
        self._build_cluster()
        self.driver = Driver(self, requests, self.replay)

    # ---- cluster -----------------------------------------------------------------
    def _build_cluster(self) -> None:
        c = self.cluster
        self.workers: dict[str, SimWorker] = {}
        self.host: dict[str, LRUTier | None] = {}
        self.disk: dict[str, LRUTier | None] = {}
        self.victims: dict[str, VictimHost] = {}  # NOTE 12: node -> its host tier's device counts
        roles = c.roles()
        spill_to = self._spill_targets(roles) if c.spill_to_pool else {}
        for i, role in enumerate(roles):
            wid, node = f"w{i:02d}", f"n{i // c.workers_per_node}"
            self.index.add_worker(wid, node)
            if node not in self.host:
                self._node_tiers(node, wid, spill_to.get(node))
            back = self.host[node] if c.host_write == "back" else None  # NOTE 6
            on_device = self.state.listener("device", wid, back, demoted_too=False)
            if node in self.victims and role != "prefill":  # NOTE 12: a decoding device's
                on_device = self.victims[node].device_listener(on_device)
            dev = LRUTier("device", c.device_blocks, on_device)
            self.workers[wid] = SimWorker(wid, node, role, self.cost, dev, self, c.macro_steps, self.block_size)
        self._live = [w.state for w in self.workers.values()]
        self._tiers = [w.device for w in self.workers.values()] + [
            t for t in (*self.host.values(), *self.disk.values()) if t is not None]
        self._node_workers: dict[str, list[SimWorker]] = {}
        for w in self.workers.values():
            self._node_workers.setdefault(w.node_id, []).append(w)

    def _node_tiers(self, node: str, reporter: str, spill: LRUTier | None = None) -> None:
        """``node``'s host and disk tiers (events reported as ``reporter``): host evictions go to
        the disk (state NOTE 3), and the last of the two spills to ``spill`` (NOTE 4)."""
        c = self.cluster
        disk = LRUTier("disk", c.disk_blocks, self.state.listener("disk", reporter, spill, demoted_too=False)) \
            if c.disk_blocks else None
        self.disk[node] = disk
        after_host = disk if disk is not None else spill  # (an empty tier is falsy: no ``or``)
        listener = self.state.listener("host", reporter, after_host, demoted_too=disk is not None)
        if not c.host_blocks:
            self.host[node] = None
            return
        if c.host_policy == "lru":
            host = LRUTier("host", c.host_blocks, listener)
        else:
            host = PolicyTier("host", c.host_blocks, c.host_policy, listener)
        self.host[node] = host
        if c.host_write.startswith("victim"):  # NOTE 12; the index told of the node's view only where workers read it
            publish = self.state.listener("host", reporter) if c.host_write == "victim" else None
            victim = self.victims[node] = VictimHost(host, self.state.size_of, publish)
            host.on_event = victim.host_listener(listener)

    def _node_tiers_of(self, w: SimWorker, node: str = "") -> tuple[LRUTier | NodeView | None, LRUTier | None]:
        """The host and disk tiers ``w`` reads on ``node`` (default: its own); with victim host tiers
        (NOTE 12) the host tier is read with the node's decoding devices, ``w``'s own aside."""
        node = node or w.node_id
        host = self.host[node]
        if self.cluster.host_write == "victim":
            host = NodeView(host, [o.device for o in self._node_workers[node] if o is not w and o.role != "prefill"])
        return host, self.disk[node]

    def _spill_targets(self, roles: list[str]) -> dict[str, LRUTier]:
        """NOTE 4: node -> the host tier its evictions spill to, for the nodes without prefill
        workers; builds the tiers of the nodes with them (node k's first worker reports)."""
        per = self.cluster.workers_per_node
        nodes = [f"n{k}" for k in range(-(-len(roles) // per))]
        pool = [n for k, n in enumerate(nodes) if "prefill" in roles[k * per:(k + 1) * per]]
        if not pool or not self.cluster.host_blocks:
            return {}
        for n in pool:
            self._node_tiers(n, f"w{nodes.index(n) * per:02d}")
        return {n: self.host[pool[k % len(pool)]] for k, n in enumerate(n for n in nodes if n not in pool)}

    def node_slowdown(self, w: SimWorker) -> float:
        """Step-time factor of ``w`` from the busy engines of its node now (1 without compute sharing).

        n busy engines (``w`` included) take max(1, n / slots) each; one busy engine runs as it
        was timed alone (a profile's points and a bench fit already hold the machine's state then,
        so a slots figure below 1 from a loaded machine must not slow it a second time). The
        factor holds while n does (processor sharing: see ``busy_changed``, NOTE 5 of the worker).
        """
        slots = self.cluster.node_compute_slots
        if slots <= 0:
            return 1.0
        busy = sum(1 for x in self._node_workers[w.node_id] if x.busy)
        return max(1.0, busy / slots) if busy > 1 else 1.0

    def busy_changed(self, w: SimWorker, now: float) -> None:
        """``w`` started or ended its work: the busy engines of its node continue at the new rate."""
        if self.cluster.node_compute_slots <= 0:
            return
        rate = 1.0 / self.node_slowdown(w)
        for x in self._node_workers[w.node_id]:
            x.rerate(now, rate)

    def schedule(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        assert t >= self.now - 1e-9, "event scheduled in the past"
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def worker_states(self) -> list[WorkerState]:
        if self.cluster.stats_period_s > 0 and self._snapshot is not None:
            return self._snapshot
        return self._live

    def _refresh_stats(self, now: float) -> None:
        self._snapshot = [copy.copy(s) for s in self._live]
        if self._heap:
            self.schedule(now + self.cluster.stats_period_s, self._refresh_stats)

    # ---- request life ----------------------------------------------------------
    def send(self, now: float, req: SimRequest, salt: int = 0, lane: int = -1, warmup: bool = False,
             last: bool = False) -> None:
        """A client sends ``req`` (``last``: its session's last turn): it reaches the router after
        the serving path's overhead."""
        self._rid += 1
        rid = f"r{self._rid:06d}"
        rec = RequestRecord(rid, req.session_id, req.turn, req.input_length, req.output_length, now,
                            lane=lane, salt=salt, warmup=warmup, last_turn=last)
        self.records.append(rec)
        delay = self.cost.request_overhead_s
        if delay > 0:
            self.schedule(now + delay, self.arrive, req, rec)
        else:
            self.arrive(now, req, rec)

    def arrive(self, now: float, req: SimRequest, rec: RequestRecord | None = None) -> None:
        if rec is None:  # called directly (tests, earlier callers): sent now
            self._rid += 1
            rec = RequestRecord(f"r{self._rid:06d}", req.session_id, req.turn, req.input_length,
                                req.output_length, now)
            self.records.append(rec)
        bs, plen = self.block_size, req.input_length
        skey = (req.session_id, rec.salt)
        digests = self.digests.digests(req.session_id, rec.salt, req.hash_ids, -(-plen // bs))
        nfull = plen // bs
        flags = list(map(self._seen.__contains__, digests))
        try:
            lead = flags.index(False)
        except ValueError:
            lead = len(flags)
        rec.theoretical_tokens = min(min(lead, nfull) * bs, plen - 1)
        if not rec.warmup:
            self._theory[0] += sum(flags)
            self._theory[1] += len(flags)
        seen = self._seen
        for d in digests[lead:]:
            if d not in seen:
                seen[d] = skey
        self.retention.on_prompt(skey, digests, nfull, lead, self._tiers)
        probes = []
        ends = self._ends.get(skey)
        if ends:
            for p in ends:
                k, off = divmod(p, bs)
                if p < plen and k < len(digests):
                    probes.append((p, tail_digest(digests[k], off)))
        ps = PromptState(digests, plen, bs, probes)
        c = self.cluster
        rr = RouteRequest(rec.request_id, req.session_id, digests[:nfull], plen, bs,
                          tail_probes=ps.tail_probes(),
                          output_len_hint=req.output_length if c.output_hint == "exact" else 0,
                          session_end=rec.last_turn and c.session_ends and not c.session_end_after)
        decision = self.router.route(rr, self.worker_states())
        self.router.on_routed(rr, decision)
        target = self.workers[decision.prefill_target]
        dec = self.workers[decision.decode_worker]
        res = self._resume(ps, target, dec, decision.state_node)
        if c.explain_misses:
            self._explain(ps, rec)
            rec.resumed_from = self._ckpt_kind.get(res.key, "engine") if res.key is not None else ""
        rec.predicted_tokens, rec.cached_tokens, rec.cached_tier = decision.predicted_cached_tokens, res.tokens, res.tier
        rec.prefill_worker, rec.decode_worker, rec.reason = target.worker_id, dec.worker_id, decision.reason
        job = SimJob(rec.request_id, plen, req.output_length, ps, rec, req, res.tokens, res.tokens,
                     None if dec is target else dec)
        if self.state.policy.learned:
            placed = self._learned_points(dec.worker_id, skey, digests, plen, lead, res.tokens,
                                          decision.checkpoint_back)
            job.extra = tuple(p for p, _ in placed)
            bs = self.block_size
            if c.speculative_first:
                job.speculative = [_K + digests[p // bs - 1] for p, kind in placed if kind == "start"]
            if c.explain_misses:
                job.extra_kinds = {_K + digests[p // bs - 1]: kind for p, kind in placed}
        if dec is not target:  # it decodes on dec after the pool's prefill: dec counts it inbound till then
            dec.expect(now, plen)
        if res.load_s > 0:  # the state loads off the engine's step loop
            self.schedule(now + res.load_s, target.enqueue_prefill, job)
        else:
            target.enqueue_prefill(now, job)

    def _learned_points(self, wid: str, skey: tuple[str, int], digests: list[bytes], plen: int, lead: int,
                        resume: int, hint: tuple[int, ...] | None = None) -> tuple[tuple[int, str], ...]:
        """NOTE 5: where the prefill keeps extra checkpoints, as the flow of decode-side worker ``wid``
        plans them (its placement learns from the follow-ups it serves; the router's distances ``hint``,
        in tokens, replace its own)."""
        pair = self._placement.get(wid)
        if pair is None:
            pair = self._placement[wid] = (CheckpointPlacement(self.block_size), {})
        placement, last_len = pair
        bs = self.block_size
        bound = min(lead * bs, plen - 1)
        prev = last_len.get(skey)
        if prev is not None:
            placement.observe(prev, min(bound, prev))
        last_len[skey] = plen
        branch = lead * bs if lead and lead * bs < plen and self._seen[digests[lead - 1]] != skey else 0
        back = None if hint is None else [t // bs for t in hint]
        return placement.placed(plen, resume, branch, bound, back)

    def _resume(self, ps: PromptState, target: SimWorker, dec: SimWorker, named: str = "") -> Resume:
        """Where ``target`` resumes ``ps``: its device and node tiers or, with ``peer_reads``, the
        node the router named (a moved session's last node) or else, for a prefill of another node's
        decode worker, that node's tiers, over the remote link, whichever resumes further (NOTE 1)."""
        tiers = self._node_tiers_of(target)
        peer_node = named if named and named != target.node_id else \
            dec.node_id if dec is not target and dec.node_id != target.node_id else ""
        if self.cluster.peer_reads and peer_node:
            peer_tiers = self._node_tiers_of(target, peer_node)
            if any(t is not None for t in peer_tiers):
                own = self.state.resume(ps, target.device, *tiers, dry=True)
                peer = self.state.resume(ps, target.device, *peer_tiers, remote=True, dry=True)
                if peer.tokens > own.tokens:
                    return self.state.resume(ps, target.device, *peer_tiers, remote=True)
        return self.state.resume(ps, target.device, *tiers)

    def _explain(self, ps: PromptState, rec: RequestRecord) -> None:
        """NOTE 10: where ``rec``'s prompt could have resumed when it was placed."""
        state = self.state
        rec.reach_tokens = max(state.resume(ps, w.device, *self._node_tiers_of(w), dry=True).tokens
                               for w in self.workers.values())
        tiers, held = self._tiers, 0
        full = ps.full()
        for d in full:
            if not any(d in t for t in tiers):
                break
            held += 1
        rec.stored_tokens = held * self.block_size
        rec.gap_stored_before = held < len(full) and full[held] in self._ever_stored

    def admit(self, job: SimJob, w: SimWorker, now: float) -> int:
        """NOTE 8: ``job`` gets its first step on ``w``: the tokens its device resumes now, past
        what the job planned (0 when it planned a resume: the engine imports that state)."""
        rec = job.record
        rec.admitted = now
        if job.cached:
            return 0
        res = self.state.resume(job.prompt, w.device, None, None)
        if not res.tokens:
            return 0
        rec.cached_tokens, rec.cached_tier = res.tokens, res.tier
        if self.cluster.explain_misses:
            rec.resumed_from = self._ckpt_kind.get(res.key, "engine")
        return res.tokens

    def chunk_done(self, job: SimJob, w: SimWorker, now: float) -> None:
        """NOTE 11: a chunk of ``job``'s prefill on ``w`` completed; the prompt is computed up to
        ``job.computed`` (a block boundary)."""
        if not self.cluster.chunk_cache:
            return
        blocks = self.state.store_chunk(job.prompt, job.computed, w.device)
        rec = job.record
        if rec.chunks is None:
            rec.chunks = []
        rec.chunks.append((now, len(blocks)))
        if self.cluster.explain_misses:
            self._ever_stored.update(blocks)
            if blocks:
                self._ckpt_kind[_K + blocks[-1]] = "chunk"
                rec.kept += ("chunk",)

    def prefill_done(self, job: SimJob, w: SimWorker, now: float) -> None:
        ps = job.prompt
        job.record.stored = now
        if self.cluster.explain_misses:
            self._ever_stored.update(ps.full())
        job.ckpts = self.state.store(ps, job.cached, w.device,
                                     self._write_host(w, job.record, job.decode_worker is not None), extra=job.extra)
        if self.cluster.explain_misses:  # NOTE 10: which rule kept each checkpoint
            kinds = job.extra_kinds or {}
            kept = [kinds.get(k, "engine") for k in job.ckpts]
            self._ckpt_kind.update(zip(job.ckpts, kept, strict=True))
            job.record.kept += tuple(kept)
        skey = (job.record.session_id, job.record.salt)
        self.retention.on_store(skey, job.ckpts, self._tiers)
        if job.decode_worker is None and self.cluster.speculative_first:  # prefilled where it decodes: its
            # speculative points go first there (serving's transfer.host.speculative_first)
            self.retention.on_speculative(job.speculative, (self.host[w.node_id], self.disk[w.node_id]))
        if job.record.cached_tier == "remote" and job.decode_worker is not None:  # a peer read (NOTE 1): the
            # session lives on its decode node (a local prefill that read the named node brings it here)
            self.retention.on_borrowed(skey, job.ckpts, [w.device, self.host[w.node_id], self.disk[w.node_id]])
            self.retention.on_placed(skey, [job.decode_worker.device])
        else:
            self.retention.on_placed(skey, [w.device] if job.decode_worker is None
                                     else [w.device, job.decode_worker.device])
        if self.cluster.checkpoint_prompt_end:
            end = self.state.prompt_end_key(ps)
            if end is not None:
                self._ends.setdefault((job.record.session_id, job.record.salt), deque(maxlen=4)).append(end[0])
        if job.decode_worker is None:
            self._start_decode(job, w, now)
            return
        d = job.decode_worker
        cost = self.cost
        nbytes = cost.state_bytes(job.prompt_len)
        first = now + cost.transfer_time(nbytes, "host") + cost.disagg_overhead_s  # publish, then the handle
        job.record.first_token = first
        tier = "host" if d.node_id == w.node_id else "remote"
        held = d.device.present(ps.full())  # NOTE 2: the hand-off skips the blocks D's device holds
        try:
            skip = held.index(False)
        except ValueError:
            skip = len(held)
        moved = cost.state_bytes(job.prompt_len - skip * self.block_size)
        self.schedule(first + cost.transfer_time(moved, tier), self._arrive_decode, job, d)

    def _write_host(self, w: SimWorker, rec: RequestRecord, handing_off: bool = False) -> LRUTier | None:
        """The host tier a store on ``w`` writes through to: its node's, or none with write-back
        (NOTE 6), or for a session's last turn that its client marked (NOTE 7), unless the state is
        a hand-off's, which the decode worker reads from there."""
        if handing_off:
            return self.host[w.node_id]
        c = self.cluster
        if c.host_write == "back" or (rec.last_turn and c.session_ends and not c.session_end_after):
            return None
        return self.host[w.node_id]

    def _arrive_decode(self, now: float, job: SimJob, d: SimWorker) -> None:
        d.expect(now, job.prompt_len, -1)
        self.state.store(job.prompt, 0, d.device, self._write_host(d, job.record), job.ckpts)
        p = self.workers[job.record.prefill_worker]
        if p.node_id != d.node_id:  # NOTE 3: the session lives on D's node now
            self.retention.on_handed_off((job.record.session_id, job.record.salt),
                                         [self.host[p.node_id], self.disk[p.node_id]])
        self._start_decode(job, d, now)

    def _start_decode(self, job: SimJob, w: SimWorker, now: float) -> None:
        rec = job.record
        if rec.first_token < 0:
            rec.first_token = now
        job.decode_from = now
        if job.output_len <= 1:
            self.finish(job, w, max(now, rec.first_token))
            return
        job.context, job.remaining = job.prompt_len + 1, job.output_len - 1
        w.enqueue_decode(now, job)

    def finish(self, job: SimJob, w: SimWorker, now: float) -> None:
        rec = job.record
        rec.finish = now
        # served: the stats copies a router reads with stats_period_s, taken before its end, stop counting
        # it (disagg.router.loads NOTE 6). Live stats are every policy's same view of the workers, left
        # undiscounted (a turn sent at the very instant its previous one ends reads its worker before
        # the worker publishes that end, whatever the policy)
        served = (job.decode_from, now) if self.cluster.stats_period_s > 0 else None
        self.router.on_finished(job.rid, job.cached, job.output_len, served)
        self.driver.on_finished(now, rec.lane)

    def session_done(self, session_id: str, salt: int) -> None:
        """A closed-loop session ended: drop its cached digests (and demote its state, with retention)."""
        self.retention.on_session_end((session_id, salt), self._tiers)
        c = self.cluster
        if c.session_ends and c.session_end_after and hasattr(self.router, "end_session"):  # the DELETE's
            self.router.end_session(session_id)  # (the in-band mark: RouteRequest.session_end)
        self.digests.forget(session_id, salt)
        self._ends.pop((session_id, salt), None)

    # ---- run ------------------------------------------------------------------------
    def run(self, until: float = math.inf) -> SimResult:
        self.driver.start()
        if self.cluster.stats_period_s > 0:
            self.schedule(0.0, self._refresh_stats)
        heap, pop = self._heap, heapq.heappop
        n = 0
        collecting = gc.isenabled()
        gc.disable()  # see "Garbage collection" above
        try:
            while heap:
                t, _, fn, args = pop(heap)
                if t > until:
                    break
                self.now = t
                fn(t, *args)
                n += 1
        finally:
            if collecting:
                gc.enable()
        self.num_sim_events += n
        return self._result()

    def _result(self) -> SimResult:
        end = self.now
        done = [r for r in self.records if r.finish >= 0]
        t0 = min((r.arrival for r in done), default=0.0)
        span = max(end - t0, 1e-9)
        qavg, work = {}, {}
        for w in self.workers.values():
            w._account(end)
            if w.role in ("prefill", "both"):
                qavg[w.worker_id] = w.q_area / span
                work[w.worker_id] = w.prefill_tokens_done
        summary = summarize(self.records, qavg, work, self.cluster.num_gpus)
        metrics = self.router.metrics.snapshot() if hasattr(self.router, "metrics") else {}
        seen, total = self._theory
        return SimResult(list(self.records), summary, metrics, self.state.num_events, self.cluster.num_gpus,
                         seen / total if total else None, self.num_sim_events, qavg, work)
