"""Fast heuristics: the per-micro-batch group builder used as warm start, fallback and filter.

A micro-batch is scheduled by *target makespan*: for a target ``M`` the builder walks the
sequences longest first and puts each into an open group that still finishes by ``M`` (and has
memory left), or opens the smallest group that can finish it by ``M``. Bisection on ``M`` finds the
smallest target the builder can meet with the cluster's ranks. Longest-first with the least-loaded
group of each size is LPT, which is within 4/3 of optimal for identical machines; the sizes make it
a heuristic, which the MILP (``milp.py``) then tries to beat.

Everything works on plain Python lists built once per batch (``Instance``): numpy scalar access in
the inner loop would cost more than the arithmetic.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from megatron_hsp.planner.instance import GroupSpec, Instance
from megatron_hsp.planner.topology import Cluster


# ---------------------------------------------------------------------- evaluation
def groups_makespan(inst: Instance, groups: Sequence[GroupSpec]) -> float:
    """Estimated time of a micro-batch: its slowest non-empty group."""
    index = {d: j for j, d in enumerate(inst.sizes)}
    worst = 0.0
    for d, ids in groups:
        if ids:
            j = index[d]
            worst = max(worst, sum(inst.times[i][j] for i in ids) + inst.fixed[j])
    return worst


# ---------------------------------------------------------------------- rank placement
def place_groups(
    inst: Instance, groups: Sequence[GroupSpec], cluster: Cluster
) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """Give each group an aligned rank block; fill spare ranks with empty groups.

    Largest first into the first free aligned block (buddy allocation): always succeeds for
    power-of-two sizes whose sum fits; other mixes may not tile, and then we return None.
    """
    n = inst.world_size
    if sum(d for d, _ in groups) > n:
        return None
    used = bytearray(n)
    placed: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    order = sorted(range(len(groups)), key=lambda g: (-groups[g][0], g))
    for g in order:
        d, ids = groups[g]
        start = _first_free_start(used, n, d)
        if start < 0:
            return None
        used[start : start + d] = b"\x01" * d
        placed.append((tuple(range(start, start + d)), tuple(sorted(ids))))
    # Spare ranks: the smallest allowed size that tiles, else single ranks.
    if placed and len(placed) and sum(used) < n:
        for d in [*inst.sizes, 1]:
            if not cluster.size_fits(d):
                continue
            while True:
                start = _first_free_start(used, n, d)
                if start < 0:
                    break
                used[start : start + d] = b"\x01" * d
                placed.append((tuple(range(start, start + d)), ()))
            if sum(used) == n:
                break
    elif not placed:
        for d in [*inst.sizes, 1]:
            if cluster.size_fits(d) and n % d == 0:
                placed = [(tuple(range(s, s + d)), ()) for s in range(0, n, d)]
                break
    placed.sort(key=lambda p: p[0][0])
    return placed


def _first_free_start(used: bytearray, n: int, d: int) -> int:
    """First start (a multiple of ``d``) of ``d`` free ranks; -1 when none.

    Callers only pass sizes that ``Cluster.size_fits``, so a block starting at a multiple of
    ``d`` is aligned: inside one node for ``d <= gpus_per_node``, whole nodes otherwise.
    """
    zero = bytes(d)
    for start in range(0, n - d + 1, d):
        if used[start : start + d] == zero:
            return start
    return -1


# ---------------------------------------------------------------------- group builder
def build_groups(
    inst: Instance, seq_ids: Sequence[int], target: float, ranks: int | None = None
) -> list[GroupSpec] | None:
    """Groups finishing every sequence by ``target`` ms with at most ``ranks`` ranks, or None.

    ``seq_ids`` must be sorted longest first. Sizes that are not powers of two are only used when
    the cluster lets them tile (``place_groups`` has the final word).
    """
    ranks = inst.world_size if ranks is None else ranks
    sizes, times, fixed, lengths, cap = inst.sizes, inst.times, inst.fixed, inst.lengths, inst.cap
    nsz = len(sizes)
    # Per size: heap of (load_ms, group index); group state in parallel lists.
    heaps: list[list[tuple[float, int]]] = [[] for _ in range(nsz)]
    g_size: list[int] = []
    g_load: list[float] = []
    g_tokens: list[int] = []
    g_ids: list[list[int]] = []
    used = 0
    for i in seq_ids:
        row, ln = times[i], lengths[i]
        best_j, best_g, best_cost = -1, -1, float("inf")
        for j in range(inst.dmin[i], nsz):
            h = heaps[j]
            if not h:
                continue
            load, g = h[0]
            t = row[j]
            if load + t + fixed[j] <= target and g_tokens[g] + ln <= cap * sizes[j]:
                # Prefer the size that costs the fewest rank-ms, then the emptier group.
                c = t * sizes[j]
                if c < best_cost:
                    best_j, best_g, best_cost = j, g, c
        if best_g < 0:
            for j in range(inst.dmin[i], nsz):
                if row[j] + fixed[j] <= target and used + sizes[j] <= ranks:
                    best_j = j
                    break
            if best_j < 0:
                return None
            best_g = len(g_size)
            g_size.append(sizes[best_j])
            g_load.append(0.0)
            g_tokens.append(0)
            g_ids.append([])
            used += sizes[best_j]
        else:
            heapq.heappop(heaps[best_j])
        g_load[best_g] += row[best_j]
        g_tokens[best_g] += ln
        g_ids[best_g].append(i)
        heapq.heappush(heaps[best_j], (g_load[best_g], best_g))
    return [(g_size[g], tuple(g_ids[g])) for g in range(len(g_size))]


def schedule_microbatch(
    inst: Instance,
    seq_ids: Sequence[int],
    cluster: Cluster,
    rel_tol: float = 2e-3,
    upper: float | None = None,
) -> tuple[float, list[GroupSpec]] | None:
    """Smallest target makespan the builder meets (bisection), with its placeable groups.

    Returns None when no target works: the sequences do not fit the ranks' memory together.
    """
    ids = sorted(seq_ids, key=lambda i: (-inst.lengths[i], i))
    if not ids:
        return 0.0, []
    lo = inst.microbatch_floor(ids)

    # Power-of-two sizes that divide the world size always tile (buddy allocation), so only
    # other mixes need the placement check inside the bisection.
    buddy = all(d & (d - 1) == 0 and inst.world_size % d == 0 for d in inst.sizes)

    def attempt(target: float) -> list[GroupSpec] | None:
        groups = build_groups(inst, ids, target)
        if groups is None or (not buddy and place_groups(inst, groups, cluster) is None):
            return None
        return groups

    best: list[GroupSpec] | None = None
    if upper is None:
        hi = lo
        for _ in range(40):
            best = attempt(hi)
            if best is not None:
                break
            hi *= 1.5
        if best is None:
            return None
    else:
        hi = upper
        best = attempt(hi)
        if best is None:
            return None
    hi = groups_makespan(inst, best)
    if lo >= hi:
        return hi, best
    first = attempt(lo)
    if first is not None:
        return groups_makespan(inst, first), first
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        got = attempt(mid)
        if got is None:
            lo = mid
        else:
            span = groups_makespan(inst, got)
            best, hi = got, span
    return hi, best
