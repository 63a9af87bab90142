"""The placement bound's short-sequence curves (``placement_bound.py``): how much work and
how many tokens a subset of short sequences needs wherever it runs, as supporting lines the
bound's LP takes as rows (any subset of the lines is valid; more lines only tighten it)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron_hsp.planner.search.instance import Instance

# Supporting lines kept per subset curve (any subset of them is valid; more only tightens).
CURVE_LINES = 48


def inflated_work(inst: Instance, i: int, cross: Sequence[int]) -> float:
    """Least rank-ms sequence ``i`` costs in a cross-node group (inf if none holds it)."""
    return min(
        (inst.sizes[j] * inst.times[i][j] for j in cross if inst.times[i][j] < math.inf),
        default=math.inf,
    )


def _segment_lines(
    order: Sequence[int], num: Sequence[float], den: Sequence[float]
) -> list[tuple[float, float]]:
    """(slope, intercept) of segments of the cumulative (den, num) curve walked in ``order``:
    at most ``CURVE_LINES`` of them, the last always kept."""
    out, a, b = [], 0.0, 0.0
    for k in order:
        if den[k] > 0:
            slope = num[k] / den[k]
            out.append((slope, b - slope * a))
        a, b = a + den[k], b + num[k]
    if not out:
        return out
    step = max(1, math.ceil(len(out) / CURVE_LINES))
    return out[::step] + ([out[-1]] if (len(out) - 1) % step else [])


def carry_lines(
    tokens: Sequence[float], work: Sequence[float], at: Sequence[float] | None = None
) -> list[tuple[float, float]]:
    """Lines ``(a, c)`` with: any subset of the sequences holding ``x`` tokens carries at most
    ``min(c + a x)`` of ``work`` (densest first is the most; the curve is concave, so each
    segment's line is above it everywhere; the last line is the total, carried by all).

    ``at``: only the segments through these token counts (exact there, fewer rows in the
    pricing MILP); otherwise up to ``CURVE_LINES`` of them.
    """
    ids = [k for k in range(len(tokens)) if tokens[k] > 0 and work[k] > 0]
    order = sorted(ids, key=lambda k: -work[k] / tokens[k])
    total = (0.0, float(sum(work[k] for k in ids)))
    if at is None:
        return [*_segment_lines(order, work, tokens), total]
    lines, x0, w0 = set(), 0.0, 0.0
    points = sorted(at)
    for k in order:
        x1 = x0 + tokens[k]
        slope = work[k] / tokens[k]
        while points and points[0] <= x1:
            lines.add((slope, w0 - slope * x0))
            points.pop(0)
        x0, w0 = x1, w0 + work[k]
    return [*sorted(lines), total]


def carried_work(lines: Sequence[tuple[float, float]], tokens: float) -> float:
    """The most work ``tokens`` carry by ``carry_lines``'s lines."""
    return min(c + a * tokens for a, c in lines)


# The master's variables for where the short sequences run (module docstring).
SHORT_VARS = ("x_free", "w_free", "x_long", "w_long", "c_long")


def subset_curves(
    tokens: Sequence[float], work: Sequence[float], inflated: Sequence[float]
) -> list[tuple[float, float, dict[str, float]]]:
    """Rows ``lo <= sum coef[v] v <= hi`` over ``SHORT_VARS`` that every split of the short
    sequences into free ranks of long patterns (tokens ``x_free``, minimum work ``w_free``),
    long groups (tokens ``x_long``, minimum work ``w_long``, cross-node work ``c_long``) and
    micro-batches of short sequences only (the rest) satisfies.

    Fractional knapsacks give the extreme subsets: the most work ``x`` tokens carry (densest
    first, concave in ``x``) bounds the free ranks' part, the long groups' part and their union
    (whose complement, the short-only micro-batches, so carries at least the least work of its
    tokens); the least cross-node work ``x`` tokens cost (cheapest per token first, convex) and
    the least cross-node work that carries ``w`` of minimum work (least inflated first,
    convex) bound the long groups' part. Each segment's line bounds its curve everywhere, so
    any ``CURVE_LINES`` of them are valid rows. Sequences no cross-node group holds are never in
    the long groups' part.
    """
    ids = [k for k in range(len(tokens)) if tokens[k] > 0]
    ok = [k for k in ids if inflated[k] < math.inf]
    rows: list[tuple[float, float, dict[str, float]]] = [
        (-math.inf, float(sum(tokens[k] for k in ids)), {"x_free": 1.0, "x_long": 1.0}),
        (-math.inf, float(sum(work[k] for k in ids)), {"w_free": 1.0, "w_long": 1.0}),
        (-math.inf, float(sum(tokens[k] for k in ok)), {"x_long": 1.0}),
        (0.0, math.inf, {"c_long": 1.0, "w_long": -1.0}),
    ]

    by_density = sorted(ids, key=lambda k: -work[k] / tokens[k])
    for slope, icept in _segment_lines(by_density, work, tokens):  # w <= icept + slope x
        rows.append((-math.inf, icept, {"w_free": 1.0, "x_free": -slope}))
        rows.append((-math.inf, icept, {"w_long": 1.0, "x_long": -slope}))
        rows.append(
            (-math.inf, icept, {"w_free": 1.0, "w_long": 1.0, "x_free": -slope, "x_long": -slope})
        )
    by_cost = sorted(ok, key=lambda k: inflated[k] / tokens[k])
    for slope, icept in _segment_lines(by_cost, inflated, tokens):  # c >= icept + slope x
        rows.append((icept, math.inf, {"c_long": 1.0, "x_long": -slope}))
    by_inflation = sorted(ok, key=lambda k: inflated[k] / max(work[k], 1e-300))
    for slope, icept in _segment_lines(by_inflation, inflated, work):  # c >= icept + slope w
        rows.append((icept, math.inf, {"c_long": 1.0, "w_long": -slope}))
    return rows
