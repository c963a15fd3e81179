"""Router suite: every policy on every member of the trace family, at 16 and 64 workers, aggregated and P/D.

For each member of ``disagg.tools.bench.family.SUITE`` (named, seeded agentic
shapes), each worker count and each cluster shape (``agg``: every worker
prefills and decodes; ``pd``: a quarter prefill, the rest decode), the
member's trace (``--sessions-per-worker`` top-level sessions per worker)
is replayed closed-loop (``--lanes-per-worker`` lanes per worker) in the
simulator with our router and every baseline. Printed per cell and policy:
hit against the infinite-cache theoretical hit and against the capacity
bound (``disagg.tools.sim.bound``: Belady on the run's future with the cluster's
pooled capacities, computed on the state-aware run's arrival order), TTFT
P50 / P90, P90 interactivity (1 / P90 ITL), tokens/s/GPU; then per cell the
state-aware router against the best baseline of each metric, and whether it
reaches the issue's figures (TTFT P90 and P90 interactivity at least as good
as every baseline, tokens/s/GPU within 1% of the best baseline or better,
hit >= 0.95 of the bound).

Scale: token lengths, the context cap, cache capacities, KDA checkpoint size
and think times are multiplied by ``--scale`` (default 0.25: a 128K context
becomes 32K, in 64-token blocks), turn counts by ``--turn-scale`` (0.5), so
the whole suite runs in minutes on a 2-core machine; capacities at full
scale: 131,072 device tokens per worker (2,048 blocks of 64) and 2,097,152
host tokens per node of 8 workers, the simulator's defaults at 64-token blocks.

    python benchmarks/router_suite.py --out results/router_suite
    python benchmarks/router_suite.py --members long_agentic --workers 16 --modes agg --jobs 2

Writes ``runs.jsonl`` (one line per run, as it ends), ``suite.json`` (every
run's summary and each cell's verdict), ``table.txt`` and ``suite.png``
(state-aware over the best baseline, per cell and metric) under ``--out``.
``--reuse-baselines DIR`` takes the baselines' runs from an earlier
``runs.jsonl`` of the same scale (router changes leave them as they were):

    python benchmarks/router_suite.py --out results/rs2 --reuse-baselines results/router_suite

``--resume`` takes the runs an earlier run into the same ``--out`` left in its ``runs.jsonl``
(same scale and cells, and for the state-aware router's the same config and output hint; a
line cut short by a stop is run again), so a run stopped part way
(a time limit, a machine taken back) goes on where it stopped:

    python benchmarks/router_suite.py --out results/router_suite --jobs 16 --resume

``--seed-offset K`` re-seeds every member (same shapes, other sessions): the held-out check
of a change tuned on the suite's own traces. Every policy runs with the simulator's spill of
decode nodes' evictions to the prefill nodes' host tiers (Simulator NOTE 4; serving's
``transfer.spill``), as serving does; ``--no-spill-to-pool`` runs without it (rounds 1-7).
Prefills keep KDA checkpoints where serving's do (the prompt end, the last full block and the
learned placement's points, Simulator NOTE 5); ``--checkpoints periodic`` keeps one every 16
blocks instead (rounds 1-9).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from tqdm.auto import tqdm

from disagg.config import KEEP_TURNS
from disagg.costs.model import CostModel
from disagg.router.baselines import BASELINES
from disagg.tools.bench.family import SUITE, member_trace
from disagg.tools.sim.bound import capacity_bound
from disagg.tools.sim.cli import keep_turns_arg, router_config
from disagg.tools.sim.driver import ReplayConfig
from disagg.tools.sim.retention import RETENTION_POLICIES
from disagg.tools.sim.simulator import HOST_WRITES, OUTPUT_HINTS, ClusterConfig, Simulator
from disagg.tools.sim.workload import SimRequest, from_trace_records

POLICIES = ["state_aware", *BASELINES]
BLOCK_SIZE = 64
DEVICE_TOKENS = 131_072  # per worker, full scale
HOST_TOKENS = 2_097_152  # per node, full scale
WORKERS_PER_NODE = 8
# where prefills keep KDA checkpoints: serving's (engine.checkpoint_interval 0: the prompt end and
# last full block, plus engine.learned_checkpoints' points, Simulator NOTE 5), or every 16 blocks
# and the last full block (rounds 1-9)
CHECKPOINT_MODELS = {
    "serving": {"checkpoint_every_blocks": 0, "checkpoint_prompt_end": True, "learned_checkpoints": True},
    "periodic": {"checkpoint_every_blocks": 16},
}
FIGURES = ("ttft_p50", "ttft_p90", "interactivity_p90", "tokens_per_s_per_gpu")
LOWER_IS_BETTER = {"ttft_p50", "ttft_p90"}


@dataclass(frozen=True, slots=True)
class Cell:
    member: str  # family member
    workers: int  # engines
    mode: str  # "agg" | "pd"

    @property
    def label(self) -> str:
        return f"{self.member}/{self.workers}/{self.mode}"


@dataclass(frozen=True, slots=True)
class Scale:
    tokens: float  # token lengths, capacities, checkpoint size, think time
    turns: float  # turn counts
    sessions_per_worker: float  # top-level sessions per worker
    lanes_per_worker: float  # closed-loop lanes per worker
    retention: str  # tier eviction order (disagg.tools.sim.retention)
    router_config: str = ""  # state_aware's RouterConfig as JSON ("" = defaults)
    seed_offset: int = 0  # added to every member's seed (0: the suite's own traces)
    spill_to_pool: bool = True  # ClusterConfig.spill_to_pool (Simulator NOTE 4)
    checkpoints: str = "serving"  # CHECKPOINT_MODELS: where prefills keep KDA checkpoints
    host_write: str = "victim"  # ClusterConfig.host_write (Simulator NOTE 12; NOTE 6)
    session_ends: str = ""  # "turn" | "after" (ClusterConfig.session_ends, session_end_after): clients say when
    # a session ends, with its last turn or after its answer; "": they do not
    output_hint: str = "none"  # ClusterConfig.output_hint (Simulator NOTE 9); no baseline reads it
    keep_turns: int | str = KEEP_TURNS  # ClusterConfig.keep_turns (retention NOTE 4; default 0: no limit)

    def key(self) -> str:
        """What a baseline's run depends on (not the router config)."""
        key = f"{self.tokens}/{self.turns}/{self.sessions_per_worker}/{self.lanes_per_worker}/{self.retention}"
        key = f"{key}/seed+{self.seed_offset}" if self.seed_offset else key
        key = f"{key}/spill" if self.spill_to_pool else key
        key = f"{key}/write-{self.host_write}" if self.host_write != "victim" else key
        key = f"{key}/session-ends" if self.session_ends else key
        key = f"{key}-after" if self.session_ends == "after" else key
        key = f"{key}/turns-{self.keep_turns}" if self.keep_turns != 0 else key
        return key if self.checkpoints == "periodic" else f"{key}/ckpt-{self.checkpoints}"

    def router_key(self) -> str:
        """What the state-aware run depends on besides ``key``: its config and what it is told."""
        return f"{self.router_config}|hint-{self.output_hint}"


