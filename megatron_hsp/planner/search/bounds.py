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
   ``d`` lasts ``T(s, d) + b_d + e`` (``e``: time other sequences add to that group). Its other
   ``N - d`` ranks can absorb at most ``min((N - d) * (T + e + b_d - b), G((N - d) * cap))``
   rank-ms (their own groups pay at least ``b``, the smallest fixed cost) of
   the remaining work, where ``G(X)`` is the most minimum-work any ``X`` tokens carry
   (fractional knapsack by work per token), and ``s``'s own group at most ``d * e``. Whatever
   is left runs in other micro-batches at ``W / N + b`` each, and the tokens that do not fit
   force how many. Minimised over ``d`` and over ``e`` (piecewise linear with non-negative
   slope, so only ``e = 0``, the points where one more micro-batch's tokens fit, and the point
   where no other micro-batch is needed matter). Work moved into ``s``'s group is also capped
   by ``G`` of the tokens that extra time can carry.
   This is what catches a 64k sequence whose 32-rank group outlasts the memory-bound
   single-rank groups beside it.
5. Memory granularity: whole sequences fill a group's memory only as a dual feasible function
   allows, so sequences over half a rank's memory either take more micro-batches or bigger
   groups; a Lagrangian bound trades the two (``_memory_packing_bound``).

