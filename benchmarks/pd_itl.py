"""What a run's P90 ITL tail is made of, per policy: hand-off (P/D), prefill stalls, batch.

Replays one cell of ``benchmarks/router_suite.py`` (same scale), or a trace file
as ``disagg sim run`` does (``--trace``, with its cluster flags), with each
given policy and splits every finished request's inter-token latency::

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

Where a disaggregated request's co-runners come from (``placement``, over those
requests of each group): the share routed to a decode worker that was running
or awaiting decodes while another decode worker had none (``busy_at_route``:
the policy chose the batch), the share that found decodes on its worker when
its state arrived (``busy_at_join``: chosen, or come while it prefilled), and
the decode workers with none at that moment, in the cluster and on the chosen
worker's node (``idle_at_join``, ``idle_on_node``). A request whose decode
worker was busy at routing while others idled stays for its state: moving it
costs the hand-off of the whole context, which at short outputs is about what
one co-runner costs per token (docs/router.md, "Round 17").

``--oracle-spread`` asks how far decode placement alone could go: every
disaggregated request's decode worker is replaced, after the policy decided,
by the decode worker with the fewest requests routed to it and not finished
(the count the router keeps as ``C_d``, here exact and current); decode-local
prefills keep their worker. What it leaves of the gap to a baseline is not
placement's to close (docs/router.md, "Round 12"). ``--oracle-by tokens``
counts decode tokens instead, running and inbound as the workers report them
(``dynamo_cost``'s decode pick, for the disaggregated requests only): the
held-out shapes gain from it, the router suite's cells lose (docs/router.md,
"Round 21"). ``--oracle-by overlap`` knows the future: it counts, on each
decode worker, the decode steps the request would share with the requests
routed there and not finished, min(its output, each one's tokens still to
generate), from the trace's output lengths (the policy is not told them).

    python benchmarks/pd_itl.py long_agentic/64/pd
    python benchmarks/pd_itl.py chat_burst/64/pd --policies state_aware,round_robin,prefix_affinity
    python benchmarks/pd_itl.py --trace T.jsonl --sim-args "--block-size 64 --prefill 4 --decode 12" --oracle-spread
    python benchmarks/pd_itl.py long_agentic/64/pd --policies state_aware --oracle-spread --oracle-by tokens
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from collections import Counter

import numpy as np
from router_suite import Cell, Scale, _trace, cluster_of

from disagg.costs.model import CostModel
from disagg.tools.sim.driver import ReplayConfig
from disagg.tools.sim.retention import RETENTION_POLICIES
from disagg.tools.sim.simulator import Simulator

SPREADS = ("unfinished", "tokens", "overlap")  # --oracle-by: what --oracle-spread's "least busy" counts


def _decodes(w) -> int:
    """Requests decoding on ``w`` or waiting for its next step."""
    return w.batch_size + len(w.decode_wait)


def instrument(sim: Simulator) -> dict[str, dict]:
    """Per request id: decode start, stall seconds, batch at join and, for a disaggregated request,
    the decode workers' decodes when it was routed and when its state arrived (wraps the
    simulator's methods)."""
    info: dict[str, dict] = {}
    start_decode = sim._start_decode
    decoders = [w for w in sim.workers.values() if w.role == "decode"]
    route = sim.router.route

    def routed(req, states):
        d = route(req, states)
        if d.prefill_worker is not None and d.prefill_worker != d.decode_worker and decoders:
            chosen = _decodes(sim.workers[d.decode_worker])
            info.setdefault(req.request_id, {"stall": 0.0}).update(
                busy_at_route=chosen > 0 and min(map(_decodes, decoders)) == 0)
        return d

    def _start_decode(job, w, now):
        i = info.setdefault(job.rid, {"stall": 0.0})
        i.update(start=now, batch=_decodes(w), worker=w.worker_id)
        if "busy_at_route" in i:
            idle = [x for x in decoders if _decodes(x) == 0]
            i.update(idle_at_join=len(idle), idle_on_node=sum(x.node_id == w.node_id for x in idle))
        start_decode(job, w, now)

    sim.router.route = routed
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


