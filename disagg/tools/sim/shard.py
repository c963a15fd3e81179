"""Router domains: a large cluster as independent slices, simulated in parallel.

A deployment of hundreds of engines is commonly fronted by several routers,
each owning a slice of the nodes, with sessions pinned to a slice by a
stable hash (a gateway in front of per-pool routers). Slices share nothing
(host tiers are per node, routing is per slice), so each is simulated on
its own, in its own process, and the records are merged::

    domain(session) = crc32(session family) % D          family = parent session or the session
    slice d         = engines [d * n / D, (d + 1) * n / D) of each role, whole nodes
    lanes, bounds   = split over the slices as evenly as possible

``D = 1`` is the single-router cluster (no approximation). With ``D > 1``
sessions cannot move between slices; with thousands of sessions per slice
the load of the slices evens out (reported: the spread of requests per slice).
"""

from __future__ import annotations

import multiprocessing as mp
import zlib
from collections import Counter
from dataclasses import replace
from typing import Any

from disagg.costs.model import CostModel
from disagg.tools.sim.driver import ReplayConfig
from disagg.tools.sim.metrics import RequestRecord, summarize
from disagg.tools.sim.simulator import ClusterConfig, SimResult, Simulator
from disagg.tools.sim.workload import SimRequest

_JOB: dict[str, Any] = {}  # what forked workers read (set before the pool starts)


def _family(r: SimRequest) -> str:
    return r.parent_session or r.session_id


def _split(n: int, parts: int, i: int) -> int:
    return n // parts + (1 if i < n % parts else 0)


def split_cluster(cluster: ClusterConfig, domains: int) -> ClusterConfig:
    """One slice's cluster (every slice gets the same engines)."""
    if domains < 1:
        raise ValueError("domains must be >= 1")
    if cluster.num_prefill:
        if cluster.num_prefill % domains or cluster.num_decode % domains:
            raise ValueError(f"{cluster.num_prefill} prefill / {cluster.num_decode} decode workers do not split "
                             f"into {domains} equal domains")
        return replace(cluster, num_prefill=cluster.num_prefill // domains, num_decode=cluster.num_decode // domains)
    if cluster.num_workers % domains:
        raise ValueError(f"{cluster.num_workers} workers do not split into {domains} equal domains")
    return replace(cluster, num_workers=cluster.num_workers // domains)


def split_requests(requests: list[SimRequest], domains: int) -> list[list[SimRequest]]:
    parts: list[list[SimRequest]] = [[] for _ in range(domains)]
    for r in requests:
        parts[zlib.crc32(_family(r).encode()) % domains].append(r)
    return parts


def split_replay(replay: ReplayConfig, domains: int, i: int) -> ReplayConfig:
    mr = replay.max_requests
    return replace(replay, concurrency=max(1, _split(replay.concurrency, domains, i)),
                   max_requests=None if mr is None else max(1, _split(mr, domains, i)))


def _run_domain(i: int) -> SimResult:
    j = _JOB
    sim = Simulator(j["parts"][i], j["policy"], j["cluster"], j["cost"], replay=split_replay(j["replay"], j["domains"], i),
                    seed=j["seed"] + i, router_config=j["router_config"], shared_ids=j["shared_ids"],
                    router_costs=j["router_costs"])
    return sim.run()


def merge(results: list[SimResult], cluster: ClusterConfig) -> SimResult:
    """One result of the slices: records renamed ``d<k>.<worker>``, metrics over all of them."""
    records: list[RequestRecord] = []
    qavg: dict[str, float] = {}
    work: dict[str, int] = {}
    decisions: Counter = Counter()
    tiers: Counter = Counter()
    sums: Counter = Counter()
    seen = total = 0.0
    for k, res in enumerate(results):
        for r in res.records:
            r.prefill_worker, r.decode_worker = f"d{k}.{r.prefill_worker}", f"d{k}.{r.decode_worker}"
            r.request_id = f"d{k}.{r.request_id}"
        records.extend(res.records)
        qavg.update((f"d{k}.{key}", v) for key, v in res.queue_avgs.items())
        work.update((f"d{k}.{key}", v) for key, v in res.prefill_work.items())
        m = res.router_metrics
        decisions.update(m.get("decisions", {}))
        tiers.update(m.get("tiers", {}))
        for key in ("num_decisions", "num_finished", "predicted_cached_tokens", "realized_cached_tokens", "overpredicted"):
            sums[key] += m.get(key, 0)
        if res.theoretical_hit is not None:
            n = sum(1 for r in res.records if not r.warmup)
            seen += res.theoretical_hit * n
            total += n
    num_gpus = cluster.num_gpus
    summary = summarize(records, qavg, work, num_gpus)
    summary["domains"] = len(results)
    per = [sum(1 for r in res.records if r.finish >= 0) for res in results]
    summary["domain_requests_max_mean"] = max(per) / (sum(per) / len(per)) if sum(per) else 1.0
    metrics: dict[str, Any] = {"decisions": dict(decisions), "tiers": dict(tiers), **sums}
    if sums["predicted_cached_tokens"]:
        metrics["prediction_ratio"] = round(sums["realized_cached_tokens"] / sums["predicted_cached_tokens"], 4)
    return SimResult(records, summary, metrics, sum(r.num_events for r in results), num_gpus,
                     seen / total if total else None, sum(r.sim_events for r in results), qavg, work)


def simulate(
    requests: list[SimRequest],
    policy: str,
    cluster: ClusterConfig,
    cost: CostModel,
    replay: ReplayConfig,
    domains: int = 1,
    jobs: int = 1,
    seed: int = 0,
    router_config: dict | None = None,
    shared_ids: frozenset[int] | set[int] = frozenset(),
    router_costs: str = "engine",
) -> SimResult:
    """Run ``requests`` on ``cluster`` split into ``domains`` router slices, ``jobs`` processes at once
    (``router_costs``: what the state-aware router prices time with, ``Simulator``'s)."""
    if domains == 1:
        return Simulator(requests, policy, cluster, cost, replay=replay, seed=seed, router_config=router_config,
                         shared_ids=shared_ids, router_costs=router_costs).run()
    part = split_cluster(cluster, domains)
    parts = split_requests(requests, domains)
    empty = [i for i, p in enumerate(parts) if not p]
    if empty:
        raise ValueError(f"domains {empty} got no sessions: use fewer domains")
    _JOB.update(parts=parts, policy=policy, cluster=part, cost=cost, replay=replay, domains=domains, seed=seed,
                router_config=router_config, shared_ids=shared_ids, router_costs=router_costs)
    try:
        if jobs > 1:
            with mp.get_context("fork").Pool(min(jobs, domains)) as pool:
                results = pool.map(_run_domain, range(domains), chunksize=1)
        else:
            results = [_run_domain(i) for i in range(domains)]
    finally:
        _JOB.clear()
    return merge(results, cluster)