@lru_cache(maxsize=8)
def _trace(member: str, sessions: int, scale: float, turn_scale: float, seed_offset: int = 0
           ) -> tuple[SimRequest, ...]:
    m = SUITE[member]
    if seed_offset:
        m = replace(m, seed=m.seed + seed_offset)
    recs = member_trace(m, sessions, block_size=BLOCK_SIZE, scale=scale, turn_scale=turn_scale)
    return tuple(from_trace_records(recs, BLOCK_SIZE))


def cluster_of(cell: Cell, sc: Scale) -> ClusterConfig:
    dev = max(1, round(DEVICE_TOKENS * sc.tokens / BLOCK_SIZE))
    host = max(1, round(HOST_TOKENS * sc.tokens / BLOCK_SIZE))
    pre = cell.workers // 4 if cell.mode == "pd" else 0
    return ClusterConfig(num_workers=cell.workers, num_prefill=pre, num_decode=cell.workers - pre if pre else 0,
                         workers_per_node=WORKERS_PER_NODE, device_blocks=dev, host_blocks=host,
                         retention=sc.retention, spill_to_pool=sc.spill_to_pool, host_write=sc.host_write,
                         session_ends=bool(sc.session_ends), session_end_after=sc.session_ends == "after",
                         output_hint=sc.output_hint, keep_turns=sc.keep_turns,
                         **CHECKPOINT_MODELS[sc.checkpoints])


