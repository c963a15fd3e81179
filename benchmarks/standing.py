"""Where the router stands across benchmark runs: cells that meet every figure, and each miss by kind.

Reads the output directories of ``router_suite.py``, ``heldout_shapes.py`` and
``mooncake_shapes.py`` (any number, each optionally named ``NAME=DIR``) and
prints one markdown table: per run, the cells that meet every figure of the
issue (TTFT P90 and P90 interactivity at least every baseline's, tokens/s/GPU
within 1% of the best baseline's, hit >= 0.95 of the capacity bound), and
each missed figure sorted into one kind:

    served less   every baseline ahead on the figure (TTFT P90 or P90 interactivity) serves at
                  most ``--served`` (0.9) of the router's tokens/s/GPU: in a closed loop a policy
                  that answers later has fewer turns decoding at once (docs/router.md, "Round 12")
    tie           within ``--tie`` (0.1%) of the cut
    hit line      hit/bound in [0.945, 0.95)
    lost          the rest

then every missed cell with its figures. A miss of several figures counts once
per figure; a cell counts as missed once::

    python benchmarks/standing.py suite+0=results/suite_agg results/heldout results/mooncake
    python benchmarks/standing.py held=results/heldout --by-mode     # aggregated and P/D cells apart
    python benchmarks/standing.py --by-mode "suite=results/old:agg" "suite=results/new:pd"   # a mode of each

A run ending in ``:agg`` or ``:pd`` counts that kind of cluster's cells alone (a
family whose P/D cells were run again apart from its aggregated ones); runs of one
name make one row (a family run in pieces).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ab_verdicts import load

# figure, the verdict's cut, which way is better in a row (1: higher)
CUTS = (("ttft_p90", 1.0, -1), ("interactivity_p90", 1.0, 1), ("tokens_per_s_per_gpu", 0.99, 1),
        ("hit_vs_bound", 0.95, 1))
KINDS = ("served less", "tie", "hit line", "lost")
SHORT = {"ttft_p90": "TTFT P90", "interactivity_p90": "P90 interactivity", "tokens_per_s_per_gpu": "tok/s/GPU",
         "hit_vs_bound": "hit/bound"}


def misses(v: dict, rows: dict[str, dict], served: float = 0.9, tie: float = 0.001) -> list[tuple[str, str, str]]:
    """(figure, kind, text) for each figure cell ``v`` misses; ``rows``: every policy's summary."""
    ours = rows["state_aware"]
    out = []
    for key, cut, sign in CUTS:
        if v[key] >= cut:
            continue
        if key == "hit_vs_bound":
            kind = "hit line" if v[key] >= 0.945 else "lost"
            out.append((key, kind, f"hit/bound {v[key]:.3f}"))
            continue
        ahead = [p for p, r in rows.items() if p != "state_aware" and (r[key] - ours[key]) * sign > 0]
        if key == "tokens_per_s_per_gpu":
            ahead = [p for p in ahead if rows[p][key] * 0.99 > ours[key]]
        if key != "tokens_per_s_per_gpu" and ahead and all(
                rows[p]["tokens_per_s_per_gpu"] <= served * ours["tokens_per_s_per_gpu"] for p in ahead):
            kind = "served less"
        elif v[key] >= cut - tie:
            kind = "tie"
        else:
            kind = "lost"
        best = v.get(f"{key}_best", "?")
        share = rows[best]["tokens_per_s_per_gpu"] / ours["tokens_per_s_per_gpu"] if best in rows else float("nan")
        out.append((key, kind, f"{SHORT[key]} x{v[key]:.4f} ({best}, at x{share:.2f} of our tok/s/GPU)"))
    return out


def mode_of(label: str) -> str:
    """"P/D" for a cell of a P/D cluster (``fanout/16/pd``, ``issue/pd``, ``3/pd16/open``), else "agg"."""
    return "P/D" if any(part.startswith("pd") for part in label.split("/")) else "agg"


def run_spec(text: str) -> tuple[str, Path, str]:
    """``[NAME=]DIR[:agg|:pd]`` -> (name, directory, the mode kept: "agg", "P/D" or "" for both)."""
    name, eq, rest = text.partition("=")
    if not eq:
        name, rest = "", text
    path, colon, mode = rest.rpartition(":")
    if not colon or mode not in ("agg", "pd"):
        path, mode = rest, ""
    name = name or path
    return name, Path(path), {"agg": "agg", "pd": "P/D", "": ""}[mode]


def standing(runs: list[tuple[str, Path] | tuple[str, Path, str]], served: float = 0.9, tie: float = 0.001,
             by_mode: bool = False) -> str:
    head = ["| run | cells meeting every figure | " + " | ".join(KINDS) + " |", "|---" * (len(KINDS) + 2) + "|"]
    detail = []
    parts: dict[str, dict] = {}  # a row per name (and mode): runs of one name add their cells to it
    for name, out, *keep in runs:
        cells = load(out)
        if keep and keep[0]:
            cells = {label: c for label, c in cells.items() if mode_of(label) == keep[0]}
        if not by_mode:
            parts.setdefault(name, {}).update(cells)
            continue
        for mode in ("agg", "P/D"):
            some = {label: c for label, c in cells.items() if mode_of(label) == mode}
            if some:
                parts.setdefault(f"{name} {mode}", {}).update(some)
    for name, cells in parts.items():
        counts = dict.fromkeys(KINDS, 0)
        for label, (v, rows) in cells.items():
            found = misses(v, rows, served, tie)
            for _, kind, _ in found:
                counts[kind] += 1
            if found:
                detail.append(f"- {name} `{label}`: " + "; ".join(f"{text} [{kind}]" for _, kind, text in found))
        met = sum(bool(v["pass"]) for v, _ in cells.values())
        head.append(f"| {name} | {met} of {len(cells)} | " + " | ".join(str(counts[k]) for k in KINDS) + " |")
    return "\n".join(head + ["", *detail])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="output directories, each DIR or NAME=DIR, with :agg or :pd to keep "
                                            "that kind of cluster's cells alone")
    ap.add_argument("--served", type=float, default=0.9,
                    help="a baseline ahead at no more than this share of our tok/s/GPU served less")
    ap.add_argument("--tie", type=float, default=0.001, help="a miss within this of the cut is a tie")
    ap.add_argument("--by-mode", action="store_true", help="a row per run and cluster kind (aggregated, P/D)")
    args = ap.parse_args(argv)
    runs = [run_spec(s) for s in args.runs]
    print(standing(runs, args.served, args.tie, args.by_mode))
    return 0


if __name__ == "__main__":
    sys.exit(main())