def suite_sim(cell: Cell, policy: str, router_config: dict | None, seed_offset: int = 0,
              retention: str = "checkpoints") -> Simulator:
    """The simulator of one router-suite cell, at the suite's scale and defaults (retention: the suite's
    ``--retention``; rounds 1-13 ran "session")."""
    sc = Scale(0.25, 0.5, 3.0, 2.0, retention, seed_offset=seed_offset)
    reqs = list(_trace(cell.member, round(sc.sessions_per_worker * cell.workers), sc.tokens, sc.turns,
                       seed_offset))
    lanes = round(sc.lanes_per_worker * cell.workers)
    return Simulator(reqs, policy, cluster_of(cell, sc), CostModel(checkpoint_bytes=CostModel().checkpoint_bytes
                                                                  * sc.tokens),
                     replay=ReplayConfig(mode="closed", concurrency=lanes, think_scale=sc.tokens),
                     router_config=router_config if policy == "state_aware" else None)


def trace_sim(trace: str, sim_args: list[str], policy: str, router_config: dict | None) -> Simulator:
    """The simulator ``disagg sim run --trace trace *sim_args`` runs."""
    from disagg.tools.sim.cli import add_sim_parsers, build_cluster, build_replay, load_workload

    ap = argparse.ArgumentParser()
    add_sim_parsers(ap.add_subparsers())
    args = ap.parse_args(["sim", "run", "--trace", trace, *sim_args])
    reqs = load_workload(args)
    cluster, cost = build_cluster(args, args.workers, args.prefill, args.decode)
    return Simulator(reqs, policy, cluster, cost, replay=build_replay(args, int(args.concurrency)), seed=args.seed,
                     router_config=router_config if policy == "state_aware" else None,
                     router_costs=args.router_costs)


def spread_decodes(sim: Simulator, by: str = "unfinished") -> None:
    """``--oracle-spread``: a disaggregated request decodes on the decode worker with the fewest
    requests routed to it and not finished (``by``, ``--oracle-by``: "unfinished"), or with the
    fewest decode tokens, running and inbound, as the workers report them when it is routed
    ("tokens": ``dynamo_cost``'s decode pick), or with the fewest decode steps the request would
    share there ("overlap": the trace's output lengths, hidden from the policy); ties: the
    policy's pick, else the first."""
    decoders = [w for w, x in sim.workers.items() if x.role == "decode"]
    if not decoders:
        raise SystemExit("--oracle-spread needs a P/D cluster (decode workers)")
    if by not in SPREADS:
        raise ValueError(f"spread by one of {SPREADS}, got {by!r}")
    live = dict.fromkeys(decoders, 0)
    owner: dict[str, str] = {}
    outputs: dict[str, int] = {}  # "overlap": each unfinished request's output length
    route, finish, note = sim.router.route, sim.finish, sim.router.on_routed
    if by == "overlap":  # the trace's output lengths reach the oracle, not the policy (a config of the
        sim.cluster = dataclasses.replace(sim.cluster, output_hint="exact")  # simulator's own: the caller's stays)

        def noted(req, d):
            note(dataclasses.replace(req, output_len_hint=0), d)

        sim.router.on_routed = noted

    def left(wid: str, rid: str) -> int:
        """Tokens the request routed to ``wid`` has still to generate (all of them before it joins)."""
        w = sim.workers[wid]
        for end, _, job in w._batch:
            if job.rid == rid:
                return end - w.steps
        return outputs[rid]

    def routed(req, states):
        own = req.output_len_hint
        if by == "overlap":
            outputs[req.request_id] = own
            req = dataclasses.replace(req, output_len_hint=0)
        d = route(req, states)
        load = live
        if by == "overlap":  # decode steps r would share: min(its output, each co-runner's rest)
            load = {wid: sum(min(own, left(wid, rid)) for rid, o in owner.items() if o == wid)
                    for wid in live}
        if by == "tokens":
            load = {s.worker_id: s.running_decode_tokens + s.inbound_decode_tokens for s in states
                    if s.worker_id in live}
        if d.prefill_worker is not None and load.get(d.decode_worker, 0) > min(load.values()):
            d = dataclasses.replace(d, decode_worker=min(load, key=load.__getitem__))
        if d.decode_worker in live:
            live[d.decode_worker] += 1
            owner[req.request_id] = d.decode_worker
        return d

    def finished(job, w, now):
        wid = owner.pop(job.rid, None)
        outputs.pop(job.rid, None)
        if wid is not None:
            live[wid] -= 1
        finish(job, w, now)

    sim.router.route, sim.finish = routed, finished