def stored_runs(out: Path, labels: set[str], keep: Callable[[dict], bool]) -> list[dict]:
    """The runs ``out/runs.jsonl`` holds of the cells ``labels`` that ``keep`` takes (``--reuse-baselines``,
    ``--resume``); a line a stop cut short is left out, to be run again."""
    runs = []
    for line in (out / "runs.jsonl").read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r["cell"] in labels and keep(r):
            runs.append(r)
    return runs


def run_one(task: tuple[Cell, str, Scale]) -> dict:
    """One policy on one cell: its summary (and, for state_aware, the cell's capacity bound)."""
    cell, policy, sc = task
    reqs = list(_trace(cell.member, max(1, round(sc.sessions_per_worker * cell.workers)), sc.tokens, sc.turns,
                       sc.seed_offset))
    cluster = cluster_of(cell, sc)
    cost = CostModel(checkpoint_bytes=CostModel().checkpoint_bytes * sc.tokens)
    lanes = max(1, round(sc.lanes_per_worker * cell.workers))
    replay = ReplayConfig(mode="closed", concurrency=lanes, think_scale=sc.tokens)
    t0 = time.perf_counter()
    rc = json.loads(sc.router_config) if sc.router_config and policy == "state_aware" else None
    sim = Simulator(reqs, policy, cluster, cost, replay=replay, router_config=rc)
    res = sim.run()
    out = {"cell": cell.label, "policy": policy, "scale": sc.key(), "wall_s": time.perf_counter() - t0,
           **res.summary}
    if policy == "state_aware":  # the bound, on this run's arrival order
        out["router_key"] = sc.router_key()
        out["bound_tokens"] = capacity_bound(reqs, res.records, cluster, cost, lanes)
        out["theoretical_tokens"] = sum(r.theoretical_tokens for r in res.records if r.finish >= 0)
    out["cached_tokens"] = sum(r.cached_tokens for r in res.records if r.finish >= 0)
    return out


def verdict(rows: dict[str, dict]) -> dict:
    """State-aware against the best baseline per metric (ratios > 1: state-aware better)."""
    ours = rows["state_aware"]
    base = {p: s for p, s in rows.items() if p != "state_aware"}
    v: dict[str, float | bool | str] = {}
    for key in FIGURES:
        if key in LOWER_IS_BETTER:
            best = min(base, key=lambda p: base[p][key])
            v[key] = base[best][key] / ours[key] if ours[key] > 0 else math.inf
        else:
            best = max(base, key=lambda p: base[p][key])
            v[key] = ours[key] / base[best][key] if base[best][key] > 0 else math.inf
        v[f"{key}_best"] = best
    v["hit_vs_bound"] = ours["hit_vs_bound"]
    v["pass"] = bool(v["ttft_p90"] >= 1.0 and v["interactivity_p90"] >= 1.0
                     and v["tokens_per_s_per_gpu"] >= 0.99 and v["hit_vs_bound"] >= 0.95)
    return v


COLUMNS = [("hit_vs_theory", "hit/theory", "{:.3f}"), ("hit_vs_bound", "hit/bound", "{:.3f}"),
           ("ttft_p50", "TTFT p50 s", "{:.3f}"), ("ttft_p90", "TTFT p90 s", "{:.3f}"),
           ("interactivity_p90", "P90 tok/s/user", "{:.1f}"), ("tokens_per_s_per_gpu", "tok/s/GPU", "{:,.0f}")]


def format_cell(label: str, rows: dict[str, dict], v: dict) -> str:
    head = f"{label:<28}" + "".join(f"{c[1]:>15}" for c in COLUMNS)
    lines = [head, "-" * len(head)]
    for p, s in rows.items():
        lines.append(f"  {p:<26}" + "".join(f"{fmt.format(s[k]):>15}" for k, _, fmt in COLUMNS))
    lines.append(f"  state_aware / best baseline: TTFT p50 x{v['ttft_p50']:.2f}, TTFT p90 x{v['ttft_p90']:.2f}, "
                 f"P90 interactivity x{v['interactivity_p90']:.2f}, tok/s/GPU x{v['tokens_per_s_per_gpu']:.3f}, "
                 f"hit/bound {v['hit_vs_bound']:.3f} -> {'PASS' if v['pass'] else 'miss'}")
    return "\n".join(lines)


