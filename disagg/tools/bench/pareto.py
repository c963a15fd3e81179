"""Pareto fronts of (interactivity, throughput) and monotone interpolation.

Each run of a concurrency sweep is a point ``(x, y)``: x = P90 interactivity
(tokens/s/user, higher is better), y = total tokens/s/GPU (higher is better).
A point is on the front when no other point is at least as good on both axes
and better on one. Sorted by x, the front's y never increases::

    y |  *
      |     *
      |         *
      +------------- x

Systems are compared at fixed interactivity targets (30, 50, 150 tok/s/user)
by interpolating each front with Steffen's monotone cubic Hermite method
(M. Steffen, A&A 239, 1990): it never overshoots the data, so a monotone
front gives a monotone curve. Targets outside the front's x range give None
(no extrapolation). :func:`best_meeting` is the reading without
interpolation: the most throughput a measured point delivers at or above the
target, which also answers below the front's lowest interactivity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

DEFAULT_TARGETS: tuple[float, ...] = (30.0, 50.0, 150.0)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated points (maximizing x and y), by increasing x."""
    valid = [i for i, (x, y) in enumerate(points) if math.isfinite(x) and math.isfinite(y)]
    # Sort by x descending, then y descending; keep a point when its y beats all seen so far.
    order = sorted(valid, key=lambda i: (-points[i][0], -points[i][1]))
    front: list[int] = []
    best_y = -math.inf
    for i in order:
        if points[i][1] > best_y:
            front.append(i)
            best_y = points[i][1]
    return front[::-1]


def _sign(v: float) -> float:
    return (v > 0) - (v < 0)


def steffen_slopes(xs: Sequence[float], ys: Sequence[float]) -> list[float]:
    """Node derivatives of Steffen's monotone interpolant (xs strictly increasing)."""
    n = len(xs)
    if n < 2:
        return [0.0] * n
    h = [xs[i + 1] - xs[i] for i in range(n - 1)]
    s = [(ys[i + 1] - ys[i]) / h[i] for i in range(n - 1)]
    if n == 2:
        return [s[0], s[0]]
    d = [0.0] * n
    for i in range(1, n - 1):
        p = (s[i - 1] * h[i] + s[i] * h[i - 1]) / (h[i - 1] + h[i])
        d[i] = (_sign(s[i - 1]) + _sign(s[i])) * min(abs(s[i - 1]), abs(s[i]), 0.5 * abs(p))
    for end, (s0, s1, h0, h1) in (
        (0, (s[0], s[1], h[0], h[1])),
        (n - 1, (s[-1], s[-2], h[-1], h[-2])),
    ):
        p = s0 * (1 + h0 / (h0 + h1)) - s1 * h0 / (h0 + h1)
        if p * s0 <= 0:
            d[end] = 0.0
        elif abs(p) > 2 * abs(s0):
            d[end] = 2 * s0
        else:
            d[end] = p
    return d


def monotone_interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """Steffen interpolation at ``x``; None outside ``[xs[0], xs[-1]]``."""
    if not xs or not math.isfinite(x) or x < xs[0] or x > xs[-1]:
        return None
    if len(xs) == 1:
        return float(ys[0])
    if any(b <= a for a, b in zip(xs, xs[1:], strict=False)):
        raise ValueError("xs must be strictly increasing")
    d = steffen_slopes(xs, ys)
    i = max(0, min(len(xs) - 2, next(k for k in range(len(xs) - 1) if x <= xs[k + 1])))
    h = xs[i + 1] - xs[i]
    t = (x - xs[i]) / h
    h00, h10 = 2 * t**3 - 3 * t**2 + 1, t**3 - 2 * t**2 + t
    h01, h11 = -2 * t**3 + 3 * t**2, t**3 - t**2
    return h00 * ys[i] + h10 * h * d[i] + h01 * ys[i + 1] + h11 * h * d[i + 1]


def front_at(
    points: Sequence[tuple[float, float]], targets: Sequence[float] = DEFAULT_TARGETS
) -> dict[float, float | None]:
    """Throughput on the Pareto front at each target interactivity."""
    idx = pareto_front(points)
    xs = [points[i][0] for i in idx]
    ys = [points[i][1] for i in idx]
    return {t: monotone_interpolate(xs, ys, t) for t in targets}


def best_meeting(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The highest throughput among the points whose interactivity is at least ``target``
    (None: no point reaches it)."""
    ys = [y for x, y in points if math.isfinite(x) and math.isfinite(y) and x >= target]
    return max(ys) if ys else None


def compare_fronts(
    a: Sequence[tuple[float, float]],
    b: Sequence[tuple[float, float]],
    targets: Sequence[float] = DEFAULT_TARGETS,
) -> list[dict[str, float | None]]:
    """Rows ``{target, a, b, ratio}`` with ratio = b / a at each target."""
    at_a, at_b = front_at(a, targets), front_at(b, targets)
    rows = []
    for t in targets:
        ya, yb = at_a[t], at_b[t]
        ratio = yb / ya if ya and yb is not None else None
        rows.append({"target": t, "a": ya, "b": yb, "ratio": ratio})
    return rows