These facts hold where every pass is a barrier (``CostModel.pass_barrier``). Where a group runs
several passes between barriers (``cost/execution.py``'s segments), memory forces passes of
groups that the other groups overlap, not micro-batches the whole cluster waits through, and
``_multi_pass_bound`` states each fact per pass and group instead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megatron_hsp.planner.cost.costmodel import CostModel
from megatron_hsp.planner.search.budget import Cap
from megatron_hsp.planner.search.highs import add_row, quiet_highs
from megatron_hsp.planner.search.instance import Instance, check_lengths, resolve_sizes
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


def instance_lower_bound(inst: Instance, deadline: float | Cap | None = None) -> float:
    """Max of facts 1-5; past ``deadline`` (a ``budget.now()`` value or a ``Cap``, which then
    records ``bound`` as cut) a weaker bound.

    Facts 1-3 are linear in the batch and always computed. Fact 4 runs per critical sequence and
    per group size; it is a ``max`` term, so dropping a sequence's fact 4 keeps the bound valid
    (only weaker). The deadline is checked before every group size, so the overrun is at most one
    ``_star_in_size`` call (a bisection of 80 steps, microseconds to milliseconds: the margin
    docs/solver.md states) plus the linear facts.
    """
    if inst.multi_pass:
        return _multi_pass_bound(inst, deadline)
    n = inst.world_size
    b = inst.min_fixed
    m_min = max(1, math.ceil(sum(inst.lengths) / (n * inst.cap)))
    work = sum(inst.work_min) / n + m_min * b
    best = inst.best
    critical = max(best) + (m_min - 1) * b
    exclusive_ids = _exclusive(inst)
    exclusive = sum(best[i] for i in exclusive_ids) + max(0, m_min - len(exclusive_ids)) * b
    crit_mem = 0.0
    for i in _most_critical(inst, best, 3):
        star_bound = _critical_with_memory(inst, i, m_min, deadline)
        if star_bound is None:  # cut by the deadline: a minimum over part of the sizes is no bound
            break
        crit_mem = max(crit_mem, star_bound)
    mem_pack = _memory_packing_bound(inst, m_min, deadline)
    return max(work, critical, exclusive, crit_mem, mem_pack)


def _exclusive(inst: Instance) -> list[int]:
    """Fact 3's sequences: each needs more than half the ranks and any two overflow the largest
    group's memory, so no two share a pass, and (with one group over half the ranks per layout)
    any two in one segment run one after the other in the same group."""
    half_biggest = inst.cap * max(inst.sizes) / 2
    n = inst.world_size
    return [
        i
        for i, ln in enumerate(inst.lengths)
        if 2 * inst.sizes[inst.dmin[i]] > n and ln > half_biggest
    ]


def _multi_pass_bound(inst: Instance, deadline: float | Cap | None = None) -> float:
    """Facts 1-5 where a group runs several passes between barriers (``Instance.multi_pass``).

    The per-micro-batch reasoning above charges every micro-batch a fixed cost for the whole
    cluster and lets memory force micro-batches that all ranks wait through. Here a segment
    (passes of one layout) lasts as long as its busiest group, so memory forces *passes of
    groups*, which the other groups overlap. What stays true, per segment ``S >= max_g dur_g >=
    sum_g d_g dur_g / N`` (``dur_g``: the sum of group ``g``'s passes, each its sequences' time
    plus ``b_d``), hence over the step

        S >= (sum_i d_i T_i(d_i) + F) / N,   F = sum over passes of d b_d >= b R,

    ``R`` the rank-passes (sum of the passes' group sizes): a pass of ``d`` holds at most
    ``d cap`` tokens, so ``R >= R_min = ceil(tokens / cap)``.

    1. Work: ``S >= (W_min + b R_min) / N``.
    2. Critical path: the group holding sequence ``s`` in a group of ``d`` runs at least
       ``T(s, d) + b_d``, and the step's area then holds ``s`` at ``d T(s, d)`` plus that pass's
       fixed ``d b_d``: ``S >= min_d max(T(s, d) + b_d, (W_min - w_s + d T(s, d) +
       max(b R_min, d b_d)) / N)`` (the per-micro-batch fact 4's idle other ranks do not exist:
       they run further passes beside it).
    3. Exclusive sequences (``_exclusive``) run one after the other: ``S >= sum best``.
    5. Memory granularity: a dual feasible function ``f`` gives ``sum_i slot_i(d_i) <= R`` as in
       ``_memory_packing_bound``, so for any ``mu >= 0``, ``S >= (b / N - mu) R + sum_i min_d
       (d T_i(d) / N + mu slot_i(d))``, minimised over ``R >= R_min``.
    Sound whether or not the runtime really barriers between passes (a plan with more barriers
    costs more), so used wherever ``CostModel.pass_barrier`` is false.
    """
    n, b, cap = inst.world_size, inst.min_fixed, inst.cap
    r_min = math.ceil(sum(inst.lengths) / cap)
    w_min = float(sum(inst.work_min))
    work = (w_min + b * r_min) / n
    best = inst.best
    exclusive = sum(best[i] for i in _exclusive(inst))
    critical = 0.0
    for i in _most_critical(inst, best, 3):
        star = math.inf
        for j in range(inst.dmin[i], len(inst.sizes)):
            d, t, bd = inst.sizes[j], inst.times[i][j], inst.fixed[j]
            area = w_min - inst.work_min[i] + d * t + max(b * r_min, d * bd)
            star = min(star, max(t + bd, area / n))
        critical = max(critical, star)
    mem_pack = _memory_packing_bound(inst, r_min, deadline)
    return max(work, max(best), exclusive, critical, mem_pack)


def _dff(k: int, x: np.ndarray) -> np.ndarray:
    """Fekete-Schepers dual feasible function ``u^(k)`` on [0, 1]: values of any items whose
    sizes sum to at most 1 sum to at most 1."""
    y = (k + 1) * x
    return np.where(np.abs(y - np.round(y)) < 1e-9, x, np.floor(y + 1e-12) / k)


# Fact 5 is skipped above this many (sequence, size) pairs: its cost is ~150 passes over them.
MEMORY_PACKING_MAX_CELLS = 300_000


def _memory_packing_bound(inst: Instance, m_min: int, deadline: float | Cap | None = None) -> float:
    """Fact 5: memory granularity against fixed costs, in Lagrangian form.

    Fact 1 packs tokens perfectly into ``m_min`` micro-batches. But a group of ``d`` holds at
    most ``d * cap`` tokens of whole sequences, so for a dual feasible function ``f`` its
    sequences satisfy ``sum_i d f(s_i / (d cap)) <= d``, and over a plan of ``m`` micro-batches
    ``sum_i slot_i(d_i) <= N m`` with ``slot_i(d) = d f(s_i / (d cap))``: a sequence just over
    half a rank's memory takes a whole rank at ``d = 1``, so the plan pays more micro-batches
    (``b`` each) or puts such sequences in bigger groups (more work). With fact 1 per plan,
    ``S >= m b + sum_i d_i T_i(d_i) / N``; adding ``mu (sum_i slot_i - N m) <= 0`` for any
    ``mu >= 0`` and minimising per sequence,

        S >= min_{m >= m_min} max_mu [ m (b - mu N) + sum_i min_d (d T_i(d) / N + mu slot_i(d)) ].

    Maximised over ``f`` in ``u^(1..3)`` and a grid of ``mu``. Valid for any grid (each ``mu``
    gives a bound); None of it depends on the plan. Returns 0 when skipped (too large, deadline).

    Where groups run several passes between barriers (``inst.multi_pass``), ``m_min`` is the
    rank-passes ``R_min`` instead and each costs ``b / N`` (``_multi_pass_bound``): the same
    form with ``m N`` read as ``R``, minimised over real ``R >= R_min`` (``_envelope_min``).
    """
    n = inst.world_size
    if len(inst.lengths) * len(inst.sizes) > MEMORY_PACKING_MAX_CELLS or _past(deadline):
        return 0.0
    if inst.multi_pass:
        return _pass_packing_bound(inst, m_min, deadline)
    times = inst.times_np
    lengths = np.asarray(inst.lengths, dtype=np.float64)
    sizes = np.asarray(inst.sizes, dtype=np.float64)
    cols = np.arange(len(inst.sizes))
    fits = cols[None, :] >= np.asarray(inst.dmin)[:, None]
    work = sizes[None, :] * times / n
    b = inst.min_fixed
    scale = max(b, float(np.sum(inst.work_min)) / (n * m_min)) / n
    mus = np.concatenate([[0.0], scale * np.geomspace(1e-3, 1e2, 48)])
    ms = np.arange(m_min, len(inst.lengths) + 1, dtype=np.float64)
    x = np.minimum(1.0, lengths[:, None] / (sizes[None, :] * inst.cap))
    best = 0.0
    for k in (1, 2, 3):
        slot = sizes[None, :] * _dff(k, x)
        lagr = np.full(len(ms), -np.inf)
        for mu in mus:
            if _past(deadline):
                return best
            per_seq = np.where(fits, work + mu * slot, np.inf).min(axis=1).sum()
            lagr = np.maximum(lagr, ms * (b - mu * n) + per_seq)
        best = max(best, float(lagr.min()))
    return best


def _pass_packing_bound(inst: Instance, r_min: int, deadline: float | Cap | None) -> float:
    """Fact 5 per rank-pass: ``S >= min_{R >= R_min} max_mu [(b / N - mu) R + sum_i min_d
    (d T_i(d) / N + mu slot_i(d))]`` (``_memory_packing_bound``; ``R`` the plan's rank-passes)."""
    n, b = inst.world_size, inst.min_fixed
    lengths = np.asarray(inst.lengths, dtype=np.float64)
    sizes = np.asarray(inst.sizes, dtype=np.float64)
    cols = np.arange(len(inst.sizes))
    fits = cols[None, :] >= np.asarray(inst.dmin)[:, None]
    work = sizes[None, :] * inst.times_np / n
    unit = max(b, float(np.sum(inst.work_min)) / max(1, r_min)) / n
    # mu = 0 is the only line that keeps its slope non-negative where b = 0.
    mus = np.concatenate([[0.0], unit * np.geomspace(1e-3, 1e2, 48)]) if b > 0 else np.zeros(1)
    x = np.minimum(1.0, lengths[:, None] / (sizes[None, :] * inst.cap))
    best = 0.0
    for k in (1, 2, 3):
        slot = sizes[None, :] * _dff(k, x)
        icepts = []
        for mu in mus:
            if _past(deadline):
                return best
            icepts.append(float(np.where(fits, work + mu * slot, np.inf).min(axis=1).sum()))
        best = max(best, _envelope_min(b / n - mus, np.asarray(icepts), float(r_min)))
    return best


def _envelope_min(slopes: np.ndarray, icepts: np.ndarray, lo: float) -> float:
    """``min max_i (slopes_i R + icepts_i)`` over integers ``R >= lo`` (rank-passes are whole),
    one slope non-negative: a convex piecewise-linear function's integer minimum is at ``lo``
    or next to where two of its lines cross."""
    up, down = slopes >= 0, slopes < 0
    points = [lo]
    if down.any():
        su, iu = slopes[up][:, None], icepts[up][:, None]
        sd, idn = slopes[down][None, :], icepts[down][None, :]
        cross = ((idn - iu) / (su - sd)).ravel()
        cross = cross[cross > lo]
        points += np.floor(cross).tolist() + np.ceil(cross).tolist()
        points = [max(lo, r) for r in points]
    rs = np.asarray(points)
    return float((slopes[None, :] * rs[:, None] + icepts[None, :]).max(axis=1).min())


def _past(deadline: float | Cap | None) -> bool:
    return deadline is not None and Cap.of(deadline).past("bound")


def _most_critical(inst: Instance, best: list[float], k: int) -> list[int]:
    """The ``k`` sequences with the longest own critical path, ties by index."""
    arr = np.asarray(best, dtype=np.float64)
    return np.lexsort((np.arange(len(arr)), -arr))[:k].tolist()


def _critical_with_memory(
    inst: Instance, star: int, m_min: int, deadline: float | Cap | None = None
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

    # The other ranks' groups pay at least ``b`` of the micro-batch's ``t + b_d + e``, so each
    # of those ranks has ``t + e + (b_d - b)`` for work: where fixed costs grow with the group
    # size (every calibrated model), a large star's group leaves the small groups beside it
    # more than ``t + e`` (without this term fact 4 exceeded a real 16,384-GPU plan by 0.03%).
    slack = inst.fixed[j] - b

    def absorbed(e: float) -> float:
        """Most minimum-work the star's micro-batch can take besides the star, given e."""
        x2 = carried(e)
        split = min((n - d) * (t + e + slack), absorb_mem) + min(d * e, most_work(x2))
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


# --- LP relaxation over micro-batch patterns (column generation) -----------------------------


@dataclass(frozen=True)
class LpBound:
    """The column-generation bound and how it was reached (reported beside the step bound)."""

    bound_ms: float  # valid even when not converged (Farley's scaled dual bound)
    lp_ms: float  # restricted master LP value at the end (== bound_ms when converged)
    converged: bool
    iterations: int
    classes: int


class HighsModel:
    """A HiGHS model on one thread, built by rows and columns given as (index, coefficient)
    entries: the master LPs and pricing MILPs of both column-generation bounds (this one and
    ``evaluation/placement_bound.py``) are assembled with it."""

    def __init__(self) -> None:
        self.h = quiet_highs()
        self.h.setOptionValue("threads", 1)

    def empty_rows(self, bounds: Sequence[tuple[float, float]]) -> None:
        """Rows ``lo <= . <= hi`` with no entries yet (a master's; columns fill them)."""
        for lo, hi in bounds:
            self.h.addRow(float(lo), float(hi), 0, np.array([], np.int32), np.array([]))

    def column(self, cost: float, entries: dict[int, float], lb: float = 0.0,
               ub: float = math.inf, integer: bool = False) -> int:  # fmt: skip
        """A column with objective ``cost`` and ``entries`` in existing rows; its index."""
        idx = self.h.getNumCol()
        self.h.addCol(float(cost), float(lb), float(ub), len(entries),
                      np.array(list(entries), np.int32),
                      np.array(list(entries.values()), dtype=np.float64))  # fmt: skip
        if integer:
            self.h.changeColIntegrality(idx, _integer())
        return idx

    def var(self, lb: float, ub: float, integer: bool = False) -> int:
        """An empty column with no cost (a pricing variable; rows come after)."""
        return self.column(0.0, {}, lb, ub, integer)

    def row(self, lb: float, ub: float, terms: list[tuple[int, float]]) -> int:
        """``lb <= sum coef * x[col] <= ub``; its index."""
        idx = self.h.getNumRow()
        add_row(self.h, lb, ub, terms)
        return idx

    def price(self, costs: np.ndarray, rel_gap: float, time_limit_s: float) -> tuple:
        """Maximise ``costs`` (the reduced values of a new column) within the limits:
        (the MILP's dual bound, its best objective, its solution or None when it has none)."""
        import highspy

        self.h.changeObjectiveSense(highspy.ObjSense.kMaximize)
        self.h.changeColsCost(len(costs), np.arange(len(costs), dtype=np.int32), costs)
        self.h.setOptionValue("mip_rel_gap", rel_gap)
        self.h.setOptionValue("time_limit", time_limit_s)
        self.h.run()
        info = self.h.getInfo()
        sol = self.h.getSolution().col_value
        feasible = bool(sol) and int(info.primal_solution_status) == 2
        return (
            float(info.mip_dual_bound),
            float(info.objective_function_value),
            (list(sol) if feasible else None),
        )

    def solve_master(self) -> tuple[float, list[float]]:
        """(objective, row duals) of the LP."""
        self.h.run()
        return self.h.getInfo().objective_function_value, list(self.h.getSolution().row_dual)


def _integer():
    import highspy

    return highspy.HighsVarType.kInteger


def dual_bound(
    dual_obj: float, z_star: float, z_rmp: float, m_low: float, most_mbs: int
) -> tuple[float, bool]:
    """(bound, converged) of a column generation stopped with duals worth ``dual_obj``, the
    pricing's dual bound ``z_star`` on the best reduced value and master value ``z_rmp``.

    Farley's ``D / (1 + z* / M_low)`` (every pattern has ``M >= M_low > 0``, so the scaled
    duals are feasible) or the Lagrangian ``D - m_max z*`` (a plan of ``m <= m_max``
    micro-batches costs at least ``D - m z*``), the larger; also when "converged": the
    convergence tolerance (and HiGHS's own, at the same scale) lets a column worth up to ``tol``
    go unadded, so z* is taken as at least ``tol``. With a fixed cost near 1e-7 ms that column
    is the whole difference (two 1-token sequences that share one group were priced as two
    micro-batches, the bound above the optimum). On real batches this costs ``m_max * tol``.
    """
    tol = 1e-7 * max(1.0, z_rmp)
    converged = z_star <= tol
    z_eff = max(z_star, tol)
    bound = max(dual_obj / (1.0 + z_eff / m_low), dual_obj - most_mbs * z_eff, 0.0)
    if converged:
        bound = min(z_rmp, bound)
    return bound, converged


def lp_lower_bound_ms(
    lengths: Sequence[int],
    cost: CostModel,
    cluster: Cluster,
    sizes: Sequence[int] | None = None,
    *,
    rel_width: float = 0.05,
    max_iterations: int = 400,
    time_limit_s: float = 20.0,
    crit_share: float = 0.3,
    price_limit_s: float = 1.0,
    upper_ms: float | None = None,
) -> LpBound:
    """Configuration-LP bound of one batch (see ``instance_lp_bound``)."""
    allowed = resolve_sizes(cost, cluster, sizes)
    checked = check_lengths(lengths, cost, allowed)
    inst = Instance.build(checked, cost, cluster, allowed)
    return instance_lp_bound(
        inst,
        cost,
        rel_width=rel_width,
        max_iterations=max_iterations,
        time_limit_s=time_limit_s,
        crit_share=crit_share,
        price_limit_s=price_limit_s,
        upper_ms=upper_ms,
    )


def length_classes(ids: Sequence[int], lengths: Sequence[int], rel_width: float) -> list[list[int]]:
    """Sequences by length, each class within ``1 + rel_width`` of its shortest (first) member
    (the LP bounds price a class at that member: time and memory grow with length)."""
    classes: list[list[int]] = []
    for i in sorted(ids, key=lambda i: lengths[i]):
        if classes and lengths[i] <= (1 + rel_width) * lengths[classes[-1][0]]:
            classes[-1].append(i)
        else:
            classes.append([i])
    return classes


@dataclass
class _ConfigLp:
    """The configuration LP's classes, master and pricing MILP (``instance_lp_bound``)."""

    count: list[int]  # sequences per class
    tk: list[list[float]]  # class time per size, at its shortest member
    master: HighsModel
    price: HighsModel
    mvar: int
    gvar: dict[int, int]  # size index -> groups of that size
    avar: dict[tuple[int, int], int]  # (class, size index) -> sequences in groups of that size
    w_true: float  # the batch's exact minimum work
    m_low: float  # the cheapest pattern's makespan


def _config_lp(inst: Instance, cost: CostModel, rel_width: float, crit_share: float) -> _ConfigLp:
    """Classes, the master LP (rows 0..nk-1 cover classes, row nk the work row) with its first
    columns, and the pricing MILP, built once (only its objective changes)."""
    n_ranks, sizes, fixed = inst.world_size, inst.sizes, inst.fixed
    classes = length_classes(range(len(inst.lengths)), inst.lengths, rel_width)
    rep = [inst.lengths[c[0]] for c in classes]
    count = [len(c) for c in classes]
    nk = len(classes)
    fits = [[j for j, d in enumerate(sizes) if rep[k] <= cost.capacity(d)] for k in range(nk)]
    tk = [[float(np.asarray(cost.seq_ms([rep[k]], d)[0], dtype=float).item()) for d in sizes]
          for k in range(nk)]  # fmt: skip
    w_true = float(sum(inst.work_min))
    best_k = [min(tk[k][j] + fixed[j] for j in fits[k]) for k in range(nk)]

    master = HighsModel()
    master.empty_rows([(float(c), math.inf) for c in count] + [(w_true, math.inf)])
    master.column(1.0, {nk: float(n_ranks)})  # idle area: keeps the work row feasible
    for k in range(nk):
        j = min(fits[k], key=lambda j: tk[k][j] + fixed[j])
        m = tk[k][j] + fixed[j]
        master.column(m, {k: 1.0, nk: n_ranks * m - sizes[j] * fixed[j]})

    price = HighsModel()
    price.h.setOptionValue("mip_rel_gap", 1e-6)
    mvar = price.var(0.0, math.inf)
    # Per micro-batch, ``g[d]`` counts groups; where groups run several passes between barriers
    # (``inst.multi_pass``) a pattern is a segment and ``g[d]`` counts its passes of groups of
    # ``d`` (each pays ``b_d`` and holds ``capacity(d)`` tokens), not bounded by the ranks.
    most_passes = len(inst.lengths)
    gvar = {j: price.var(0.0, float(most_passes if inst.multi_pass else n_ranks // d), True)
            for j, d in enumerate(sizes)}  # fmt: skip
    avar: dict[tuple[int, int], int] = {}
    zvar: dict[tuple[int, int], int] = {}
    # Only classes whose best time is at least ``crit_share`` of the longest keep integer counts
    # and a critical-path binary; the rest are fractional and never bind M (a relaxation: more
    # patterns, so still a bound). 0.3 made column generation several times faster than 0.05 on
    # the suite's code-heavy-tail and bimodal batches, at the same restricted-master value.
    critical = [best_k[k] >= crit_share * max(best_k) for k in range(nk)]
    for k in range(nk):
        for j in fits[k]:
            per_mb = (n_ranks // sizes[j]) * (cost.capacity(sizes[j]) // rep[k])
            most = count[k] if inst.multi_pass else min(count[k], per_mb)
            if most <= 0:
                continue
            avar[k, j] = price.var(0.0, float(most), critical[k])
            if critical[k]:
                zvar[k, j] = price.var(0.0, 1.0, True)
    if not inst.multi_pass:
        price.row(-math.inf, float(n_ranks), [(gvar[j], float(d)) for j, d in enumerate(sizes)])
    for j, d in enumerate(sizes):
        terms = [(avar[k, jj], float(rep[k])) for (k, jj) in avar if jj == j]
        if terms:
            price.row(-math.inf, 0.0, [*terms, (gvar[j], -float(cost.capacity(d)))])
    work = [(v, sizes[j] * tk[k][j]) for (k, j), v in avar.items()]
    work += [(gvar[j], d * fixed[j]) for j, d in enumerate(sizes)]
    price.row(-math.inf, 0.0, [*work, (mvar, -float(n_ranks))])
    for (k, j), z in zvar.items():
        v = avar[k, j]
        price.row(-math.inf, 0.0, [(v, 1.0), (z, -float(price.h.getLp().col_upper_[v]))])
        price.row(-math.inf, 0.0, [(z, tk[k][j] + fixed[j]), (mvar, -1.0)])
    m_low = min(best_k)
    return _ConfigLp(count, tk, master, price, mvar, gvar, avar, w_true, m_low)


def instance_lp_bound(
    inst: Instance,
    cost: CostModel,
    *,
    rel_width: float = 0.05,
    max_iterations: int = 400,
    time_limit_s: float = 20.0,
    crit_share: float = 0.3,
    price_limit_s: float = 1.0,
    upper_ms: float | None = None,
) -> LpBound:
    """Step time no plan beats, from the LP relaxation of a micro-batch-pattern formulation.

    Why: the combinatorial bound above reasons about one critical sequence at a time; on batches
    with many long sequences every micro-batch has one, and the bound falls 15-40% short. The
    configuration LP charges every micro-batch at once.

    Sequences are grouped into classes of lengths within ``1 + rel_width`` of each other and each
    class is priced at its *shortest* member (time, tokens and which sizes fit are monotone in the
    length, so this only relaxes). A *pattern* is one micro-batch: integer counts ``a[k, d]`` of
    class-``k`` sequences in groups of size ``d``, group counts ``g[d]`` and a makespan ``M`` with

        sum_d d g[d] <= N                                  ranks
        sum_k l_k a[k, d] <= capacity(d) g[d]                memory, per size
        sum_{k,d} a[k, d] d T(l_k, d) + sum_d d b_d g[d] <= N M       work
        M >= T(l_k, d) + b_d   wherever a[k, d] >= 1       critical path

    Every micro-batch of every valid plan is such a pattern. Where groups run several passes
    between barriers (``inst.multi_pass``) a pattern is a segment instead: ``g[d]`` counts its
    passes in groups of ``d``, without the ranks row (a segment's groups fit the ranks, their
    passes need not), and the work row holds because the segment's area ``N M`` is at least
    every group's ``d`` times its passes' sum. Either way the step time is at least

        min sum_p M_p lambda_p  s.t.  sum_p a_pk lambda_p >= n_k  (each class covered)
                                      sum_p (N M_p - F_p) lambda_p >= W   (true minimum work)
                                      lambda >= 0

    (``F_p``: the pattern's fixed rank-ms; ``W``: the batch's exact ``sum work_min``, which makes
    up for the rounded-down class lengths; an empty pattern with ``M = 1`` keeps it feasible.)
    Columns come from a pricing MILP (HiGHS). When a limit stops it first, ``dual_bound`` gives
    a valid bound from the last duals (``m_max``: the sequence count, or ``upper_ms / b_min`` when
    a plan's step time ``upper_ms`` is given, since no better plan has more micro-batches).
    """
    t_end = time.perf_counter() + time_limit_s
    n_ranks, sizes, fixed = inst.world_size, inst.sizes, inst.fixed
    lp = _config_lp(inst, cost, rel_width, crit_share)
    nk = len(lp.count)
    iterations, z_rmp, z_star = 0, 0.0, math.inf
    while True:
        z_rmp, duals = lp.master.solve_master()
        pi = [max(0.0, float(duals[k])) for k in range(nk)]
        sigma = max(0.0, float(duals[nk]))
        remaining = t_end - time.perf_counter()
        if iterations >= max_iterations or remaining <= 0:
            break
        iterations += 1
        costs = np.zeros(lp.price.h.getNumCol())
        costs[lp.mvar] = sigma * n_ranks - 1.0
        for j, d in enumerate(sizes):
            costs[lp.gvar[j]] = -sigma * d * fixed[j]
        for (k, _j), v in lp.avar.items():
            costs[v] = pi[k]
        limit = max(0.05, min(price_limit_s, remaining))
        z_bound, found, x = lp.price.price(costs, 1e-6, limit)
        z_star = max(0.0, z_bound)  # no pattern prices above this
        tol = 1e-7 * max(1.0, z_rmp)
        if z_star <= tol or not x or found <= tol:
            break  # converged, or no improving column found (then Farley's bound below)
        counts: dict[int, float] = {}
        for (k, _j), v in lp.avar.items():
            if x[v] > 1e-9:
                counts[k] = counts.get(k, 0) + x[v]
        f_p = sum(sizes[j] * fixed[j] * round(x[lp.gvar[j]]) for j in range(len(sizes)))
        m = float(x[lp.mvar])
        lp.master.column(m, {**counts, nk: n_ranks * m - f_p})
    dual_obj = sum(p * c for p, c in zip(pi, lp.count, strict=True)) + sigma * lp.w_true
    most_mbs = len(inst.lengths)
    if upper_ms is not None and inst.min_fixed > 0:
        most_mbs = min(most_mbs, math.floor(upper_ms / inst.min_fixed))
    bound, converged = dual_bound(dual_obj, z_star, z_rmp, lp.m_low, most_mbs)
    return LpBound(bound * (1 - 1e-7), z_rmp, converged, iterations, nk)
