"""Router suite across load: every policy's (interactivity, tok/s/GPU, TTFT) points, and who covers whom.

The suite (``benchmarks/router_suite.py``) compares policies at one closed-loop
load: 2 lanes per worker. A closed loop lets each policy set its own operating
point: a policy whose prefill queues (``prefix_affinity`` piles every session
of a shared prompt on one worker) holds its lanes in the queue, so few
requests decode at once and its ITL is that of a nearly idle decode side, at a
seventh of the throughput. Its P90 interactivity then beats a router that
keeps the decode side busy, and that is a comparison of two loads as much as
of two policies.

This benchmark runs each cell of the suite at several loads (``--lanes``,
lanes per worker), every policy, and compares on the figures' own terms, the
way serving systems are compared on an interactivity / throughput front:

    covers(b) = some state-aware point s with
                interactivity(s) >= interactivity(b),
                tok/s/GPU(s)     >= 0.99 * tok/s/GPU(b)      (the issue's 1%),
                TTFT P90(s)      <= TTFT P90(b)
    at_b      = state-aware tok/s/GPU at interactivity(b), read on its front (monotone
                interpolation; past the front's range, the best point at or above it; 0 if none),
                over tok/s/GPU(b)                              (> 1: more throughput at b's interactivity)

for every measured point b of every baseline (all of them, not only the front).
A cell passes when every baseline point is covered. A grid of loads can miss
the state-aware point that covers a baseline's: for each point left
uncovered, up to ``--refine`` rounds run the state-aware router once more at
the load halfway between the two of its loads whose interactivity brackets
the point's. ``uncovered`` lists what is still not covered, with the nearest
state-aware point. Hit is not compared here: the suite's hit/bound is a
property of one load.

    python benchmarks/router_pareto.py --out results/router_pareto --members fanout --workers 64 --modes pd
    python benchmarks/router_pareto.py --out results/router_pareto --session-ends --jobs 2
    python benchmarks/router_pareto.py --out results/pareto_docqa --trace results/heldout/docqa.jsonl \
        --sim-args "--block-size 64 --prefill 4 --decode 12 --session-ends"

``--reuse-baselines DIR`` takes the baselines' runs from an earlier ``runs.jsonl`` of the
same cells, loads and flags (a router change leaves them as they were), as the suite's flag does.
``--trace`` replays a trace file as ``disagg sim run --trace T SIM_ARGS`` does (the
held-out shapes of ``benchmarks/heldout_shapes.py``: the CLI's defaults, 64 lanes at 16
workers, i.e. 4 per worker) with ``--concurrency`` set to lanes per worker times the engines.

Writes ``runs.jsonl`` (one line per run), ``pareto.json`` (points and verdicts)
and ``pareto.png`` (each cell's points, tok/s/GPU over P90 interactivity, one
line per policy) under ``--out``. The suite's flags (scale, retention, session
ends, seed offset, router config) mean what they mean there; a run at 2 lanes
is the suite's run of that cell.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import shlex
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from router_suite import POLICIES, Cell, Scale, add_suite_args, run_one, suite_selection
from tqdm.auto import tqdm

from disagg.tools.bench.pareto import best_meeting, front_at

TPS_TOLERANCE = 0.99  # tok/s/GPU within 1% of a baseline's counts as matching it (the figure)
_KEYS = ("interactivity_p90", "tokens_per_s_per_gpu", "ttft_p90", "ttft_p50")


def engines_of(sim_args: list[str]) -> int:
    """The engine count ``disagg sim run`` builds from these flags (P/D: prefill + decode)."""
    from disagg.tools.sim.cli import add_sim_parsers

    ap = argparse.ArgumentParser()
    add_sim_parsers(ap.add_subparsers())
    a = ap.parse_args(["sim", "run", *sim_args])
    return a.prefill + a.decode if a.prefill or a.decode else a.workers


def run_trace(task: tuple[str, tuple[str, ...], str, float, str]) -> dict:
    """One policy on a trace file at ``lanes`` lanes per engine: its summary, as ``disagg sim run``'s
    (``router_config``: state_aware's, JSON text, "" for the defaults)."""
    from pd_itl import trace_sim

    trace, sim_args, policy, lanes, router_config = task
    lanes_total = max(1, round(lanes * engines_of(list(sim_args))))
    sim = trace_sim(trace, [*sim_args, "--concurrency", str(lanes_total)], policy,
                    json.loads(router_config) if router_config else None)
    return {"cell": trace, "policy": policy, "scale": trace_key(sim_args, lanes), **sim.run().summary}


def trace_key(sim_args: tuple[str, ...], lanes: float) -> str:
    """What a trace run's result depends on besides the trace and the policy (``--reuse-baselines``)."""
    return f"{shlex.join(sim_args)} / {lanes:g} lanes per engine"


def point(run: dict, lanes: float) -> dict:
    return {"lanes": lanes, **{k: float(run[k]) for k in _KEYS}}


def covers(s: dict, b: dict) -> bool:
    """State-aware point ``s`` is at least as good as baseline point ``b`` on the issue's figures."""
    return (s["interactivity_p90"] >= b["interactivity_p90"]
            and s["tokens_per_s_per_gpu"] >= TPS_TOLERANCE * b["tokens_per_s_per_gpu"]
            and s["ttft_p90"] <= b["ttft_p90"])


def _valid(p: dict) -> bool:
    return all(math.isfinite(p[k]) for k in _KEYS)


def tps_at(ours: list[dict], interactivity: float) -> float | None:
    """State-aware tok/s/GPU at this interactivity: on its front (monotone interpolation), else the best
    measured point at or above it (None: no point reaches it)."""
    xy = [(p["interactivity_p90"], p["tokens_per_s_per_gpu"]) for p in ours]
    y = front_at(xy, [interactivity])[interactivity]
    return y if y is not None else best_meeting(xy, interactivity)


def cell_verdict(points: dict[str, list[dict]]) -> dict:
    """Every baseline point against the state-aware points of the same cell."""
    ours = [p for p in points["state_aware"] if _valid(p)]
    checked, uncovered, worst = 0, [], math.inf
    for policy, pts in points.items():
        if policy == "state_aware":
            continue
        for b in pts:
            if not _valid(b):
                continue
            checked += 1
            y = tps_at(ours, b["interactivity_p90"])
            ratio = y / b["tokens_per_s_per_gpu"] if y is not None and b["tokens_per_s_per_gpu"] > 0 else 0.0
            worst = min(worst, ratio)
            if not any(covers(s, b) for s in ours):
                near = max(ours, key=lambda s: (s["interactivity_p90"] >= b["interactivity_p90"],
                                                s["tokens_per_s_per_gpu"]), default=None)
                uncovered.append({"policy": policy, "point": b, "nearest": near, "tps_at_its_interactivity": ratio})
    return {"baseline_points": checked, "uncovered": uncovered, "min_tps_at_equal_interactivity": worst,
            "pass": checked > 0 and not uncovered}


def refine_lanes(ours: list[dict], uncovered: list[dict]) -> list[float]:
    """State-aware loads to try next: for each uncovered baseline point, the midpoint of the two measured
    state-aware loads whose interactivity brackets the point's (more lanes, less interactivity)."""
    pts = sorted((p for p in ours if _valid(p)), key=lambda p: p["lanes"])
    have = {p["lanes"] for p in pts}
    new: set[float] = set()
    for u in uncovered:
        x = u["point"]["interactivity_p90"]
        for lo, hi in zip(pts, pts[1:], strict=False):
            if lo["interactivity_p90"] >= x > hi["interactivity_p90"]:
                mid = round((lo["lanes"] + hi["lanes"]) / 2, 4)
                if mid not in have:
                    new.add(mid)
    return sorted(new)


def format_cell(label: str, points: dict[str, list[dict]], v: dict) -> str:
    lines = [f"{label}: P90 tok/s/user / tok/s/GPU / TTFT P90 s, by lanes per worker"]
    lanes = sorted({p["lanes"] for pts in points.values() for p in pts})
    lines.append(f"  {'':<16}" + "".join(f"{f'{x:g} lanes':>24}" for x in lanes))
    for policy, pts in points.items():
        by = {p["lanes"]: p for p in pts}
        cells = []
        for x in lanes:
            p = by.get(x)
            cells.append(f"{p['interactivity_p90']:.1f} / {p['tokens_per_s_per_gpu']:,.0f} / {p['ttft_p90']:.2f}"
                         if p else "-")
        lines.append(f"  {policy:<16}" + "".join(f"{c:>24}" for c in cells))
    worst = v["min_tps_at_equal_interactivity"]
    lines.append(f"  every baseline point covered: {'yes' if v['pass'] else 'no'} ({v['baseline_points']} points, "
                 f"{len(v['uncovered'])} not); state-aware tok/s/GPU at a baseline point's interactivity, worst: "
                 f"x{worst:.3f}" if math.isfinite(worst) else "")
    for u in v["uncovered"]:
        b, n = u["point"], u["nearest"]
        lines.append(f"    not covered: {u['policy']} at {b['lanes']:g} lanes ({b['interactivity_p90']:.1f} / "
                     f"{b['tokens_per_s_per_gpu']:,.0f} / {b['ttft_p90']:.2f}); nearest state-aware: "
                     + (f"{n['lanes']:g} lanes ({n['interactivity_p90']:.1f} / {n['tokens_per_s_per_gpu']:,.0f} / "
                        f"{n['ttft_p90']:.2f})" if n else "none"))
    return "\n".join(lines)


def plot(cells: dict[str, dict[str, list[dict]]], path: Path) -> None:
    """One panel per cell: tok/s/GPU over P90 interactivity, each policy's points joined by load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(cells)
    cols = min(4, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, (label, points) in zip(axes.flat, cells.items(), strict=False):
        for policy, pts in points.items():
            pts = sorted((p for p in pts if _valid(p)), key=lambda p: p["lanes"])
            ax.plot([p["interactivity_p90"] for p in pts], [p["tokens_per_s_per_gpu"] for p in pts], marker="o",
                    ms=3, lw=2.2 if policy == "state_aware" else 1.0, label=policy,
                    color="k" if policy == "state_aware" else None)
        ax.set_title(label, fontsize=9)
        ax.set_yscale("log")
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6)
    fig.supxlabel("P90 interactivity, tok/s/user (right is better)", fontsize=9)
    fig.supylabel("tok/s/GPU (up is better)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/router_pareto")
    add_suite_args(ap)  # the suite's cells, policies and scale (with --trace: members, workers, modes and
    # the scale flags are not used; pass disagg sim run's own, --session-ends included, in --sim-args)
    ap.add_argument("--lanes", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0],
                    help="closed-loop lanes per worker, one run per value (the suite runs 2)")
    ap.add_argument("--trace", help="replay this trace file instead of the suite's cells")
    ap.add_argument("--sim-args", default="--block-size 64",
                    help="with --trace: disagg sim run's flags (cluster, block size, replay, --session-ends)")
    ap.add_argument("--reuse-baselines", metavar="DIR",
                    help="baseline runs from DIR/runs.jsonl, an earlier run of the same cells, loads and flags")
    ap.add_argument("--refine", type=int, default=3,
                    help="rounds of extra state-aware loads between the two that bracket an uncovered "
                         "baseline point's interactivity")
    ap.add_argument("--jobs", type=int, default=1, help="processes")
    args = ap.parse_args(argv)
    members, policies, router_config = suite_selection(ap, args)
    if len(policies) < 2:
        ap.error(f"policies: state_aware first, then at least one of {', '.join(POLICIES[1:])}")
    if min(args.lanes) <= 0:
        ap.error("--lanes must be positive")

    def scale(lanes: float) -> Scale:
        return Scale(args.scale, args.turn_scale, args.sessions_per_worker, lanes, args.retention,
                     router_config, args.seed_offset, session_ends=args.session_ends, output_hint=args.output_hint,
                     keep_turns=args.keep_turns)

    if args.trace:
        sim_args = tuple(shlex.split(args.sim_args))
        cells = [f"{Path(args.trace).stem} ({args.sim_args})"]
        work = run_trace

        def task(label: str, policy: str, lanes: float) -> tuple:
            return args.trace, sim_args, policy, lanes, router_config

        def ident(label: str, policy: str, lanes: float) -> tuple:
            return args.trace, policy, trace_key(sim_args, lanes)
    else:
        suite_cells = {c.label: c for c in (Cell(m, w, mode) for m in members for w in args.workers
                                            for mode in args.modes)}
        cells = list(suite_cells)
        work = run_one

        def task(label: str, policy: str, lanes: float) -> tuple:
            return suite_cells[label], policy, scale(lanes)

        def ident(label: str, policy: str, lanes: float) -> tuple:
            return label, policy, scale(lanes).key()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    points: dict[str, dict[str, list[dict]]] = {c: {p: [] for p in policies} for c in cells}
    todo = [(c, p, x) for c in cells for x in args.lanes for p in policies]
    reused: dict[tuple, dict] = {}
    if args.reuse_baselines:  # baselines do not depend on the router's config: earlier runs stand
        for line in (Path(args.reuse_baselines) / "runs.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r["policy"] != "state_aware" and "scale" in r:
                reused[(r["cell"], r["policy"], r["scale"])] = r
    t0, runs = time.perf_counter(), 0
    ctx = mp.get_context("fork")
    with (out / "runs.jsonl").open("w") as log, ctx.Pool(args.jobs) if args.jobs > 1 else nullcontext() as pool, \
            tqdm(total=len(todo), desc="router pareto", unit="run", file=sys.stderr) as bar:
        for cell, policy, lanes in todo:
            if (r := reused.get(ident(cell, policy, lanes))) is not None:
                log.write(json.dumps(r, default=float) + "\n")
                points[cell][policy].append(point(r, lanes))
                bar.update()
        todo = [t for t in todo if ident(*t) not in reused]
        for round_ in range(args.refine + 1):
            work_args = [task(*t) for t in todo]
            for (cell, _, lanes), r in zip(todo, pool.imap(work, work_args) if pool else map(work, work_args),
                                           strict=True):
                r["lanes_per_worker"] = lanes
                log.write(json.dumps(r, default=float) + "\n")
                log.flush()
                points[cell][r["policy"]].append(point(r, lanes))
                bar.set_postfix_str(f"{cell} {r['policy']} {lanes:g}")
                bar.update()
            runs += len(todo)
            if round_ == args.refine:
                break
            todo = [(c, "state_aware", x) for c in cells
                    for x in refine_lanes(points[c]["state_aware"], cell_verdict(points[c])["uncovered"])]
            if not todo:
                break
            bar.total += len(todo)
            bar.refresh()
    wall = time.perf_counter() - t0
    verdicts = {label: cell_verdict(p) for label, p in points.items()}
    texts = [format_cell(label, points[label], verdicts[label]) for label in points]
    passed = sum(v["pass"] for v in verdicts.values())
    summary = (f"{passed}/{len(cells)} cells: every baseline point covered by a state-aware point; "
               f"{runs} runs in {wall:.0f} s wall, jobs {args.jobs}")
    print("\n\n".join(texts) + "\n\n" + summary)
    doc = {"args": vars(args), "wall_s": round(wall, 1), "cells": {
        label: {"points": points[label], "verdict": verdicts[label]} for label in points}}
    (out / "pareto.json").write_text(json.dumps(doc, indent=1, default=float))
    plot(points, out / "pareto.png")
    print(f"wrote {out / 'pareto.json'}, {out / 'pareto.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
