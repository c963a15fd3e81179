"""Two runs of a router benchmark, cell by cell: which cells a change won or lost, and by how much.

Reads the output directories of ``router_suite.py`` (``suite.json``),
``heldout_shapes.py`` (``summary.json`` and each cell's rows) or
``mooncake_shapes.py`` (``verdicts.json`` and ``runs.jsonl``), in any
pairing of two runs of the same benchmark, typically a change run with
``--reuse-baselines`` against the run whose baselines it reused. Printed: each
cell whose verdict or state-aware figures moved (the router's own TTFT P90, P90
interactivity, tokens/s/GPU and hit against the capacity bound, A -> B, and the
verdict), then the count of cells that meet every figure in A and in B, the
cells gained and lost, and per figure how many cells moved up and down::

    python benchmarks/ab_verdicts.py results/mooncake results/variant
    python benchmarks/ab_verdicts.py results/suite_pd results/variant_pd --all     # every cell
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# the state-aware router's figures compared, and which way is better
FIGURES = (("ttft_p90", "TTFT P90 s", -1), ("interactivity_p90", "P90 tok/s/user", 1),
           ("tokens_per_s_per_gpu", "tok/s/GPU", 1), ("hit_vs_bound", "hit/bound", 1))


def load(out: Path) -> dict[str, tuple[dict, dict[str, dict]]]:
    """label -> (verdict, policy -> row: every policy's summary) of one benchmark run's directory."""
    if (out / "suite.json").exists():
        cells = json.loads((out / "suite.json").read_text())["cells"]
        return {label: (c["verdict"], c["rows"]) for label, c in cells.items() if c["verdict"]}
    if (out / "verdicts.json").exists():
        rows: dict[str, dict[str, dict]] = {}
        for line in (out / "runs.jsonl").read_text().splitlines():
            r = json.loads(line)
            rows.setdefault(r["cell"], {})[r["policy"]] = r
        return {label: (v, rows[label]) for label, v in json.loads((out / "verdicts.json").read_text()).items()}
    if (out / "summary.json").exists():
        cells = {}
        for label, v in json.loads((out / "summary.json").read_text()).items():
            stored = json.loads((out / f"{label.replace('/', '_')}.json").read_text())
            cells[label] = (v, {r["policy"]: r for r in stored})
        return cells
    raise SystemExit(f"{out}: no suite.json, verdicts.json or summary.json (not a router benchmark's output)")


def compare(a: dict[str, tuple[dict, dict[str, dict]]], b: dict[str, tuple[dict, dict[str, dict]]],
            every: bool = False) -> str:
    common = [label for label in a if label in b]
    if not common:
        raise SystemExit("the two runs share no cell")
    lines: list[str] = []
    up = {key: 0 for key, _, _ in FIGURES}
    down = dict(up)
    for label in common:
        (va, rows_a), (vb, rows_b) = a[label], b[label]
        ra, rb = rows_a["state_aware"], rows_b["state_aware"]
        moved = []
        for key, name, sign in FIGURES:
            x, y = ra.get(key, float("nan")), rb.get(key, float("nan"))
            if x != y:
                moved.append(f"{name} {x:.4g} -> {y:.4g}")
                if (y - x) * sign > 0:
                    up[key] += 1
                elif (y - x) * sign < 0:
                    down[key] += 1
        if moved or va["pass"] != vb["pass"] or every:
            verdict = f"{'met' if va['pass'] else 'missed'} -> {'met' if vb['pass'] else 'missed'}"
            misses = [k for k, cut in (("ttft_p90", 1.0), ("interactivity_p90", 1.0),
                                       ("tokens_per_s_per_gpu", 0.99), ("hit_vs_bound", 0.95)) if vb[k] < cut]
            why = f" (B misses {', '.join(f'{k} x{vb[k]:.4f}' for k in misses)})" if misses else ""
            lines.append(f"{label:28} {verdict:16} {'; '.join(moved) or 'no figure moved'}{why}")
    gained = [label for label in common if b[label][0]["pass"] and not a[label][0]["pass"]]
    lost = [label for label in common if a[label][0]["pass"] and not b[label][0]["pass"]]
    lines += ["", f"cells meeting every figure: A {sum(a[x][0]['pass'] for x in common)}, "
                  f"B {sum(b[x][0]['pass'] for x in common)} of {len(common)}",
              f"gained: {', '.join(gained) or 'none'}", f"lost: {', '.join(lost) or 'none'}",
              "cells up / down, A -> B: " + ", ".join(f"{name} {up[k]} / {down[k]}" for k, name, _ in FIGURES)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path, help="the earlier run's output directory")
    ap.add_argument("b", type=Path, help="the later run's output directory")
    ap.add_argument("--all", action="store_true", help="print every common cell, moved or not")
    args = ap.parse_args(argv)
    print(compare(load(args.a), load(args.b), args.all))
    return 0


if __name__ == "__main__":
    sys.exit(main())
