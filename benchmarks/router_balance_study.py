"""Balance at fixed load, longer traces: max/mean queued prefill vs sessions per worker.

The benchmark's trace (``router_bench.sim_workload``) gives each worker 4
closed-loop lanes (the load) and 6 sessions of 12 turns (the length). This
study keeps the lanes and multiplies the sessions, so only the run's duration
grows, and prints max/mean q (``disagg.tools.sim.metrics``) per policy, seed and
length, with hit/theory and P90 TTFT. Besides the benchmark's policies:

- ``state_aware_sessions``: our router with the first-turn guard of earlier
  rounds (``first_turn_guard: sessions``, active-session counts) instead of
  the booked-area guard.
- ``oracle`` (simulated): a clairvoyant placement with sessions pinned: each
  new session goes to the worker with the least *assigned area*, the sum over
  the sessions already placed there of their whole future ``∫ q`` (every turn's
  uncached prefill, from the trace, see ``session_area``); follow-ups stay on
  the session's worker. Online (sessions placed in arrival order), so it is
  what a router that knew every session's size would reach with pinning.
- ``greedy_area`` (simulated): the same without clairvoyance: a new session
  goes to the worker with the least area booked so far (each routed request
  books the area of its own uncached prefill, known at arrival).
- ``lpt`` (arithmetic, not simulated): the sessions' areas sorted largest
  first, each onto the least loaded of the workers (LPT); max/mean of the
  per-worker sums. No timing, no queueing: the granularity of the sessions
  alone, with every size known in advance and the best order.

Area of a prefill of n uncached tokens after ctx cached ones, run alone in
chunks of C = max_prefill_tokens_per_step (the worker's ``q`` holds the
prompt's remaining tokens until each chunk's step ends)::

    area(n, ctx) = sum_k remaining_k * (a + b c_k + c c_k (ctx_k + c_k / 2))    c_k = chunk k

A session's first turn is uncached past the shared system prompt; turn t > 0
past the previous turn's last full block.

    python benchmarks/router_balance_study.py --out results/router_balance
    python benchmarks/router_balance_study.py --workers 16 --seeds 0 1 2 3 4 5 6 7 \\
        --sessions-per-worker 6 12 24 48 --plot docs/router_balance_length.png --out results/router_balance
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from router_bench import POLICIES, sim_workload  # noqa: E402

from disagg.costs.model import CostModel  # noqa: E402
from disagg.router.baselines.common import NoFeedback, decision  # noqa: E402
from disagg.tools.sim.simulator import Simulator  # noqa: E402

SYSTEM_TOKENS = 8192  # router_bench.sim_workload's shared prefix


def prefill_area(n: int, ctx: int, cost: CostModel) -> float:
    """Token-seconds of queued prefill that n uncached tokens after ctx add when run alone."""
    area, left, c = 0.0, n, cost.max_prefill_tokens_per_step
    while left > 0:
        k = min(c, left)
        area += left * cost.prefill_time(k, ctx)
        ctx += k
        left -= k
    return area


def session_area(requests, cost: CostModel) -> dict[str, float]:
    """Per session: the summed ``prefill_area`` of its turns (uncached as described above)."""
    by: dict[str, list] = {}
    for r in requests:
        by.setdefault(r.session_id, []).append(r)
    out = {}
    for sid, turns in by.items():
        turns.sort(key=lambda r: r.turn)
        area, cached = 0.0, SYSTEM_TOKENS
        for r in turns:
            n = max(r.input_length - cached, 1)
            area += prefill_area(n, r.input_length - n, cost)
            cached = (r.input_length // r.block_size) * r.block_size
        out[sid] = area
    return out


def lpt_bound(areas: list[float], workers: int) -> float:
    bins = np.zeros(workers)
    for a in sorted(areas, reverse=True):
        bins[int(np.argmin(bins))] += a
    return float(bins.max() / bins.mean())


class AreaRouter(NoFeedback):
    """Sessions pinned; a new session to the worker with the least area (see the module doc)."""

    def __init__(self, cost: CostModel, session_areas: dict[str, float] | None = None):
        self.cost = cost
        self.session_areas = session_areas  # clairvoyant (oracle) if given
        self.area: dict[str, float] = {}
        self.home: dict[str, str] = {}
        self.prev: dict[str, int] = {}  # session -> cached tokens of its next turn

    def route(self, request, workers):
        ids = [w.worker_id for w in workers if w.healthy]
        for wid in ids:
            self.area.setdefault(wid, 0.0)
        sid = request.session_id
        wid = self.home.get(sid)
        if wid is None:
            wid = min(ids, key=lambda w: (self.area[w], w))
            self.home[sid] = wid
            if self.session_areas is not None:
                self.area[wid] += self.session_areas[sid]
        if self.session_areas is None:
            cached = self.prev.get(sid, SYSTEM_TOKENS)
            n = max(request.prompt_len - cached, 1)
            self.area[wid] += prefill_area(n, request.prompt_len - n, self.cost)
        self.prev[sid] = (request.prompt_len // request.block_size) * request.block_size
        return decision(request, wid, wid, True, "area")


# the router with the first-turn guard of earlier rounds (active-session counts), for comparison
SESSIONS_GUARD = {"plugins": {"load_guard": {"first_turn_guard": "sessions"}}}
STUDY_POLICIES = POLICIES + ["state_aware_sessions", "oracle", "greedy_area"]


def run_one(workers: int, seed: int, spw: float, policy: str, cost: CostModel) -> dict:
    reqs, cluster, lanes = sim_workload(workers, seed, 1.0, spw)
    base = policy if policy in POLICIES else "state_aware" if policy.startswith("state_aware") else "round_robin"
    sim = Simulator(reqs, base, cluster, lanes=lanes, seed=seed,
                    router_config=SESSIONS_GUARD if policy == "state_aware_sessions" else None)
    if policy == "oracle":
        sim.router = AreaRouter(cost, session_area(reqs, cost))
    elif policy == "greedy_area":
        sim.router = AreaRouter(cost)
    t0 = time.perf_counter()
    s = sim.run().summary
    keep = ("max_mean_queue", "max_mean_prefill_work", "hit_vs_theory", "ttft_p90", "makespan_s", "requests")
    return {k: s[k] for k in keep} | {"wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/router_balance")
    ap.add_argument("--workers", type=int, nargs="+", default=[16])
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    ap.add_argument("--sessions-per-worker", type=float, nargs="+", default=[6, 12, 24, 48])
    ap.add_argument("--policies", nargs="+", default=STUDY_POLICIES, choices=STUDY_POLICIES)
    ap.add_argument("--plot", default=None, help="PNG of max/mean q vs sessions per worker (first --workers)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    cost = CostModel()
    res: dict = {}
    for w in args.workers:
        for spw in args.sessions_per_worker:
            for seed in args.seeds:
                key = f"{w}/{spw:g}/{seed}"
                reqs, _, _ = sim_workload(w, seed, 1.0, spw)
                res[key] = {"lpt": {"max_mean_queue": lpt_bound(list(session_area(reqs, cost).values()), w)}}
                for p in args.policies:
                    res[key][p] = run_one(w, seed, spw, p, cost)
                print(f"  {key}: " + " ".join(f"{p} {r['max_mean_queue']:.3f}" for p, r in res[key].items()),
                      file=sys.stderr, flush=True)
    text = report(res, args)
    print(text)
    with open(os.path.join(args.out, "router_balance.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "router_balance.json"), "w") as f:
        json.dump(res, f, indent=1)
    if args.plot:
        plot(res, args, args.plot)
    return 0


def _cells(res: dict, w: int, spw: float, seeds: list[int], p: str, k: str) -> np.ndarray:
    return np.array([res[f"{w}/{spw:g}/{s}"][p][k] for s in seeds if k in res[f"{w}/{spw:g}/{s}"][p]])


def report(res: dict, args: argparse.Namespace) -> str:
    lines = []
    pols = ["lpt"] + args.policies
    for w in args.workers:
        head = f"{w} workers: max/mean q, mean [min-max] over seeds {args.seeds[0]}-{args.seeds[-1]}"
        lines += [head, f"{'policy':<16}" + "".join(f"{f'{spw:g} s/w':>22}" for spw in args.sessions_per_worker)]
        for p in pols:
            row = f"{p:<16}"
            for spw in args.sessions_per_worker:
                v = _cells(res, w, spw, args.seeds, p, "max_mean_queue")
                row += f"{v.mean():>9.3f} [{v.min():.2f}-{v.max():.2f}]"
            lines.append(row)
        for k, label in (("hit_vs_theory", "hit/theory"), ("ttft_p90", "P90 TTFT s"), ("makespan_s", "run s")):
            lines.append(f"{w} workers: {label}, mean over seeds")
            for p in args.policies:
                lines.append(f"{p:<16}" + "".join(f"{_cells(res, w, spw, args.seeds, p, k).mean():>22.3f}"
                                                   for spw in args.sessions_per_worker))
        lines.append(f"{w} workers: max/mean q per seed")
        for spw in args.sessions_per_worker:
            for p in pols:
                lines.append(f"{spw:>4g} s/w {p:<16}" + "".join(
                    f"{res[f'{w}/{spw:g}/{s}'][p]['max_mean_queue']:>7.3f}" for s in args.seeds))
        lines.append("")
    return "\n".join(lines)


def plot(res: dict, args: argparse.Namespace, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = args.workers[0]
    x = np.array(args.sessions_per_worker)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in ["lpt"] + args.policies:
        if p == "prefix_affinity":  # every session on one worker: max/mean = workers at any length
            continue
        vals = [_cells(res, w, spw, args.seeds, p, "max_mean_queue") for spw in args.sessions_per_worker]
        m = np.array([v.mean() for v in vals])
        lo, hi = np.array([v.min() for v in vals]), np.array([v.max() for v in vals])
        style = {"lpt": ":", "oracle": "--", "greedy_area": "--"}.get(p, "-")
        ax.errorbar(x, m, yerr=[m - lo, hi - m], ls=style, marker="o", ms=4, capsize=3, label=p)
    ax.axhline(1.25, color="k", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [f"{v:g}" for v in x])
    ax.set_xlabel("sessions per worker (4 closed-loop lanes per worker: same load, longer run)")
    ax.set_ylabel("max/mean queued prefill")
    ax.set_title(f"{w} workers, seeds {args.seeds[0]}-{args.seeds[-1]}: mean, bars min-max")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
