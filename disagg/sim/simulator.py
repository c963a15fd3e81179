"""Discrete-event simulator: a trace, a cluster of simulated engines, one router.

Event queue: a heap of (time, seq, callback, args); time in float seconds,
seq breaks ties in scheduling order, so a run is a pure function of its
inputs and seed.

A request's path (the real system's, with costs from ``CostModel``):

    arrival --route--> prefill worker P: resume (load missing blocks from host /
    disk: bytes / bw + latency) -> chunked prefill -> store blocks + KDA
    checkpoints (device, write-through to the node's host tier)
      local (P == D):  first token at prefill end, join P's decode batch
      disagg (P != D): state moves to D (same node: host link, else remote link);
                       first token when it lands, join D's decode batch
    last token -> finish -> (closed loop) next turn after the think time

Every cache change is published as a kv_transfer ``StoreEvent`` into the
router's ``PrefixIndex``, so the router sees what a deployed router would
see (and the index's event adapter is exercised on every run). Checkpoints are taken at every
``checkpoint_every_blocks``-th block boundary and at the prompt's last full
block (resume points are block-aligned in the simulator).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from disagg.router.baselines import BASELINES
from disagg.router.index import PrefixIndex
from disagg.router.router import StateAwareRouter
from disagg.router.types import RouteRequest, WorkerState
from disagg.sim.cache import LRUTier
from disagg.sim.cost_model import CostModel
from disagg.sim.metrics import RequestRecord, summarize
from disagg.sim.worker import SimJob, SimWorker
from disagg.sim.workload import SimRequest, chain_digests
from kv_transfer.events import StoreEvent

TIER_NAMES = ("device", "host", "disk")


@dataclass(slots=True)
class ClusterConfig:
    num_workers: int = 4  # aggregated workers (used when num_prefill == num_decode == 0)
    num_prefill: int = 0  # P/D: prefill workers
    num_decode: int = 0  # P/D: decode workers
    workers_per_node: int = 8  # workers sharing a host (and disk) tier
    device_blocks: int = 4096  # device cache per worker, in blocks
    host_blocks: int = 65536  # host tier per node (0 = none)
    disk_blocks: int = 0  # disk tier per node (0 = none)
    checkpoint_every_blocks: int = 16  # periodic KDA checkpoints
    stats_period_s: float = 0.0  # router sees stats this stale (0 = live)
    macro_steps: int = 16  # decode steps per event at most

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 0 or self.num_workers <= 0:
            raise ValueError("worker counts must be positive")
        if (self.num_prefill == 0) != (self.num_decode == 0):
            raise ValueError("P/D needs both prefill and decode workers")
        if self.workers_per_node <= 0 or self.device_blocks <= 0:
            raise ValueError("workers_per_node and device_blocks must be positive")

    def roles(self) -> list[str]:
        if self.num_prefill:
            return ["prefill"] * self.num_prefill + ["decode"] * self.num_decode
        return ["both"] * self.num_workers


def build_router(policy: str, index: PrefixIndex, clock: Callable[[], float], seed: int = 0,
                 router_config: dict | None = None) -> Any:
    """Our router ("state_aware") or a baseline from ``BASELINES``."""
    if policy == "state_aware":
        return StateAwareRouter(index, router_config, clock=clock)
    if policy not in BASELINES:
        raise ValueError(f"unknown policy {policy!r}; known: state_aware, {', '.join(BASELINES)}")
    return BASELINES[policy](index, seed)


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]  # one per finished request
    summary: dict[str, float]  # aggregate metrics (see disagg.sim.metrics)
    router_metrics: dict[str, Any] = field(default_factory=dict)  # router counters, if any
    num_events: int = 0  # store events published


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
    ):
        if mode not in ("closed", "open"):
            raise ValueError("mode must be 'closed' or 'open'")
        self.requests = requests
        self.cluster = cluster or ClusterConfig()
        self.cost = cost or CostModel()
        self.mode, self.lanes, self.lane_stagger_s = mode, lanes, lane_stagger_s
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = 0
        self.index = PrefixIndex()
        self.router = build_router(policy, self.index, lambda: self.now, seed, router_config)
        self.records: list[RequestRecord] = []
        self.num_events = 0
        self._seen: set[bytes] = set()
        self._rid = 0
        self._snapshot: list[WorkerState] | None = None
        bs = requests[0].block_size if requests else 256
        self.block_size = bs
        self.ckpt_units = max(1, round(self.cost.checkpoint_bytes / (bs * self.cost.bytes_per_token)))
        self._build_cluster()

    # ---- cluster -----------------------------------------------------------------
    def _build_cluster(self) -> None:
        c = self.cluster
        self.workers: dict[str, SimWorker] = {}
        self.host: dict[str, LRUTier | None] = {}
        self.disk: dict[str, LRUTier | None] = {}
        for i, role in enumerate(c.roles()):
            wid, node = f"w{i:02d}", f"n{i // c.workers_per_node}"
            self.index.add_worker(wid, node)
            if node not in self.host:
                self.disk[node] = LRUTier("disk", c.disk_blocks, self._tier_cb("disk", wid)) if c.disk_blocks else None
                self.host[node] = LRUTier("host", c.host_blocks, self._tier_cb("host", wid)) if c.host_blocks else None
            dev = LRUTier("device", c.device_blocks, self._tier_cb("device", wid))
            self.workers[wid] = SimWorker(wid, node, role, self.cost, dev, self, macro_steps=c.macro_steps)

    def _tier_cb(self, tier: str, wid: str) -> Callable[[str, str, bytes], None]:
        node = f"n{int(wid[1:]) // self.cluster.workers_per_node}"

        def cb(op: str, kind: str, digest: bytes) -> None:
            self.index.apply(StoreEvent(op, f"{kind}:{digest.hex()}", kind, tier, wid, timestamp=self.now))
            self.num_events += 1
            if tier == "host" and op == "evicted" and self.disk.get(node) is not None:
                self.disk[node].put((kind, digest), self._size(kind))

        return cb

    def _size(self, kind: str) -> int:
        return self.ckpt_units if kind == "kda" else 1

    def schedule(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        assert t >= self.now - 1e-9, "event scheduled in the past"
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def worker_states(self) -> list[WorkerState]:
        if self.cluster.stats_period_s > 0 and self._snapshot is not None:
            return self._snapshot
        return self._take_snapshot()

    def _take_snapshot(self) -> list[WorkerState]:
        return [
            WorkerState(
                worker_id=w.worker_id, role=w.role, node_id=w.node_id,
                queued_prefill_tokens=w.queued_prefill_tokens,
                queued_prefill_requests=len(w.prefill_q),
                running_decode_tokens=w.decode_tokens(),
                running_decode_requests=len(w.decode_run) + len(w.decode_wait),
                cache_utilization=min(w.device.utilization(), 1.0),
                updated_at=self.now,
            )
            for w in self.workers.values()
        ]

    def _refresh_stats(self, now: float) -> None:
        self._snapshot = self._take_snapshot()
        if self._heap:
            self.schedule(now + self.cluster.stats_period_s, self._refresh_stats)

    # ---- cache ground truth ----------------------------------------------------
    def _tier_of(self, w: SimWorker, key: tuple[str, bytes]) -> int | None:
        if key in w.device:
            return 0
        host, disk = self.host[w.node_id], self.disk[w.node_id]
        if host is not None and key in host:
            return 1
        if disk is not None and key in disk:
            return 2
        return None

    def resume(self, w: SimWorker, digests: list[bytes], prompt_len: int) -> tuple[int, str | None, float]:
        """Resume a prompt on ``w``: (tokens, slowest tier, load seconds); loads into device."""
        bs = self.block_size
        slow, missing = 0, []
        best: tuple[int, int, int, int | None] = (0, 0, 0, None)  # (p, tier, n_missing, ckpt tier)
        for i, d in enumerate(digests):
            t = self._tier_of(w, ("mla", d))
            if t is None:
                break
            if t:
                missing.append((("mla", d), t))
                slow = max(slow, t)
            p = (i + 1) * bs
            if p >= prompt_len:
                break
            tk = self._tier_of(w, ("kda", d))
            if tk is not None:
                best = (p, max(slow, tk), len(missing), tk)
        p, tier, n_missing, tk = best
        if p == 0:
            return 0, None, 0.0
        loads = missing[:n_missing]
        if tk:
            loads.append((("kda", digests[p // bs - 1]), tk))
        per_tier: dict[int, float] = {}
        for key, t in loads:
            size = self.cost.checkpoint_bytes if key[0] == "kda" else bs * self.cost.bytes_per_token
            per_tier[t] = per_tier.get(t, 0.0) + size
        load_s = sum(self.cost.transfer_time(nb, TIER_NAMES[t]) for t, nb in per_tier.items())
        for i in range(p // bs):
            w.device.put(("mla", digests[i]))
        w.device.put(("kda", digests[p // bs - 1]), self.ckpt_units)
        return p, TIER_NAMES[tier], load_s

    def _store(self, w: SimWorker, digests: list[bytes], prompt_len: int, from_pos: int) -> None:
        """Blocks of the prompt + checkpoints after ``from_pos`` on w's device and node host."""
        bs, every = self.block_size, self.cluster.checkpoint_every_blocks
        host = self.host[w.node_id]
        n = len(digests)
        for i, d in enumerate(digests):
            w.device.put(("mla", d))
            if host is not None and (i + 1) * bs > from_pos:
                host.put(("mla", d))
            p = (i + 1) * bs
            if p > from_pos and p < prompt_len and ((i + 1) % every == 0 or i == n - 1):
                w.device.put(("kda", d), self.ckpt_units)
                if host is not None:
                    host.put(("kda", d), self.ckpt_units)

    # ---- request life ----------------------------------------------------------
    def arrive(self, now: float, req: SimRequest) -> None:
        self._rid += 1
        rid = f"r{self._rid:06d}"
        digests = chain_digests(req.hash_ids, req.num_full_blocks)
        n = 0
        for d in digests:
            if d not in self._seen:
                break
            n += 1
        self._seen.update(digests)
        rec = RequestRecord(rid, req.session_id, req.turn, req.input_length, req.output_length, now,
                            theoretical_tokens=min(n * req.block_size, req.input_length - 1))
        rr = RouteRequest(rid, req.session_id, digests, req.input_length, req.block_size,
                          output_len_hint=req.output_length)
        decision = self.router.route(rr, self.worker_states())
        self.router.on_routed(rr, decision)
        target = self.workers[decision.prefill_target]
        dec = self.workers[decision.decode_worker]
        cached, tier, load_s = self.resume(target, digests, req.input_length)
        rec.predicted_tokens, rec.cached_tokens, rec.cached_tier = decision.predicted_cached_tokens, cached, tier
        rec.prefill_worker, rec.decode_worker, rec.reason = target.worker_id, dec.worker_id, decision.reason
        job = SimJob(rid, req.input_length, req.output_length, digests, rec, cached, cached, load_s,
                     None if dec is target else dec)
        job.record = (rec, req)
        self.records.append(rec)
        target.enqueue_prefill(job, now)

    def prefill_done(self, job: SimJob, w: SimWorker, now: float) -> None:
        self._store(w, job.digests, job.prompt_len, job.cached)
        if job.decode_worker is None:
            self._start_decode(job, w, now)
            return
        d = job.decode_worker
        tier = "host" if d.node_id == w.node_id else "remote"
        t = self.cost.transfer_time(self.cost.state_bytes(job.prompt_len), tier)
        self.schedule(now + t, self._arrive_decode, job, d)

    def _arrive_decode(self, now: float, job: SimJob, d: SimWorker) -> None:
        self._store(d, job.digests, job.prompt_len, 0)
        self._start_decode(job, d, now)

    def _start_decode(self, job: SimJob, w: SimWorker, now: float) -> None:
        rec, _ = job.record
        rec.first_token = now
        job.decoded, job.context = 1, job.prompt_len + 1
        if job.output_len <= 1:
            self.finish(job, w, now)
        else:
            w.enqueue_decode(job, now)

    def finish(self, job: SimJob, w: SimWorker, now: float) -> None:
        rec, req = job.record
        rec.finish = now
        self.router.on_finished(job.rid, job.cached)
        if self.mode == "closed":
            self._next_turn(now, req.session_id)

    # ---- workload drivers ---------------------------------------------------------
    def _next_turn(self, now: float, session_id: str) -> None:
        turns = self._sessions[session_id]
        if turns:
            req = turns.pop(0)
            self.schedule(now + req.delay_ms / 1000.0, self.arrive, req)
        elif self._pending_sessions:
            sid = self._pending_sessions.pop(0)
            self._next_turn(now, sid)

    def run(self) -> SimResult:
        if self.mode == "closed":
            self._sessions: dict[str, list[SimRequest]] = {}
            for r in sorted(self.requests, key=lambda r: (r.session_id, r.turn)):
                self._sessions.setdefault(r.session_id, []).append(r)
            self._pending_sessions = list(self._sessions)
            for lane in range(min(self.lanes, len(self._pending_sessions))):
                sid = self._pending_sessions.pop(0)
                req = self._sessions[sid].pop(0)
                self.schedule(lane * self.lane_stagger_s, self.arrive, req)
        else:
            for r in sorted(self.requests, key=lambda r: r.timestamp_ms):
                self.schedule(r.timestamp_ms / 1000.0, self.arrive, r)
        if self.cluster.stats_period_s > 0:
            self.schedule(0.0, self._refresh_stats)
        while self._heap:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(t, *args)
        return self._result()

    def _result(self) -> SimResult:
        end = self.now
        t0 = min((r.arrival for r in self.records), default=0.0)
        span = max(end - t0, 1e-9)
        qavg, work = {}, {}
        for w in self.workers.values():
            w._account(end)
            if w.role in ("prefill", "both"):
                qavg[w.worker_id] = w.q_area / span
                work[w.worker_id] = w.prefill_tokens_done
        summary = summarize(self.records, qavg, work, len(self.workers))
        metrics = self.router.metrics.snapshot() if hasattr(self.router, "metrics") else {}
        return SimResult(list(self.records), summary, metrics, self.num_events)
