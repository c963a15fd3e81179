"""Speculative decoding: which draft depth pays for its longer cycle.

A cycle drafts k tokens and verifies them in one target step; it commits
the accepted drafts plus one token of the target's own. With a_i the
probability that draft i is accepted given drafts 1..i-1 were::

    E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j          expected committed tokens per cycle
    E(k) = (1 - a^(k+1)) / (1 - a)                   constant acceptance a

Throughput is E(k) / cycle(k), so one more draft pays only when the cycle
grows by less than the committed tokens do::

    k -> k + 1 pays  iff  cycle(k + 1) / cycle(k) < E(k + 1) / E(k)
    e.g. E(3) = 3.00, E(4) = 3.36: the fourth draft pays only if the cycle grows < 12%

Cycle cost, when given as times: ``verify_ms + verify_ms_per_token * (k + 1)
+ k * draft_ms``; or as a constant relative growth per extra draft.
"""

from __future__ import annotations

from dataclasses import dataclass


def committed_from_acceptance(rates: list[float], max_depth: int | None = None) -> list[float]:
    """E(0..n) from per-position acceptance rates (one rate: constant for every position)."""
    if not rates or any(not 0.0 <= a <= 1.0 for a in rates):
        raise ValueError("acceptance rates must be in [0, 1]")
    n = max_depth if max_depth is not None else len(rates)
    if len(rates) == 1:
        rates = rates * max(n, 1)
    if n > len(rates):
        raise ValueError(f"{len(rates)} acceptance rates cannot give depth {n}")
    out, p = [1.0], 1.0
    for a in rates[:n]:
        p *= a
        out.append(out[-1] + p)
    return out


@dataclass(slots=True)
class DepthRow:
    depth: int  # drafts per cycle
    committed: float  # expected committed tokens per cycle
    cycle: float | None  # relative cycle cost (None: not given)
    rate: float | None  # committed / cycle
    breakeven_growth: float | None  # the next draft pays iff the cycle grows by less than this


def depth_table(committed: dict[int, float], cycle: dict[int, float] | None = None) -> list[DepthRow]:
    """Rows by depth; ``committed`` maps depth -> E(depth), ``cycle`` depth -> cost (any unit)."""
    if not committed:
        raise ValueError("need committed tokens for at least one depth")
    for k, e in committed.items():
        if k < 0 or e < 1.0:
            raise ValueError(f"depth {k}: committed tokens per cycle must be >= 1 (got {e})")
    depths = sorted(committed)
    rows = []
    for i, k in enumerate(depths):
        c = cycle.get(k) if cycle else None
        nxt = depths[i + 1] if i + 1 < len(depths) else None
        growth = committed[nxt] / committed[k] - 1.0 if nxt is not None else None
        rows.append(DepthRow(k, committed[k], c, committed[k] / c if c else None, growth))
    return rows


def cycle_costs(depths: list[int], verify_ms: float | None = None, draft_ms: float | None = None,
                verify_ms_per_token: float = 0.0, growth: float | None = None) -> dict[int, float] | None:
    """Cycle cost per depth from times, or from a constant relative growth per draft (None: neither)."""
    if verify_ms is not None and draft_ms is not None:
        if verify_ms <= 0 or draft_ms < 0 or verify_ms_per_token < 0:
            raise ValueError("verify_ms must be > 0, draft_ms and verify_ms_per_token >= 0")
        return {k: verify_ms + verify_ms_per_token * (k + 1) + k * draft_ms for k in depths}
    if growth is not None:
        if growth < 0:
            raise ValueError("cycle growth must be >= 0")
        return {k: (1.0 + growth) ** k for k in depths}
    return None


def best_depth(rows: list[DepthRow]) -> DepthRow | None:
    rated = [r for r in rows if r.rate is not None]
    return max(rated, key=lambda r: (r.rate, -r.depth)) if rated else None


def format_depths(rows: list[DepthRow]) -> str:
    lines = ["drafts  committed/cycle  cycle  tokens/cycle-cost  next draft pays if the cycle grows <"]
    for r in rows:
        cyc = "-" if r.cycle is None else f"{r.cycle:.3g}"
        rate = "-" if r.rate is None else f"{r.rate:.3f}"
        be = "-" if r.breakeven_growth is None else f"{100 * r.breakeven_growth:.1f}%"
        lines.append(f"{r.depth:>6}  {r.committed:>15.2f}  {cyc:>5}  {rate:>17}  {be:>8}")
    best = best_depth(rows)
    if best is not None:
        lines.append(f"best depth: {best.depth} drafts ({best.rate:.3f} committed tokens per unit of cycle cost)")
    return "\n".join(lines)
