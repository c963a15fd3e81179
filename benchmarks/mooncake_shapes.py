"""Mooncake-style traces of random agentic shapes, run as a new user would run their own.

A user with a Mooncake-format trace (one JSON line per request: ``timestamp``
in ms, ``input_length``, ``output_length``, ``hash_ids`` of 512-token blocks)
runs ``disagg sim run --trace T --policy all``. This script draws such traces
from a seeded family of agentic shapes none of the router's defaults was
tuned on, writes them, runs every policy on each in the clusters and replay
modes asked for (closed loop at the CLI's lanes, or open loop at the trace's
own timestamps), and prints the router suite's verdict per cell: the
state-aware router against the best baseline on TTFT P90, P90 interactivity
and tokens/s/GPU, and its hit against the capacity bound.

Each trace's shape is drawn from its seed::

    sessions        24 | 48 | 96 | 160, starting a mean gap apart (0.05-1.5 s)
    system prompts  1, 2 or 4 of 0-48 blocks (sessions pick one)
    first turn      own blocks, 1-32
    per turn        + the answer's blocks + 0-8 new blocks, capped at 64-256 blocks
                    (compaction: back to the system prompt and two blocks)
    turns           1-40 per session; answers 20-2000 tokens; think time 0.5-15 s

    python benchmarks/mooncake_shapes.py --out results/mooncake --seeds 1-12
    python benchmarks/mooncake_shapes.py --seeds 1,11 --clusters pd16 --modes open
    python benchmarks/mooncake_shapes.py --out results/variant --seeds 1-12 --router-config CFG \
        --reuse-baselines results/mooncake                   # the router alone, against stored baselines
    python benchmarks/mooncake_shapes.py --out results/public --traces conversation_trace.jsonl \
        synthetic_trace.jsonl                                # your own traces instead of the family's

``--traces`` runs the same cells and verdicts on trace files the user brings
(Mooncake's format, e.g. the conversation and synthetic traces Mooncake
published with its FAST'25 paper), each labelled by its file name's stem.

Writes ``<seed>.jsonl`` (the trace), ``runs.jsonl`` (every run's summary) and
``verdicts.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from router_suite import verdict
from tqdm.auto import tqdm

from disagg.tools.sim.cli import keep_turns_arg
from disagg.tools.sim.simulator import HOST_WRITES, OUTPUT_HINTS, ROUTER_COSTS

BLOCK = 512  # tokens per hash id, Mooncake's
CLUSTERS = {"agg16": ["--workers", "16"], "pd16": ["--prefill", "4", "--decode", "12"],
            "agg64": ["--workers", "64"], "pd64": ["--prefill", "16", "--decode", "48"]}
MODES = ("closed", "open")


def shape(r: random.Random) -> dict:
    """A shape drawn from ``r`` (module docstring)."""
    return {"sessions": r.choice([24, 48, 96, 160]), "shared": r.choice([0, 4, 12, 24, 48]),
            "prompts": r.choice([1, 1, 2, 4]), "first": (r.choice([1, 2, 4]), r.choice([8, 16, 32])),
            "grow": (r.choice([0, 1]), r.choice([2, 4, 8])), "turns": (r.choice([1, 2, 4]), r.choice([6, 12, 24, 40])),
            "think_s": r.choice([0.5, 2, 5, 15]), "gap_s": r.choice([0.05, 0.2, 0.5, 1.5]),
            "output": (r.choice([20, 100]), r.choice([300, 800, 2000])), "cap": r.choice([64, 128, 256])}


def trace(seed: int) -> tuple[dict, list[dict]]:
    """(shape, Mooncake records in timestamp order) of trace ``seed``."""
    r = random.Random(seed)
    s = shape(r)  # the shape, then its sessions, from one stream
    events: list[tuple[float, list[int], int]] = []
    fresh = 1 << 20  # ids of blocks no other prompt sent
    t = 0.0
    for _ in range(s["sessions"]):
        t += r.expovariate(1 / s["gap_s"])
        system = r.randrange(s["prompts"]) * 10_000
        ids = [system + i for i in range(s["shared"])]
        n = r.randint(*s["first"])
        ids += range(fresh, fresh + n)
        fresh += n
        at = t
        for _ in range(r.randint(*s["turns"])):
            out = r.randint(*s["output"])
            events.append((at, ids[: s["cap"]], out))
            at += out * 0.012 + r.expovariate(1 / s["think_s"]) + 0.3  # its answer, then the user
            n = r.randint(*s["grow"]) + max(1, out // BLOCK)
            ids = ids + list(range(fresh, fresh + n))
            fresh += n
            if len(ids) > s["cap"]:  # compaction: the system prompt and a summary
                ids = ids[: s["shared"]] + list(range(fresh, fresh + 2))
                fresh += 2
    events.sort(key=lambda e: e[0])
    records = [{"timestamp": int(at * 1000), "input_length": len(ids) * BLOCK - r.randrange(BLOCK),
                "output_length": out, "hash_ids": ids} for at, ids, out in events]
    return s, records


def run_cell(path: Path, cluster: str, mode: str, extra: list[str] | None = None,
             policy: str = "all") -> dict[str, dict]:
    """Every policy (or ``policy``) on one trace, one cluster, one replay mode: policy -> summary
    (``extra``: more ``disagg sim run`` flags)."""
    cmd = [sys.executable, "-m", "disagg", "sim", "run", "--trace", str(path), "--policy", policy, "--json",
           *CLUSTERS[cluster], *(["--mode", "open"] if mode == "open" else []), *(extra or [])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in out.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            rows[d["policy"]] = d
    return rows


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/mooncake_shapes")
    ap.add_argument("--seeds", default="1-12", help="trace seeds: a comma list of numbers and ranges a-b")
    ap.add_argument("--traces", nargs="+", metavar="FILE",
                    help="Mooncake-format trace files to run instead of the seeds' traces (labelled by stem)")
    ap.add_argument("--clusters", default="agg16,pd16", help=f"comma list of {', '.join(CLUSTERS)}")
    ap.add_argument("--modes", default="closed,open", help="comma list of closed (the CLI's lanes), open "
                                                        "(the trace's timestamps)")
    ap.add_argument("--output-hint", choices=OUTPUT_HINTS,
                    help="passed to disagg sim run: what the router is told of outputs (default: the CLI's, none)")
    ap.add_argument("--profile", help="passed to disagg sim run: the engine's cost profile (default: the CLI's, "
                                      "small), e.g. h200-small or mi355x-k3")
    ap.add_argument("--router-costs", choices=ROUTER_COSTS,
                    help="passed to disagg sim run: what the state-aware router prices time with (default: the "
                         "CLI's, engine)")
    ap.add_argument("--router-config", help="passed to disagg sim run: the state-aware router's config "
                                            "(JSON text or a file)")
    ap.add_argument("--reuse-baselines", metavar="DIR",
                    help="take the baselines' rows from DIR/runs.jsonl (an earlier run of the same seeds and "
                         "flags) and run only the state-aware router")
    ap.add_argument("--chunk-cache", action="store_true",
                    help="passed to disagg sim run: engines cache each prefill chunk as it completes (vLLM's)")
    ap.add_argument("--keep-turns", type=keep_turns_arg, metavar="auto|N",
                    help="passed to disagg sim run: retention demotes a session's checkpoints of turns older "
                         "than its newest N (every policy; default: the CLI's, 0, no limit)")
    ap.add_argument("--host-write", choices=HOST_WRITES,
                    help="passed to disagg sim run: how stores reach the node's host tier (every policy; "
                         "default: the CLI's, victim)")
    ap.add_argument("--jobs", type=int, default=1, help="cells run at once (each a disagg sim run process)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error("--jobs: at least 1")
    clusters, modes = args.clusters.split(","), args.modes.split(",")
    bad = [c for c in clusters if c not in CLUSTERS] + [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown clusters or modes: {bad}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str | int, Path] = {}  # trace label -> file
    if args.traces:
        for t in map(Path, args.traces):
            if not t.is_file():
                ap.error(f"--traces: no such file {str(t)!r}")
            if t.stem in paths:
                ap.error(f"--traces: two files named {t.stem!r}")
            paths[t.stem] = t
    else:
        try:
            seeds = _seeds(args.seeds)
        except ValueError:
            ap.error(f"--seeds takes numbers and ranges a-b, got {args.seeds!r}")
        paths = {seed: out / f"{seed}.jsonl" for seed in seeds}
    cells = [(seed, c, m) for seed in paths for m in modes for c in clusters]
    extra = (["--router-config", args.router_config] if args.router_config else []) + \
        (["--host-write", args.host_write] if args.host_write else []) + \
        (["--output-hint", args.output_hint] if args.output_hint else []) + \
        (["--profile", args.profile] if args.profile else []) + \
        (["--router-costs", args.router_costs] if args.router_costs else []) + \
        (["--chunk-cache"] if args.chunk_cache else []) + \
        (["--keep-turns", str(args.keep_turns)] if args.keep_turns is not None else [])
    reused: dict[str, dict[str, dict]] = {}
    if args.reuse_baselines:
        for line in (Path(args.reuse_baselines) / "runs.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r["policy"] != "state_aware":
                reused.setdefault(r.pop("cell"), {})[r["policy"]] = r
    verdicts, passed = {}, 0
    with open(out / "runs.jsonl", "w") as runs:
        for seed, path in paths.items():  # written first: the runs only read them
            if isinstance(seed, int) and not path.exists():
                s, records = trace(seed)
                path.write_text("".join(json.dumps(x) + "\n" for x in records))
                tqdm.write(f"trace {seed}: {len(records)} requests, {json.dumps(s)}")

        def one(cell: tuple[str | int, str, str]) -> dict[str, dict]:
            seed, cluster, mode = cell
            path, label = paths[seed], f"{seed}/{cluster}/{mode}"
            if label in reused:  # the baselines as they ran before; the router's own row is new
                return run_cell(path, cluster, mode, extra, policy="state_aware") | reused[label]
            return run_cell(path, cluster, mode, extra)

        with ThreadPoolExecutor(args.jobs) as pool:  # each cell is its own ``disagg sim run`` process
            done = tqdm(pool.map(one, cells), total=len(cells), unit="cell", desc="mooncake shapes")
            for (seed, cluster, mode), rows in zip(cells, done, strict=True):  # in the cells' order
                label = f"{seed}/{cluster}/{mode}"
                for policy, summary in rows.items():
                    runs.write(json.dumps({"cell": label, "policy": policy, **summary}) + "\n")
                v = verdict({"state_aware": rows.pop("state_aware"), **rows})
                verdicts[label] = v
                passed += v["pass"]
                tqdm.write(f"{label:18} {'meets every figure' if v['pass'] else 'misses'}: TTFT P90 "
                           f"x{v['ttft_p90']:.3f} ({v['ttft_p90_best']}), P90 interactivity "
                           f"x{v['interactivity_p90']:.4f} ({v['interactivity_p90_best']}), tok/s/GPU "
                           f"x{v['tokens_per_s_per_gpu']:.3f}, hit/bound {v['hit_vs_bound']:.3f}")
    (out / "verdicts.json").write_text(json.dumps(verdicts, indent=1, default=str))
    print(f"{passed}/{len(cells)} cells reach every figure")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
