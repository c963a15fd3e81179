"""What a closed-loop cell's TTFT P90 miss is made of: the lanes' first burst, and how it was placed.

A closed-loop replay starts every lane at once (``--ramp-s 0``, the CLI's default), so the
first ``concurrency`` requests arrive together and each worker's share of them is prefilled
in one or two engine steps: the requests of a step all get their first token when it ends.
For each cell of a ``mooncake_shapes.py`` run whose state-aware TTFT P90 trails a baseline,
this re-runs the state-aware router and the baseline that beat it and prints, per policy:
TTFT P90 and P99, the share of the router's requests at or past its P90 that arrived in
that burst, and the burst's balance (the most prompt tokens any worker got of it over the
mean)::

    python benchmarks/burst_tail.py results/mooncake_agg16            # its runs.jsonl and verdicts.json
    python benchmarks/burst_tail.py results/mooncake_agg16 --ramp-s 5  # the same cells, lanes started over 5 s
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from disagg.tools.sim.cli import add_sim_parsers, build_cluster, build_replay, load_workload
from disagg.tools.sim.shard import simulate

BURST_S = 0.01  # arrivals this close to the replay's start are the lanes' first burst


def figures(records) -> tuple[float, float, float, float]:
    """(TTFT P90, TTFT P99, share of the requests at or past the P90 that are the burst's,
    the burst's most prompt tokens on one worker over the mean of the workers that got some)."""
    done = [r for r in records if r.finish >= 0 and not r.warmup]
    ttft = np.array([r.first_token - r.arrival for r in done])
    p90, p99 = np.percentile(ttft, [90, 99])
    tail = [r for r, t in zip(done, ttft, strict=True) if t >= p90]
    per_worker: dict[str, int] = defaultdict(int)
    for r in done:
        if r.arrival < BURST_S:
            per_worker[r.prefill_worker or r.decode_worker] += r.prompt_len
    tokens = np.array(list(per_worker.values()), dtype=float)
    balance = float(tokens.max() / tokens.mean()) if len(tokens) else 1.0
    return float(p90), float(p99), float(np.mean([r.arrival < BURST_S for r in tail])), balance


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a mooncake_shapes.py output directory (closed-loop cells)")
    ap.add_argument("--ramp-s", type=float, default=0.0, help="start lane i at i * ramp / lanes (default: at once)")
    args = ap.parse_args(argv)
    verdicts = json.loads((args.run / "verdicts.json").read_text())
    sim = argparse.ArgumentParser()
    add_sim_parsers(sim.add_subparsers())
    print("cell | baseline | TTFT P90 ours / its | TTFT P99 ours / its | our tail in the burst | burst max/mean, ours / its")
    for cell, v in verdicts.items():
        seed, cluster, mode = cell.split("/")
        if mode != "closed" or v["ttft_p90"] >= 1.0:
            continue
        workers = cluster.removeprefix("agg")
        if not workers.isdigit():
            print(f"{cell}: not an aggregated cell, skipped", file=sys.stderr)
            continue
        sa = sim.parse_args(["sim", "run", "--trace", str(args.run / f"{seed}.jsonl"), "--workers", workers,
                             "--ramp-s", str(args.ramp_s)])
        requests = load_workload(sa)
        cl, cost = build_cluster(sa, sa.workers, 0, 0)
        replay = build_replay(sa, int(sa.concurrency))
        best = v["ttft_p90_best"]
        got = {p: figures(simulate(requests, p, cl, cost, replay, domains=1, jobs=1, seed=sa.seed).records)
               for p in ("state_aware", best)}
        a, b = got["state_aware"], got[best]
        print(f"{cell} | {best} | {a[0]:.3f} / {b[0]:.3f} | {a[1]:.3f} / {b[1]:.3f} | {a[2]:.2f} | "
              f"{a[3]:.2f} / {b[3]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
