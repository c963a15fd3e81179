"""Where a P/D cell of the router suite loses hit: the P/D decision, placement, or capacity.

Runs one policy on one suite cell (``benchmarks/router_suite.py``, same scale) and,
for every routed request, reads the router's own index walk at decision time::

    decode_held   sum of resumable(D) over requests, D the decode worker picked
    pool_best     sum of max_p resumable(p) over the prefill pool
    either        sum of the larger of the two (what a perfect P/D decision would resume)
    picked        sum of the resumable tokens at the worker that prefilled
    bound         the suite's capacity bound (Belady, every tier of the cluster pooled)
    pool_bound    the same bound with only the prefill pool's capacity (its devices and
                  the host tiers of its nodes): what always-disaggregating could reach

    picked << pool_best            prefill-pool placement loses it
    pool_best << decode_held       the decode side holds state the pool lost: P/D decision
    decode_held, pool_best << bound   retention / capacity
    pool_bound << bound            the layout's capacity, not the policy

    python benchmarks/pd_diagnosis.py deep_context/64/pd
    python benchmarks/pd_diagnosis.py agentx/16/pd --router-config '{"decider": {"local_harm_weight": 1}}'
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from router_suite import Cell, Scale, _trace, cluster_of

from disagg.costs.model import CostModel
from disagg.router.calibration import with_engine_costs
from disagg.router.router import StateAwareRouter
from disagg.tools.sim.bound import belady_hits
from disagg.tools.sim.driver import ReplayConfig
from disagg.tools.sim.simulator import Simulator


class _Recording(StateAwareRouter):
    """The state-aware router, noting each P/D decision's resumable tokens (decode worker, pool best)."""

    rows: list[tuple[int, int, str]]

    def _decision(self, request, ctx, workers, decode_id, prefill_id, pd_reason, res, phase):
        pool = [w.worker_id for w in workers if w.role == "prefill"]
        best = max((ctx.match.resume(w)[0] for w in pool), default=0)
        self.rows.append((ctx.match.resume(decode_id)[0], best, pd_reason))
        return super()._decision(request, ctx, workers, decode_id, prefill_id, pd_reason, res, phase)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cell", help="member/workers/mode, e.g. deep_context/64/pd")
    ap.add_argument("--router-config", default="", help="state_aware's RouterConfig as JSON")
    ap.add_argument("--seed-offset", type=int, default=0, help="re-seed the member (router_suite --seed-offset)")
    args = ap.parse_args(argv)
    member, workers, mode = args.cell.split("/")
    cell, sc = Cell(member, int(workers), mode), Scale(0.25, 0.5, 3.0, 2.0, "session")
    reqs = list(_trace(member, round(sc.sessions_per_worker * cell.workers), sc.tokens, sc.turns, args.seed_offset))
    cluster = cluster_of(cell, sc)
    lanes = round(sc.lanes_per_worker * cell.workers)
    sim = Simulator(reqs, "state_aware", cluster, CostModel(checkpoint_bytes=CostModel().checkpoint_bytes * sc.tokens),
                    replay=ReplayConfig(mode="closed", concurrency=lanes, think_scale=sc.tokens))
    rc = json.loads(args.router_config) if args.router_config else None
    sim.router = _Recording(sim.index, with_engine_costs(rc, sim.cost.to_dict()), clock=lambda: sim.now)  # as Simulator's
    sim.router.rows = []
    res = sim.run()
    done = sorted((r for r in res.records if r.finish >= 0), key=lambda r: r.arrival)
    by_key = {(r.session_id, r.turn): r for r in reqs}
    prompts, salts = [by_key[(r.session_id, r.turn)] for r in done], [r.salt for r in done]
    nodes = -(-cluster.num_engines // cluster.workers_per_node)
    reserve = lanes * sim.state.ckpt_units
    pooled = cluster.num_engines * cluster.device_blocks + nodes * (cluster.host_blocks + cluster.disk_blocks)
    bound = sum(belady_hits(prompts, salts, max(pooled - reserve, 0), cluster.checkpoint_every_blocks))
    out = {"cell": args.cell, "bound": bound, "picked": sum(r.cached_tokens for r in done),
           "decode_held": sum(r[0] for r in sim.router.rows), "pool_best": sum(r[1] for r in sim.router.rows),
           "either": sum(max(r[0], r[1]) for r in sim.router.rows),
           "reasons": dict(Counter(r[2] for r in sim.router.rows))}
    if cluster.num_prefill:
        pre_nodes = -(-cluster.num_prefill // cluster.workers_per_node)
        cap = cluster.num_prefill * cluster.device_blocks + pre_nodes * (cluster.host_blocks + cluster.disk_blocks)
        out["pool_bound"] = sum(belady_hits(prompts, salts, max(cap - reserve, 0), cluster.checkpoint_every_blocks))
    print(json.dumps(out))
    print(" ".join(f"{k}/bound {out[k] / bound:.3f}" for k in ("picked", "either", "decode_held", "pool_best", "pool_bound")
                   if k in out and bound))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
