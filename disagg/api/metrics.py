"""Prometheus metrics of the serving edge.

Per-request figures (TTFT, ITL, E2E, prompt tokens by the source of their
state, transfer bytes and time) are observed as responses stream; tier and
router figures are copied from the backend's ``stats()`` at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from disagg.reuse.misses import REASONS

SOURCES = ("device", "host", "disk", "peer", "computed")
_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


SPILL_OUTCOMES = ("spilled", "refused", "dropped", "no_target")  # kv_transfer.spill counters
# disagg_engine_kept_states{figure}: the reference engine's stats key of each
KEPT_FIGURES = {"pages": "checkpoint_blocks", "dropped": "checkpoints_dropped", "unbudgeted": "checkpoints_unbudgeted"}


class ServingMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.ttft = Histogram("disagg_ttft_seconds", "Time to first token", buckets=_LAT, registry=r)
        self.itl = Histogram("disagg_itl_seconds", "Inter-token latency", buckets=_LAT, registry=r)
        self.e2e = Histogram("disagg_e2e_seconds", "Request latency", buckets=_LAT, registry=r)
        self.requests = Counter("disagg_requests", "Finished requests", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("disagg_prompt_tokens", "Prompt tokens by where their state came from",
                                     ["source"], registry=r)
        self.reuse_misses = Counter("disagg_reuse_miss_tokens", "Prompt tokens computed although an infinite cache "
                                    "would have reused them, by reason (disagg.reuse.misses)", ["reason"], registry=r)
        self.reuse_bound = Counter("disagg_reuse_bound_tokens", "Prompt tokens an infinite cache would have reused "
                                   "(the server's view; its difference to the cached tokens is the misses' sum)",
                                   registry=r)
        self.generation_tokens = Counter("disagg_generation_tokens", "Generated tokens", registry=r)
        self.transfer_bytes = Counter("disagg_transfer_bytes", "State bytes loaded by decode/prefill", registry=r)
        self.transfer_seconds = Histogram("disagg_transfer_seconds", "State load latency", buckets=_LAT, registry=r)
        self.tier_used = Gauge("disagg_tier_used_bytes", "Bytes held per tier", ["tier"], registry=r)
        self.tier_capacity = Gauge("disagg_tier_capacity_bytes", "Capacity per tier", ["tier"], registry=r)
        self.tier_objects = Gauge("disagg_tier_objects", "Objects held per tier", ["tier"], registry=r)
        self.evictions = Gauge("disagg_tier_evictions", "Evictions per tier (cumulative)", ["tier"], registry=r)
        self.demoted = Gauge("disagg_tier_demoted", "Objects put first in eviction order per tier: superseded "
                             "checkpoints of sessions (transfer.host.keep_checkpoints; cumulative)", ["tier"],
                             registry=r)
        self.spill_objects = Gauge("disagg_spill_objects", "Evicted objects of nodes without prefill replicas, "
                                   "by what became of them: spilled to a prefill node's host tier, refused there, "
                                   "dropped (queue full) or no_target (no pool); summed over nodes, cumulative",
                                   ["outcome"], registry=r)
        self.spill_bytes = Gauge("disagg_spill_bytes", "Bytes spilled to prefill nodes' host tiers (cumulative)",
                                 registry=r)
        self.checksum_failures = Gauge("disagg_checksum_failures", "Objects dropped on checksum failure (cumulative)",
                                       registry=r)
        self.route_cached = Gauge("disagg_route_cached_tokens", "Cached tokens the router predicted vs the "
                                  "engines realized, over finished routed requests (cumulative)", ["kind"],
                                  registry=r)
        self.engine_requests = Gauge("disagg_engine_requests", "Requests in the engines by role and state",
                                     ["role", "state"], registry=r)
        self.kept_states = Gauge("disagg_engine_kept_states", "The reference engines' kept KDA states by role: "
                                 "pages they hold now (of the device tier's), and, cumulative, points not kept "
                                 "or given back for room (dropped) and held end states kept outside the budget "
                                 "for want of room (unbudgeted); engine NOTE 10", ["role", "figure"], registry=r)
        self.route_decisions = Gauge("disagg_route_decisions", "Router decisions by reason (cumulative)",
                                     ["reason"], registry=r)
        self.route_pool_views = Gauge("disagg_route_pool_views", "Decode-pool placements that read their prefill "
                                      "pool's view (read) or found none (missing), cumulative", ["outcome"],
                                      registry=r)
        self.route_overridden = Gauge("disagg_route_overridden", "Routed requests Serve ran on another replica "
                                      "than the router's pick (cumulative)", registry=r)
        self.rejections = Counter("disagg_http_rejections", "Requests refused at the edge by reason "
                                  "(unauthorized, body_too_large, rate_limit_exceeded, concurrency_limit_exceeded, "
                                  "overloaded)", ["reason"], registry=r)
        self.gate_running = Gauge("disagg_http_running", "Generations admitted and not yet finished", registry=r)
        self.gate_queued = Gauge("disagg_http_queued", "Generations waiting for a running slot", registry=r)
        self.gate_shed = Gauge("disagg_http_shed", "Generations shed (queue full or waited too long), cumulative",
                               registry=r)
        self.worker_events = Gauge("disagg_worker_events", "Worker events by role, summed over live replicas "
                                   "(remote_prefills, prefill_failures, load_failures, load_timeouts, ...)",
                                   ["role", "event"], registry=r)
        self.resumed_streams = Gauge("disagg_resumed_streams", "Streams continued on another decode replica "
                                     "after theirs was lost (cumulative)", registry=r)
        self.resume_timeouts = Gauge("disagg_stream_resume_timeouts", "Streams ended with a 503 because no decode "
                                     "replica took them back within deployment.stream_resume_timeout_s "
                                     "(cumulative)", registry=r)
        for s in SOURCES:
            self.prompt_tokens.labels(source=s)
        for reason in REASONS:
            self.reuse_misses.labels(reason=reason)

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason=reason).inc()

    def observe_gate(self, gate) -> None:
        self.gate_running.set(gate.num_running)
        self.gate_queued.set(gate.num_queued)
        self.gate_shed.set(gate.num_shed + gate.num_timed_out)

    def request_done(self, endpoint: str, status: str) -> None:
        self.requests.labels(endpoint=endpoint, status=status).inc()

    def request_finished(self, endpoint: str, last, num_generated: int) -> None:
        self.request_done(endpoint, "ok")
        self.generation_tokens.inc(num_generated)
        if last is None:
            return
        cached = last.num_cached_tokens
        source = last.cached_source if last.cached_source in SOURCES else "host"
        if cached:
            self.prompt_tokens.labels(source=source).inc(cached)
        self.prompt_tokens.labels(source="computed").inc(max(0, last.num_prompt_tokens - cached))
        for reason, n in (last.reuse_misses or {}).items():
            self.reuse_misses.labels(reason=reason).inc(n)
        self.reuse_bound.inc(last.reuse_bound)
        if last.transfer_bytes:
            self.transfer_bytes.inc(last.transfer_bytes)
            self.transfer_seconds.observe(last.transfer_seconds)

    def observe_stats(self, stats: dict) -> None:
        for tier, s in (stats.get("tiers") or {}).items():
            self.tier_used.labels(tier=tier).set(s.get("used_bytes", 0))
            self.tier_capacity.labels(tier=tier).set(s.get("capacity_bytes", 0))
            self.tier_objects.labels(tier=tier).set(s.get("num_objects", 0))
            self.evictions.labels(tier=tier).set(s.get("evictions", 0))
            if "num_demoted" in s:
                self.demoted.labels(tier=tier).set(s["num_demoted"])
        spill = stats.get("spill")
        if spill:
            for outcome in SPILL_OUTCOMES:
                self.spill_objects.labels(outcome=outcome).set(spill.get(f"num_{outcome}", 0))
            self.spill_bytes.set(spill.get("bytes_spilled", 0))
        if "checksum_failures" in stats:
            self.checksum_failures.set(stats["checksum_failures"])
        if "resumed_streams" in stats:
            self.resumed_streams.set(stats["resumed_streams"])
        if "stream_resume_timeouts" in stats:
            self.resume_timeouts.set(stats["stream_resume_timeouts"])
        for role, events in (stats.get("workers") or {}).items():
            for event, n in events.items():
                self.worker_events.labels(role=role, event=event).set(n)
        for role, e in (stats.get("engines") or {}).items():
            for state in ("running", "waiting", "held"):
                self.engine_requests.labels(role=role, state=state).set(e.get(state, 0))
        for role, k in (stats.get("kept_states") or {}).items():
            for figure, n in k.items():
                self.kept_states.labels(role=role, figure=figure).set(n)
        for reason, n in (stats.get("route_decisions") or {}).items():
            self.route_decisions.labels(reason=reason).set(n)
        for outcome, n in (stats.get("route_pool_views") or {}).items():
            self.route_pool_views.labels(outcome=outcome).set(n)
        if "route_overridden" in stats:
            self.route_overridden.set(stats["route_overridden"])
        for kind in ("predicted", "realized"):
            if f"route_{kind}_cached_tokens" in stats:
                self.route_cached.labels(kind=kind).set(stats[f"route_{kind}_cached_tokens"])

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def merge_replica_stats(replica_stats: list[dict]) -> dict:
    """Fold replica stats (one each, ``deployments.ingress``) into the shape
    ``ServingMetrics.observe_stats`` reads: per-replica figures summed by role, node-shared tiers
    once a node (``node_id``) and summed over the nodes."""
    tiers: dict[str, dict] = {}
    engines: dict[str, dict] = {}
    kept: dict[str, dict[str, int]] = {}  # role -> kept KDA states' figures (engines that report them)
    workers: dict[str, dict[str, int]] = {}
    checksum = 0
    shared: dict[tuple[str, str], dict] = {}  # (node, tier) -> its figures (every replica there reports them)
    spill: dict[str, dict] = {}  # node -> its node store's spill counters (every replica there reports them)
    for s in replica_stats:
        if s.get("spill"):
            spill[s["spill"]["node_id"]] = s["spill"]
        events = workers.setdefault(s.get("role", "?"), {})
        for name, n in (s.get("worker") or {}).items():
            events[name] = events.get(name, 0) + n
        store = s.get("store") or {}
        for key, t in store.items():
            if key.startswith("tier:") and isinstance(t, dict):  # node-shared: counted once a node
                shared[(s.get("node_id", ""), key[5:])] = dict(t, evictions=t.get("num_evictions",
                                                                                   t.get("num_evicted", 0)))
        checksum += store.get("num_corrupt_pieces", 0)  # each replica's own loads
        eng = s.get("engine") or {}
        if eng:
            agg = engines.setdefault(s.get("role", "?"), {"running": 0, "waiting": 0, "held": 0})
            for k in agg:
                agg[k] += eng.get(k, 0)
            dev = tiers.setdefault(f"device:{s.get('role', '?')}", {"used_bytes": 0, "capacity_bytes": 0,
                                                                    "num_objects": 0, "evictions": 0})
            dev["num_objects"] += eng.get("resident_sessions", 0)
            dev["evictions"] += eng.get("resident_evictions", 0)
            blocks = eng.get("num_blocks", 0)
            block_bytes = eng.get("block_bytes", 0)
            dev["used_bytes"] += (blocks - eng.get("free_blocks", 0)) * block_bytes
            dev["capacity_bytes"] += blocks * block_bytes
            if "checkpoint_blocks" in eng:  # the reference engine (NOTE 10)
                k = kept.setdefault(s.get("role", "?"), dict.fromkeys(KEPT_FIGURES, 0))
                for figure, key in KEPT_FIGURES.items():
                    k[figure] += eng.get(key, 0)
    for (_, tier), t in shared.items():  # summed over the nodes
        into = tiers.setdefault(tier, {})
        for k, v in t.items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                into[k] = into.get(k, 0) + v
    out = {"tiers": tiers, "engines": engines, "checksum_failures": checksum, "workers": workers}
    if kept:
        out["kept_states"] = kept
    if spill:
        keys = [f"num_{o}" for o in SPILL_OUTCOMES] + ["bytes_spilled"]
        out["spill"] = {k: sum(n.get(k, 0) for n in spill.values()) for k in keys}
    return out