def run(sim: Simulator, policy: str, oracle: str | None = None) -> dict:
    if oracle:
        spread_decodes(sim, oracle)
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
                     r.reason.split("/")[0], r.prefill_worker == r.decode_worker,
                     (i["busy_at_route"], i["batch"] > 0, i["idle_at_join"], i["idle_on_node"])
                     if "idle_at_join" in i else None))
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
                "local": sum(x[8] for x in xs), "reasons": dict(Counter(x[7] for x in xs)),
                "placement": placement([x[9] for x in xs if x[9] is not None])}

    def placement(ps: list[tuple]) -> dict:
        if not ps:
            return {"n": 0}
        b = np.array(ps, dtype=float)
        return {"n": len(ps), "busy_at_route": float(b[:, 0].mean()), "busy_at_join": float(b[:, 1].mean()),
                "idle_at_join": float(b[:, 2].mean()), "idle_on_node": float(b[:, 3].mean())}

    return {"policy": policy, "p90_itl_ms": 1e3 * p90, "interactivity_p90": 1.0 / p90,
            "tail": parts([x for x in rows if x[0] >= p90]), "band": parts([x for x in rows if lo <= x[0] <= hi]),
            "all": parts(rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cell", nargs="?", help="a suite cell, member/workers/mode, e.g. long_agentic/64/pd")
    ap.add_argument("--trace", help="replay this trace file instead of a suite cell")
    ap.add_argument("--sim-args", default="--prefill 4 --decode 12",
                    help="with --trace: disagg sim run's flags (cluster, block size, replay)")
    ap.add_argument("--policies", default="state_aware,round_robin")
    ap.add_argument("--router-config", default="", help="state_aware's RouterConfig as JSON")
    ap.add_argument("--seed-offset", type=int, default=0, help="added to the member's seed, as in the suite")
    ap.add_argument("--retention", default="checkpoints", choices=RETENTION_POLICIES,
                    help="a suite cell's retention, as the suite's flag")
    ap.add_argument("--oracle-spread", action="store_true",
                    help="a disaggregated request decodes on the least busy decode worker (see above)")
    ap.add_argument("--oracle-by", default="unfinished", choices=SPREADS,
                    help="--oracle-spread's least busy: the fewest unfinished requests, decode tokens, or "
                         "decode steps shared (the trace's outputs)")
    args = ap.parse_args(argv)
    if (args.cell is None) == (args.trace is None):
        ap.error("give exactly one of: a suite cell, --trace")
    rc = json.loads(args.router_config) if args.router_config else None
    if args.trace:
        def make(policy: str) -> Simulator:
            return trace_sim(args.trace, shlex.split(args.sim_args), policy, rc)
    else:
        member, workers, mode = args.cell.split("/")
        cell = Cell(member, int(workers), mode)

        def make(policy: str) -> Simulator:
            return suite_sim(cell, policy, rc, args.seed_offset, args.retention)
    for p in args.policies.split(","):
        out = run(make(p.strip()), p.strip(), args.oracle_by if args.oracle_spread else None)
        print(json.dumps(out))
        for k in ("tail", "band", "all"):
            t = out[k]
            print(f"{p:>16} {k:>4}: P90 ITL {out['p90_itl_ms']:.2f} ms  n {t['n']}  output med {t['output_median']:.0f}"
                  f"  ITL {t['itl_ms']:.2f} = handoff {t['handoff_ms']:.2f} + join {t['join_ms']:.2f}"
                  f" + stall {t['stall_ms']:.2f}"
                  f" + steps {t['steps_ms']:.2f} ms  batch {t['batch_mean']:.1f} (p90 {t['batch_p90']:.0f})"
                  f"  local {t['local']}  {t['reasons']}")
            pl = t["placement"]
            if pl["n"]:
                print(f"{'':>16} {'':>4}  disaggregated {pl['n']}: busy at route {pl['busy_at_route']:.2f}"
                      f"  busy at join {pl['busy_at_join']:.2f}  idle decode workers at join"
                      f" {pl['idle_at_join']:.1f} ({pl['idle_on_node']:.2f} on the node)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