def plot(verdicts: dict[str, dict], path: Path, title: str = "Router suite") -> None:
    """One group of bars per cell: state-aware over the best baseline per figure, hit over its bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(verdicts)
    keys = [("ttft_p90", "TTFT P90"), ("interactivity_p90", "P90 interactivity"),
            ("tokens_per_s_per_gpu", "tok/s/GPU"), ("hit_vs_bound", "hit / bound")]
    fig, ax = plt.subplots(figsize=(max(8, 0.55 * len(labels) + 3), 4.5))
    width = 0.8 / len(keys)
    for j, (k, name) in enumerate(keys):
        xs = [i + (j - (len(keys) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, [min(verdicts[c][k], 3.0) for c in labels], width, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.95, color="grey", lw=0.6, ls="--")
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("state_aware / best baseline (hit: / bound)")
    ax.set_title(f"{title}: > 1 is better than every baseline")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_suite_args(ap: argparse.ArgumentParser) -> None:
    """The flags that pick the suite's cells, policies and scale (this script's and ``router_pareto``'s)."""
    ap.add_argument("--members", default=",".join(SUITE), help="comma list of SUITE members")
    ap.add_argument("--workers", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--modes", nargs="+", default=["agg", "pd"], choices=["agg", "pd"])
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma list (state_aware first)")
    ap.add_argument("--scale", type=float, default=0.25, help="token lengths, capacities, think times")
    ap.add_argument("--turn-scale", type=float, default=0.5)
    ap.add_argument("--sessions-per-worker", type=float, default=3.0)
    ap.add_argument("--retention", default="checkpoints", choices=RETENTION_POLICIES,
                    help="tier eviction order (disagg.tools.sim.retention): checkpoints, what serving does "
                         "(the CLI's default); session also uses what only the trace knows (rounds 1-13)")
    ap.add_argument("--router-config", default="", help="state_aware's RouterConfig: JSON text or a JSON/YAML file")
    ap.add_argument("--seed-offset", type=int, default=0,
                    help="re-seed every member by this much: traces of the same shapes the router was not tuned on")
    ap.add_argument("--session-ends", nargs="?", const="turn", choices=("turn", "after"), default="",
                    help="clients say when a session ends (every policy): 'turn' (the flag alone) marks its "
                         "last turn (the API's session_end), 'after' ends it once that turn is answered "
                         "(DELETE /v1/sessions/{id})")
    ap.add_argument("--output-hint", default="none", choices=OUTPUT_HINTS,
                    help="what state_aware is told of each request's output: none (it learns), or exact (an "
                         "oracle: rounds 1-23's runs; Simulator NOTE 9)")
    ap.add_argument("--keep-turns", type=keep_turns_arg, default=KEEP_TURNS, metavar="auto|N",
                    help="retention: a session's checkpoints of turns older than its newest N go first "
                         "(every policy; serving's transfer.host.keep_turns; 0, the default: no limit)")


def suite_selection(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[str], str]:
    """(members, policies, state_aware's router config as JSON text) of ``add_suite_args``' flags;
    ``ap.error`` on an unknown member or policy, or policies that do not start with state_aware."""
    members = [m.strip() for m in args.members.split(",") if m.strip()]
    if unknown := [m for m in members if m not in SUITE]:
        ap.error(f"unknown members {unknown}; known: {', '.join(SUITE)}")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or policies[0] != "state_aware" or any(p not in POLICIES for p in policies):
        ap.error(f"policies: state_aware first, then any of {', '.join(POLICIES[1:])}")
    try:
        rc = router_config(args.router_config)  # disagg sim run's reading: JSON text or a file, checked
    except (ValueError, TypeError, OSError) as exc:
        ap.error(f"--router-config: {exc}")
    return members, policies, json.dumps(rc) if rc else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="results/router_suite")
    add_suite_args(ap)
    ap.add_argument("--lanes-per-worker", type=float, default=2.0)
    ap.add_argument("--reuse-baselines", metavar="DIR", help="baseline runs from DIR/runs.jsonl (same scale)")
    ap.add_argument("--resume", action="store_true",
                    help="take the runs OUT/runs.jsonl holds from an earlier run (same scale); run the rest")
    ap.add_argument("--spill-to-pool", action=argparse.BooleanOptionalAction, default=True,
                    help="P/D: decode nodes' evictions go to the prefill nodes' host tiers (every policy; "
                         "--no-spill-to-pool: rounds 1-7's runs)")
    ap.add_argument("--checkpoints", default="serving", choices=list(CHECKPOINT_MODELS),
                    help="where prefills keep KDA checkpoints: serving's placement, or every 16 blocks "
                         "(rounds 1-9)")
    ap.add_argument("--host-write", default="victim", choices=HOST_WRITES,
                    help="host tiers as their node's devices' victim cache (serving's default; Simulator "
                         "NOTE 12), written through by every store alone (through: rounds 1-42), back by "
                         "device evictions (NOTE 6), or victim without reads of node mates' devices")
    ap.add_argument("--jobs", type=int, default=1, help="processes")
    args = ap.parse_args(argv)
    members, policies, rc = suite_selection(ap, args)
    sc = Scale(args.scale, args.turn_scale, args.sessions_per_worker, args.lanes_per_worker, args.retention, rc,
               args.seed_offset, args.spill_to_pool, args.checkpoints, args.host_write, args.session_ends,
               args.output_hint, args.keep_turns)
    cells = [Cell(m, w, mode) for m in members for w in args.workers for mode in args.modes]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    labels = {c.label for c in cells}
    results: list[dict] = []
    if args.reuse_baselines:
        results += stored_runs(Path(args.reuse_baselines), labels,
                               lambda r: r["policy"] != "state_aware" and r["scale"] == sc.key())
    have = {(r["cell"], r["policy"]) for r in results}
    if args.resume and (out / "runs.jsonl").exists():
        for r in stored_runs(out, labels, lambda r: r["policy"] in policies and r["scale"] == sc.key() and (
                r["policy"] != "state_aware" or r.get("router_key") == sc.router_key())):
            if (r["cell"], r["policy"]) not in have:
                results.append(r)
                have.add((r["cell"], r["policy"]))
    tasks = [(c, p, sc) for c in cells for p in policies if (c.label, p) not in have]
    log = (out / "runs.jsonl").open("w")
    for r in results:
        log.write(json.dumps(r, default=float) + "\n")
    t0 = time.perf_counter()
    with tqdm(total=len(tasks), desc="router suite", unit="run", file=sys.stderr) as bar:
        if args.jobs > 1:
            with mp.get_context("fork").Pool(args.jobs) as pool:
                for r in pool.imap_unordered(run_one, tasks):
                    results.append(r)
                    log.write(json.dumps(r, default=float) + "\n")
                    log.flush()
                    bar.set_postfix_str(f"{r['cell']} {r['policy']}")
                    bar.update()
        else:
            for t in tasks:
                results.append(run_one(t))
                log.write(json.dumps(results[-1], default=float) + "\n")
                log.flush()
                bar.set_postfix_str(f"{t[0].label} {t[1]}")
                bar.update()
    wall = time.perf_counter() - t0
    log.close()
    doc: dict = {"scale": vars(args) | {"block_size": BLOCK_SIZE}, "wall_s": round(wall, 1), "cells": {}}
    texts, verdicts = [], {}
    for c in cells:
        rows = {p: next(r for r in results if r["cell"] == c.label and r["policy"] == p) for p in policies}
        bound = rows["state_aware"]["bound_tokens"]
        for s in rows.values():
            s["hit_vs_bound"] = s["cached_tokens"] / bound if bound else 1.0
        v = verdict(rows) if len(rows) > 1 else {}
        verdicts[c.label] = v
        doc["cells"][c.label] = {"member": c.member, "workers": c.workers, "mode": c.mode, "rows": rows,
                                 "verdict": v, "description": SUITE[c.member].description}
        if v:
            texts.append(format_cell(c.label, rows, v))
    passed = sum(bool(v.get("pass")) for v in verdicts.values())
    summary = (f"{passed}/{len(cells)} cells reach every figure; {len(tasks)} runs in {wall:.0f} s wall, "
               f"jobs {args.jobs}")
    text = "\n\n".join(texts) + "\n\n" + summary
    print(text)
    (out / "table.txt").write_text(text + "\n")
    (out / "suite.json").write_text(json.dumps(doc, indent=1, default=float))
    if all(verdicts.values()):
        plot(verdicts, out / "suite.png")
    print(f"wrote {out / 'suite.json'}, {out / 'table.txt'}, {out / 'suite.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
