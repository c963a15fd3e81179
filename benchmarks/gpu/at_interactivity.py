"""Throughput per GPU at fixed P90 interactivity, per layout, from ``two_gpu.py --part e2e`` rows.

    python benchmarks/gpu/at_interactivity.py E2E_JSON [E2E_JSON ...] --baseline 1x_aggregated_host

Each layout's concurrency points are ``(P90 tok/s/user, tok/s/GPU)``. Two readings per target:
``measured``, the best tok/s/GPU of a point at or above the target (no interpolation), and
``front``, the Pareto front interpolated at the target (monotone, none outside its range). The
ratio columns divide each layout's reading by the baseline layout's at the same target.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from disagg.tools.bench.pareto import best_meeting, front_at


def readings(rows: list[dict], targets: list[float]) -> dict[str, dict[float, tuple[float | None, float | None]]]:
    """layout -> target -> (measured, front)."""
    by_layout: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get("p90_interactivity") is not None and r.get("total_tps_per_gpu") is not None:
            by_layout.setdefault(r["layout"], []).append((r["p90_interactivity"], r["total_tps_per_gpu"]))
    out = {}
    for layout, pts in by_layout.items():
        front = front_at(pts, targets)
        out[layout] = {t: (best_meeting(pts, t), front[t]) for t in targets}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="+", help="e2e.json files of two_gpu.py (lists of rows)")
    ap.add_argument("--targets", default="30,50", help="P90 interactivity targets, tok/s/user")
    ap.add_argument("--baseline", default="1x_aggregated_host", help="the layout the ratios divide by")
    args = ap.parse_args()
    rows = [r for p in args.rows for r in json.loads(Path(p).read_text())]
    targets = [float(t) for t in args.targets.split(",")]
    got = readings(rows, targets)
    base = got.get(args.baseline, {})
    f = lambda v: "n/a" if v is None else f"{v:,.0f}"  # noqa: E731
    r = lambda a, b: "n/a" if a is None or not b else f"{a / b:.2f}x"  # noqa: E731
    print("| layout | target tok/s/user | tok/s/GPU measured | front | measured / baseline | front / baseline |")
    print("|---|---|---|---|---|---|")
    for layout, at in got.items():
        for t in targets:
            m, fr = at[t]
            bm, bf = base.get(t, (None, None))
            print(f"| {layout} | {t:g} | {f(m)} | {f(fr)} | {r(m, bm)} | {r(fr, bf)} |")
    print(json.dumps({k: {str(t): v for t, v in at.items()} for k, at in got.items()}))


if __name__ == "__main__":
    main()
