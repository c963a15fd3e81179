"""`disagg sim sweep`: a grid of cluster configurations, each across load, and the best one.

Grid (every combination)::

    engines      total engine replicas (each ``gpus_per_worker`` GPUs)
    pd           "agg" (every engine prefills and decodes) or "P:D" (prefill : decode engines)
    host         host-tier blocks per node (0: none)
    policy       router: state_aware or a baseline
    x concurrency  closed-loop lanes: the load points of one configuration's Pareto curve

Per configuration the runs give points (P90 interactivity, total tok/s/GPU);
their Pareto front is read at the target interactivity (monotone
interpolation, ``disagg.tools.bench.pareto``). The best configuration is the one
with the most tok/s/GPU at the target, then tokens per dollar at the GPU
price::

    tokens per dollar = tok/s/GPU * 3600 / ($ per GPU-hour)

A "P:D" split is applied to the engine count by ratio (engines * P / (P + D)
prefill engines, at least one of each); configurations that do not fit
(e.g. more workers than lanes) are skipped with a note.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import sys
from dataclasses import dataclass, field, replace
from typing import Any

from disagg.costs.model import CostModel
from disagg.tools.bench.cost import tokens_per_dollar
from disagg.tools.bench.pareto import front_at
from disagg.tools.sim.driver import ReplayConfig
from disagg.tools.sim.shard import simulate
from disagg.tools.sim.simulator import ClusterConfig
from disagg.tools.sim.workload import SimRequest

_JOB: dict[str, Any] = {}


@dataclass(frozen=True, slots=True)
class SweepPoint:
    engines: int  # engine replicas
    pd: str  # "agg" or "P:D"
    host_blocks: int  # per node
    policy: str  # router

    @property
    def label(self) -> str:
        return f"{self.engines}x {self.pd} host={self.host_blocks} {self.policy}"

    def cluster(self, base: ClusterConfig) -> ClusterConfig:
        if self.pd == "agg":
            return replace(base, num_workers=self.engines, num_prefill=0, num_decode=0, host_blocks=self.host_blocks)
        p, d = parse_pd(self.pd)
        n_p = max(1, min(self.engines - 1, round(self.engines * p / (p + d))))
        return replace(base, num_workers=self.engines, num_prefill=n_p, num_decode=self.engines - n_p,
                       host_blocks=self.host_blocks)


def parse_pd(text: str) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"P:D ratio must look like '1:3' or be 'agg', got {text!r}") from None
    if p < 1 or d < 1:
        raise ValueError(f"P:D ratio needs both sides >= 1, got {text!r}")
    return p, d


@dataclass(slots=True)
class SweepRow:
    point: SweepPoint
    runs: list[dict[str, float]] = field(default_factory=list)  # one per concurrency
    at_target: float | None = None  # tok/s/GPU on the front at the target interactivity
    tokens_per_dollar: float | None = None


def grid(engines: list[int], pds: list[str], hosts: list[int], policies: list[str]) -> list[SweepPoint]:
    for pd in pds:
        if pd != "agg":
            parse_pd(pd)
    return [SweepPoint(e, pd, h, pol) for e, pd, h, pol in itertools.product(engines, pds, hosts, policies)]


def _run_one(task: tuple[int, int]) -> dict[str, float]:
    i, conc = task
    j = _JOB
    point: SweepPoint = j["points"][i]
    cluster = point.cluster(j["cluster"])
    replay = replace(j["replay"], concurrency=conc)
    res = simulate(j["requests"], point.policy, cluster, j["cost"], replay, seed=j["seed"],
                   shared_ids=j["shared_ids"])
    s = res.bench_summary()
    return {"concurrency": conc, "p90_interactivity": s.p90_interactivity, "tps_per_gpu": s.total_tps_per_gpu,
            "ttft_p90_ms": s.ttft_ms.p90, "requests": s.num_ok, "hit": s.cache_hit_usage or 0.0,
            "gpus": res.num_gpus}


def run_sweep(requests: list[SimRequest], points: list[SweepPoint], concurrency: list[int], base: ClusterConfig,
              cost: CostModel, replay: ReplayConfig, target: float, usd_per_gpu_hour: float | None,
              jobs: int = 1, seed: int = 0, shared_ids: frozenset[int] = frozenset(),
              progress: bool = True) -> list[SweepRow]:
    """Simulate every point at every concurrency; rows with the front read at ``target``."""
    if not points or not concurrency:
        raise ValueError("empty sweep: give engines, pd ratios, host sizes, policies and concurrencies")
    _JOB.update(points=points, cluster=base, replay=replay, requests=requests, cost=cost, seed=seed,
                shared_ids=shared_ids)
    tasks = [(i, c) for i in range(len(points)) for c in concurrency]
    out: list[dict[str, float] | None] = [None] * len(tasks)
    try:
        if jobs > 1:
            with mp.get_context("fork").Pool(jobs) as pool:
                for k, res in enumerate(pool.imap(_run_one, tasks, chunksize=1)):
                    out[k] = res
                    _progress(progress, k + 1, len(tasks), points[tasks[k][0]], tasks[k][1])
        else:
            for k, t in enumerate(tasks):
                out[k] = _run_one(t)
                _progress(progress, k + 1, len(tasks), points[t[0]], t[1])
    finally:
        _JOB.clear()
    rows = [SweepRow(p) for p in points]
    for (i, _), res in zip(tasks, out, strict=True):
        assert res is not None
        rows[i].runs.append(res)
    for row in rows:
        pts = [(r["p90_interactivity"], r["tps_per_gpu"]) for r in row.runs
               if r["p90_interactivity"] == r["p90_interactivity"]]  # drop NaN
        row.at_target = front_at(pts, [target]).get(target) if pts else None
        if row.at_target is None:  # the front does not reach the target: best run that meets it, if any
            ok = [y for x, y in pts if x >= target]
            row.at_target = max(ok) if ok else None
        if row.at_target is not None and usd_per_gpu_hour:
            row.tokens_per_dollar = tokens_per_dollar(row.at_target, usd_per_gpu_hour)
    return rows


def _progress(on: bool, k: int, n: int, point: SweepPoint, conc: int) -> None:
    if on:
        print(f"[{k}/{n}] {point.label} c={conc}", file=sys.stderr, flush=True)


def best(rows: list[SweepRow]) -> SweepRow | None:
    ok = [r for r in rows if r.at_target is not None]
    return max(ok, key=lambda r: (r.at_target, r.tokens_per_dollar or 0.0)) if ok else None


def format_rows(rows: list[SweepRow], target: float) -> str:
    head = (f"{'engines':>7} {'pd':>5} {'host blocks':>11} {'policy':<16} {'best P90 tok/s/user':>19} "
            f"{'tok/s/GPU @' + format(target, 'g'):>15} {'tokens/$':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        p = r.point
        inter = max((x["p90_interactivity"] for x in r.runs if x["p90_interactivity"] == x["p90_interactivity"]),
                    default=float("nan"))
        at = "-" if r.at_target is None else f"{r.at_target:,.0f}"
        tpd = "-" if r.tokens_per_dollar is None else f"{r.tokens_per_dollar:,.0f}"
        lines.append(f"{p.engines:>7} {p.pd:>5} {p.host_blocks:>11} {p.policy:<16} {inter:>19.1f} {at:>15} {tpd:>12}")
    b = best(rows)
    if b is None:
        lines.append(f"no configuration reaches {target:g} tok/s/user P90")
    else:
        tpd = f", {b.tokens_per_dollar:,.0f} tokens per dollar" if b.tokens_per_dollar else ""
        lines.append(f"best at {target:g} tok/s/user P90: {b.point.label}: {b.at_target:,.0f} tok/s/GPU{tpd}")
    return "\n".join(lines)
