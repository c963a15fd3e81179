"""What a suite cell's P90 ITL tail is made of, per policy: hand-off, prefill stalls, batch.

Replays one cell of ``benchmarks/router_suite.py`` (same scale) with each given
policy and splits every finished request's inter-token latency::

    ITL       = (finish - first token) / (output - 1)          (the suite's figure)
    handoff   = decode start - first token                     state transfer to the decode worker
    join      = first decode step - decode start               waiting for the step in progress there
    stall     = sum of prefill time in the decode worker's steps while r was in its batch
    steps     = the rest: decode steps (batch size and context)
    ITL       = (handoff + join + stall + steps) / (output - 1)

Printed per policy: P90 ITL, and over the tail (requests with ITL >= the
policy's P90) and a band (P85-P95): how many, their output length, how they were placed (the
router's reason), and the mean of each part per token; the same for the whole
run; then the decode workers' batch at join (mean and P90) and the requests
that stalled a batch with a local prefill.

    python benchmarks/pd_itl.py long_agentic/64/pd
    python benchmarks/pd_itl.py chat_burst/64/pd --policies state_aware,round_robin,prefix_affinity
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import numpy as np
from router_suite import Cell, Scale, _trace, cluster_of

from disagg.tools.sim.cost_model import CostModel
from disagg.tools.sim.driver import ReplayConfig
from disagg.tools.sim.simulator import Simulator


def instrument(sim: Simulator) -> dict[str, dict]:
    """Per request id: decode start, stall seconds, batch at join (wraps the simulator's methods)."""
    info: dict[str, dict] = {}
    start_decode = sim._start_decode

    def _start_decode(job, w, now):
        info.setdefault(job.rid, {"stall": 0.0})
        info[job.rid].update(start=now, batch=w.batch_size + len(w.decode_wait), worker=w.worker_id)
        start_decode(job, w, now)

    sim._start_decode = _start_decode
    for w in sim.workers.values():
        def start_step(now, w=w, orig=w._start_step):
            waiting = list(w.decode_wait)
            orig(now)
            for job in waiting:
                if job not in w.decode_wait:
                    info[job.rid]["join"] = now - info[job.rid]["start"]

        w._start_step = start_step

        def end_step(now, version, w=w, orig=w._end_step):
            if version == w.version and w.step_prefill and w._batch:
                took = now - w.step_start - w._decode_time(w.step_n)
                for _, _, job in w._batch:
                    info.setdefault(job.rid, {"stall": 0.0})["stall"] += took
            orig(now, version)

        w._end_step = end_step
    return info


def run(cell: Cell, policy: str, router_config: dict | None, seed_offset: int = 0) -> dict:
    sc = Scale(0.25, 0.5, 3.0, 2.0, "session", seed_offset)
    reqs = list(_trace(cell.member, round(sc.sessions_per_worker * cell.workers), sc.tokens, sc.turns,
                       seed_offset))
    lanes = round(sc.lanes_per_worker * cell.workers)
    sim = Simulator(reqs, policy, cluster_of(cell, sc), CostModel(checkpoint_bytes=CostModel().checkpoint_bytes
                                                                 * sc.tokens),
                    replay=ReplayConfig(mode="closed", concurrency=lanes, think_scale=sc.tokens),
                    router_config=router_config if policy == "state_aware" else None)
    info = instrument(sim)
    res = sim.run()
    rows = []
    for r in res.records:
        if r.finish < 0 or r.output_len <= 1 or r.request_id not in info:
            continue
        i = info[r.request_id]
        n = r.output_len - 1
        join = i.get("join", 0.0)
        rows.append((r.itl, n, (i["start"] - r.first_token) / n, join / n, i["stall"] / n,
                     (r.finish - i["start"] - join - i["stall"]) / n, i["batch"],
                     r.reason.split("/")[0], r.prefill_worker == r.decode_worker))
    itl = np.array([x[0] for x in rows])
    p90 = float(np.percentile(itl, 90))
    lo, hi = np.percentile(itl, [85, 95])

    def parts(xs: list[tuple]) -> dict:
        a = np.array([x[:7] for x in xs], dtype=float)
        return {"n": len(xs), "output_median": float(np.median(a[:, 1] + 1)),
                "itl_ms": 1e3 * float(a[:, 0].mean()), "handoff_ms": 1e3 * float(a[:, 2].mean()),
                "join_ms": 1e3 * float(a[:, 3].mean()), "stall_ms": 1e3 * float(a[:, 4].mean()),
                "steps_ms": 1e3 * float(a[:, 5].mean()),
                "batch_mean": float(a[:, 6].mean()), "batch_p90": float(np.percentile(a[:, 6], 90)),
                "local": sum(x[8] for x in xs), "reasons": dict(Counter(x[7] for x in xs))}

    return {"policy": policy, "p90_itl_ms": 1e3 * p90, "interactivity_p90": 1.0 / p90,
            "tail": parts([x for x in rows if x[0] >= p90]), "band": parts([x for x in rows if lo <= x[0] <= hi]),
            "all": parts(rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cell", help="member/workers/mode, e.g. long_agentic/64/pd")
    ap.add_argument("--policies", default="state_aware,round_robin")
    ap.add_argument("--router-config", default="", help="state_aware's RouterConfig as JSON")
    ap.add_argument("--seed-offset", type=int, default=0, help="added to the member's seed, as in the suite")
    args = ap.parse_args(argv)
    member, workers, mode = args.cell.split("/")
    cell = Cell(member, int(workers), mode)
    rc = json.loads(args.router_config) if args.router_config else None
    for p in args.policies.split(","):
        out = run(cell, p.strip(), rc, args.seed_offset)
        print(json.dumps(out))
        for k in ("tail", "band", "all"):
            t = out[k]
            print(f"{p:>16} {k:>4}: P90 ITL {out['p90_itl_ms']:.2f} ms  n {t['n']}  output med {t['output_median']:.0f}"
                  f"  ITL {t['itl_ms']:.2f} = handoff {t['handoff_ms']:.2f} + join {t['join_ms']:.2f}"
                  f" + stall {t['stall_ms']:.2f}"
                  f" + steps {t['steps_ms']:.2f} ms  batch {t['batch_mean']:.1f} (p90 {t['batch_p90']:.0f})"
                  f"  local {t['local']}  {t['reasons']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
