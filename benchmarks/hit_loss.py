"""Where a run's reuse falls short of the capacity bound: placement or eviction.

Replays a trace as ``disagg sim run --trace`` does (its cluster flags in
``--sim-args``) with one policy. As it places each request the simulator also
measures how far every worker could resume the prompt from its device and its
node's tiers (a dry resume, nothing moved: Simulator NOTE 10, the measurement
``disagg sim run --explain-misses`` splits against the infinite cache), and
this compares it, summed over the finished requests, against
``disagg.tools.sim.bound`` per request::

    realized    the prompt tokens the run resumed
    anywhere    the furthest any worker could have resumed, at arrival (at least what
                the run resumed: a prefill that planned nothing looks its device up
                again when admitted, Simulator NOTE 8)
    bound       Belady's optimum with the cluster's pooled capacity

    bound - realized = (anywhere - realized)      placement: held, not used
                     + (bound - anywhere)         eviction: held nowhere

and splits the eviction part by turn (bands of five). ``--know`` adds, on top
of the run's retention policy, the parts of retention "session" that only the
trace knows, one at a time or together (``disagg.tools.sim.retention``):

    end       a session's private objects go first the moment it ends
    moved     its private copies on the devices it left go first

so the run answers what each piece of knowledge would be worth. Serving knows
neither (the simulator's default retention, "checkpoints", is serving's),
except a session's end from clients that send ``session_end`` on its last turn
(``disagg sim run --session-ends``: what ``--know end`` runs).

    python benchmarks/hit_loss.py --trace T.jsonl --sim-args "--block-size 64 --prefill 4 --decode 12"
    python benchmarks/hit_loss.py --trace T.jsonl --sim-args "--block-size 64 --workers 16" --know end
    python benchmarks/hit_loss.py deep_context/16/pd --know moved      # a router suite cell, its scale
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from collections import defaultdict
from operator import attrgetter

from disagg.tools.sim.bound import capacity_bound_per_request
from disagg.tools.sim.retention import RETENTION_POLICIES
from disagg.tools.sim.simulator import Simulator

KNOWLEDGE = {"end": "on_session_end", "moved": "on_placed"}


def know(sim: Simulator, parts: set[str]) -> None:
    """Run the retention's ``parts`` (KNOWLEDGE) as policy "session" does, the rest as configured."""
    ret = sim.retention
    if not ret.enabled and parts:
        raise SystemExit("--know needs a retention that tracks sessions (checkpoints or session)")
    for part in parts:
        method = getattr(ret, KNOWLEDGE[part])

        def full(*args, _method=method):
            was, ret.full = ret.full, True
            try:
                return _method(*args)
            finally:
                ret.full = was

        setattr(ret, KNOWLEDGE[part], full)


def watch(sim: Simulator) -> None:
    """Have ``sim`` measure, as it places each request, the furthest any worker could resume its
    prompt (a dry resume on every worker's device and node tiers: ``RequestRecord.reach_tokens``,
    Simulator NOTE 10, what ``disagg sim run --explain-misses`` reports). The simulator gets a
    config of its own: the caller's, which other runs may share, is left as it was."""
    sim.cluster = dataclasses.replace(sim.cluster, explain_misses=True)


def split(sim: Simulator, lanes: int) -> dict:
    done = sorted((r for r in sim.records if r.finish >= 0), key=attrgetter("arrival"))
    bound = capacity_bound_per_request(sim.requests, sim.records, sim.cluster, sim.cost, lanes)
    total = sum(bound) or 1
    realized = sum(r.cached_tokens for r in done)
    reach = {r.request_id: max(r.reach_tokens, r.cached_tokens) for r in done}  # Simulator NOTE 8: admissions
    held = sum(reach.values())
    by_turn: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for r, b in zip(done, bound, strict=True):
        band = by_turn[r.turn // 5 * 5]
        band[0] += max(0, b - reach[r.request_id])
        band[1] += b
    return {"requests": len(done), "hit_vs_bound": realized / total, "anywhere_vs_bound": held / total,
            "placement_loss": (held - realized) / total, "eviction_loss": (total - held) / total,
            "eviction_loss_by_turn": {f"{t}-{t + 4}": round(lost / max(b, 1), 4)
                                      for t, (lost, b) in sorted(by_turn.items())}}


def main(argv: list[str] | None = None) -> dict:
    from pd_itl import Cell, suite_sim, trace_sim  # the same replays as the ITL split

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cell", nargs="?", help="a router suite cell, member/workers/mode, e.g. deep_context/16/pd")
    ap.add_argument("--trace", help="replay this trace file instead of a suite cell")
    ap.add_argument("--sim-args", default="", help="with --trace: disagg sim run's flags (cluster, retention, replay)")
    ap.add_argument("--seed-offset", type=int, default=0, help="a suite cell's seed offset, as the suite's flag")
    ap.add_argument("--retention", default="checkpoints", choices=RETENTION_POLICIES,
                    help="a suite cell's retention, as the suite's flag")
    ap.add_argument("--policy", default="state_aware")
    ap.add_argument("--router-config", default=None, help="JSON: the state-aware router's config")
    ap.add_argument("--know", default="", help=f"comma list of {', '.join(KNOWLEDGE)} (module docstring)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if (args.cell is None) == (args.trace is None):
        ap.error("give exactly one of: a suite cell, --trace")
    parts = {p for p in args.know.split(",") if p}
    if parts - set(KNOWLEDGE):
        ap.error(f"--know: unknown {sorted(parts - set(KNOWLEDGE))}; known: {', '.join(KNOWLEDGE)}")
    rc = json.loads(args.router_config) if args.router_config else None
    if args.trace:
        sim = trace_sim(args.trace, shlex.split(args.sim_args), args.policy, rc)
    else:
        member, workers, mode = args.cell.split("/")
        sim = suite_sim(Cell(member, int(workers), mode), args.policy, rc, args.seed_offset, args.retention)
    know(sim, parts)
    watch(sim)
    sim.run()
    lanes = sim.replay.concurrency if sim.replay.mode == "closed" else 0
    out = {"policy": args.policy, "know": sorted(parts), **split(sim, lanes)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{args.policy} (know: {','.join(sorted(parts)) or 'nothing more'}), {out['requests']} requests")
        print(f"  hit / bound {out['hit_vs_bound']:.3f}; anywhere / bound {out['anywhere_vs_bound']:.3f}")
        print(f"  lost to placement {out['placement_loss']:.3f}, to eviction {out['eviction_loss']:.3f} of the bound")
        print("  eviction loss by turn:", "  ".join(f"{k}: {v:.3f}" for k, v in out["eviction_loss_by_turn"].items()))
    return out


if __name__ == "__main__":
    main()
