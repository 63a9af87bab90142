"""Lower bound on the step time: what no plan can beat (docs/design.md section 2).

Three facts, each true of every valid plan, combined by ``max``:

1. Work: a micro-batch's slowest group takes at least its ranks' average load, and every group
   pays its fixed cost, so ``makespan_j >= W_j / N + b_min``. Each sequence costs at least
   ``min_d d * T(s, d)`` rank-ms (over sizes whose memory holds it), and memory forces at least
   ``ceil(tokens / (N * cap))`` micro-batches. Summing: ``W_min / N + m_min * b_min``.
2. Critical path: the micro-batch holding sequence ``s`` lasts at least ``min_d T(s, d) + b_d``.
3. Exclusive sequences: two sequences whose smallest fitting groups each need more than half the
   ranks, and which together overflow the largest group's memory, can share neither a group nor
   a micro-batch, so each pays its own best time; the remaining forced micro-batches pay at
   least ``b_min``.
4. Critical sequence with memory: the micro-batch holding a long sequence ``s`` in a group of
   ``d`` lasts ``T(s, d) + b + e`` (``e``: time other sequences add to that group). Its other
   ``N - d`` ranks can absorb at most ``min((N - d) * (T + e), G((N - d) * cap))`` rank-ms of
   the remaining work, where ``G(X)`` is the most minimum-work any ``X`` tokens carry
   (fractional knapsack by work per token), and ``s``'s own group at most ``d * e``. Whatever
   is left runs in other micro-batches at ``W / N + b`` each, and the tokens that do not fit
   force how many. Minimised over ``d`` and over ``e`` (piecewise linear with non-negative
   slope, so only ``e = 0``, the points where one more micro-batch's tokens fit, and the point
   where no other micro-batch is needed matter). Work moved into ``s``'s group is also capped
   by ``G`` of the tokens that extra time can carry.
   This is what catches a 64k sequence whose 32-rank group outlasts the memory-bound
   single-rank groups beside it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from megatron_hsp.planner.costmodel import CostModel
from megatron_hsp.planner.instance import Instance, check_lengths, resolve_sizes
from megatron_hsp.planner.topology import Cluster


def lower_bound_ms(
    lengths: Sequence[int],
    cost: CostModel,
    cluster: Cluster,
    sizes: Sequence[int] | None = None,
) -> float:
    """Step time (ms) no plan of this batch can beat on this cluster and cost model."""
    allowed = resolve_sizes(cost, cluster, sizes)
    checked = check_lengths(lengths, cost, allowed)
    return instance_lower_bound(Instance.build(checked, cost, cluster, allowed))


def instance_lower_bound(inst: Instance, deadline: float | None = None) -> float:
    """Max of facts 1-4; past ``deadline`` (a ``time.perf_counter()`` value) a weaker bound.

    Facts 1-3 are linear in the batch and always computed. Fact 4 runs per critical sequence and
    per group size; it is a ``max`` term, so dropping a sequence's fact 4 keeps the bound valid
    (only weaker). The deadline is checked before every group size, so the overrun is at most one
    ``_star_in_size`` call (a bisection of 80 steps, microseconds to milliseconds: the margin
    docs/solver.md states) plus the linear facts.
    """
    n = inst.world_size
    b = inst.min_fixed
    m_min = max(1, math.ceil(sum(inst.lengths) / (n * inst.cap)))
    work = sum(inst.work_min) / n + m_min * b
    best = [inst.best_time(i) for i in range(len(inst.lengths))]
    critical = max(best) + (m_min - 1) * b
    half_biggest = inst.cap * max(inst.sizes) / 2
    exclusive_ids = [
        i
        for i, ln in enumerate(inst.lengths)
        if 2 * inst.sizes[inst.dmin[i]] > n and ln > half_biggest
    ]
    exclusive = sum(best[i] for i in exclusive_ids) + max(0, m_min - len(exclusive_ids)) * b
    crit_mem = 0.0
    for i in _most_critical(inst, best, 3):
        star_bound = _critical_with_memory(inst, i, m_min, deadline)
        if star_bound is None:  # cut by the deadline: a minimum over part of the sizes is no bound
            break
        crit_mem = max(crit_mem, star_bound)
    return max(work, critical, exclusive, crit_mem)


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() >= deadline


def _most_critical(inst: Instance, best: list[float], k: int) -> list[int]:
    return sorted(range(len(best)), key=lambda i: (-best[i], i))[:k]


def _critical_with_memory(
    inst: Instance, star: int, m_min: int, deadline: float | None = None
) -> float | None:
    """Fact 4 for sequence ``star`` (module docstring), or None when the deadline cut it."""
    if _past(deadline):
        return None
    lengths = np.asarray(inst.lengths, dtype=np.float64)
    work = np.asarray(inst.work_min, dtype=np.float64)
    # G(X): fractional knapsack of minimum work by density (ms per token), densest first. The
    # star is included, which only raises G and keeps the bound valid.
    order = np.argsort(-(work / lengths), kind="stable")
    tok_prefix = np.concatenate([[0.0], np.cumsum(lengths[order])])
    work_prefix = np.concatenate([[0.0], np.cumsum(work[order])])

    def most_work(tokens: float) -> float:
        if tokens <= 0:
            return 0.0
        k = int(np.searchsorted(tok_prefix, tokens, side="right")) - 1
        if k >= len(order):
            return float(work_prefix[-1])
        frac = (tokens - tok_prefix[k]) / lengths[order[k]]
        return float(work_prefix[k] + frac * work[order[k]])

    rest_work = float(work.sum()) - inst.work_min[star]
    total_tokens = float(lengths.sum())
    bound = math.inf
    for j in range(inst.dmin[star], len(inst.sizes)):
        if _past(deadline):
            return None
        bound = min(bound, _star_in_size(inst, star, j, m_min, rest_work, total_tokens, most_work))
    return bound


def _star_in_size(
    inst: Instance,
    star: int,
    j: int,
    m_min: int,
    rest_work: float,
    total_tokens: float,
    most_work: Callable[[float], float],
) -> float:
    """Fact 4 with the star in a group of ``sizes[j]``: minimum over the extra time ``e``."""
    n, cap, b = inst.world_size, inst.cap, inst.min_fixed
    d = inst.sizes[j]
    t = inst.times[star][j]
    s_star = inst.lengths[star]
    others_mem = (n - d) * cap
    absorb_mem = most_work(others_mem)
    # Tokens a size-d group adds per ms of extra time, at best (shortest sequences).
    per_token_ms = inst.times_per_token_floor[j]
    room_in_group = max(0, d * cap - s_star)
    rest_tokens = total_tokens - s_star - min(others_mem, total_tokens - s_star)

    def carried(e: float) -> float:
        """Tokens the star's group can add in extra time ``e``."""
        return min(room_in_group, e / per_token_ms) if per_token_ms > 0 else room_in_group

    def absorbed(e: float) -> float:
        """Most minimum-work the star's micro-batch can take besides the star, given e."""
        x2 = carried(e)
        split = min((n - d) * (t + e), absorb_mem) + min(d * e, most_work(x2))
        return min(split, most_work(others_mem + x2))

    candidates_e = [0.0]
    if rest_tokens > 0 and per_token_ms > 0:
        # Each further micro-batch's worth of tokens moved into the group removes one b.
        for r in range(1, m_min + 1):
            needed = rest_tokens - max(0, math.ceil(rest_tokens / (n * cap)) - r) * n * cap
            if needed <= 0 or needed > room_in_group:
                break
            candidates_e.append(needed * per_token_ms)
    # Where the star's micro-batch absorbs all remaining work (no other one needed):
    # absorbed() is non-decreasing in e, so bisect.
    tol = 1e-9 * max(1.0, rest_work)
    e_hi = room_in_group * per_token_ms + rest_work / d + t
    if absorbed(e_hi) >= rest_work - tol:
        e_lo = 0.0
        for _ in range(80):
            mid = 0.5 * (e_lo + e_hi)
            if absorbed(mid) >= rest_work - tol:
                e_hi = mid
            else:
                e_lo = mid
        candidates_e.append(e_hi)
    best = math.inf
    for e in candidates_e:
        left = rest_work - absorbed(e)
        left = left if left > 100 * tol else 0.0  # bisection stops within tol
        outside = max(0.0, rest_tokens - carried(e))
        others = max(m_min - 1, math.ceil(outside / (n * cap) - 1e-12))
        if left > 0:
            others = max(others, 1)
        best = min(best, t + inst.fixed[j] + e + left / n + others * b)
    return best
