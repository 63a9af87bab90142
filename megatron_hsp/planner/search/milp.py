"""Aggregated MILP for one micro-batch, modelled in PuLP, solved by HiGHS or CBC.

FlexSP gives every potential group its own column per length bucket (``A[bucket, group]``, about
``buckets x N`` integers plus one binary per group). Groups of one size are interchangeable, so we
aggregate by size instead:

    x[k, d]  integer   sequences of bucket k trained in groups of size d
    n[d]     integer   groups of size d, as binary digits beta[d, b] (n[d] = sum 2^b beta[d, b])
    w[d, b]  >= 0      beta[d, b] * M, linearised with the incumbent makespan as big-M
    v[k, d]  binary    "some bucket-k sequence runs in a size-d group" where that alone could
                       set the makespan (its time exceeds the micro-batch floor)
    M        >= floor  the makespan, minimised

    sum_d x[k, d] = count_k                          every sequence scheduled
    sum_k x[k, d] * t(k, d) + b_d * n[d] <= n[d] * M  size-d groups' load spread over n[d] groups
    sum_k x[k, d] * s_k <= n[d] * d * cap            memory, aggregated per size
    sum_d d * n[d] <= N                              ranks
    x[k, d] <= count_k * v[k, d],  M >= (t_max(k, d) + b_d) * v[k, d]   critical path

``t(k, d)`` is the bucket's mean time, ``t_max`` its longest member's. Variables grow as
``buckets x sizes + sizes x log N``: ~150 for 64 GPUs, ~250 for 1024, independent of the
sequence count. The aggregate ignores how sequences split between same-size groups, so a concrete
assignment (longest first into the least-loaded group of the chosen size, memory checked) turns
the counts into groups, and the result replaces the greedy schedule only when it is faster.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Sequence

import pulp

from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.search.budget import Cap
from megatron_hsp.planner.search.greedy import groups_fit, groups_makespan
from megatron_hsp.planner.search.highs import silence_banner
from megatron_hsp.planner.search.instance import GroupSpec, Instance
from megatron_hsp.planner.topology import Cluster

_MIN_SOLVE_S = 0.02  # below this a MILP cannot even be built; keep the greedy schedule


def cbc_path() -> str | None:
    """Path of a CBC binary: the ``cbcbox`` wheel (``pip install pulp[cbc]``), else PATH."""
    try:
        import cbcbox  # type: ignore[import-not-found]

        path = cbcbox.cbc_bin_path()
        if path and shutil.which(path):
            return str(path)
    except Exception:
        pass
    return shutil.which("cbc")


def require_cbc() -> str:
    path = cbc_path()
    if path is None:
        raise InputError(
            "solver backend 'cbc' needs the CBC binary: `pip install cbcbox` (or "
            "`pip install 'pulp[cbc]'`, or put `cbc` on PATH), or use --solver highs"
        )
    return path


def buckets_of(inst: Instance, seq_ids: Sequence[int], max_buckets: int) -> list[list[int]]:
    """Split longest-first ids into runs whose lengths differ by at most a common ratio.

    The ratio grows until at most ``max_buckets`` runs remain, so long sequences (spread out in
    length) keep buckets of their own while the dense short tail shares a few.
    """
    ids = sorted(seq_ids, key=lambda i: (-inst.lengths[i], i))
    ratio = 1.05
    while True:
        out: list[list[int]] = []
        for i in ids:
            if out and inst.lengths[out[-1][0]] <= ratio * inst.lengths[i]:
                out[-1].append(i)
            else:
                out.append([i])
        if len(out) <= max_buckets:
            return out
        ratio *= 1.25


def solve_microbatch(
    inst: Instance,
    cluster: Cluster,
    seq_ids: Sequence[int],
    incumbent: float,
    time_limit_s: float,
    backend: str = "highs",
    seed: int = 0,
    max_buckets: int = 16,
    max_nodes: int = 300,
) -> tuple[float, list[GroupSpec] | None, bool, bool]:
    """(makespan, groups, proven, timed_out): the MILP's schedule if it beats ``incumbent``,
    else None.

    ``proven`` says the solver proved its bucketed model optimal (or that nothing beats the
    incumbent), so the caller may stop refining this micro-batch. ``timed_out``: the wall-clock
    ``time_limit_s``, not the node limit, ended the solve (HiGHS's model status; CBC's run as
    long as its limit).
    """
    sizes, nsz, n = inst.sizes, len(inst.sizes), inst.world_size
    floor = inst.microbatch_floor(seq_ids)
    if incumbent <= floor * (1 + 1e-6):
        return incumbent, None, True, False
    buckets = buckets_of(inst, seq_ids, max_buckets)
    prob = pulp.LpProblem("hsp_microbatch", pulp.LpMinimize)
    big_m = incumbent
    mk = prob.add_variable("M", lowBound=floor, upBound=big_m)
    prob += mk
    x: dict[tuple[int, int], pulp.LpVariable] = {}
    for k, members in enumerate(buckets):
        jmin = max(inst.dmin[i] for i in members)
        for j in range(jmin, nsz):
            x[k, j] = prob.add_variable(f"x_{k}_{j}", 0, len(members), cat="Integer")
        prob += pulp.lpSum(x[k, j] for j in range(jmin, nsz)) == len(members), f"all_{k}"
    n_expr = {}
    w_sum = {}
    for j, d in enumerate(sizes):
        digits = max(1, (n // d).bit_length())
        betas = [prob.add_variable(f"b_{j}_{b}", cat="Binary") for b in range(digits)]
        ws = [prob.add_variable(f"w_{j}_{b}", 0, big_m) for b in range(digits)]
        for b in range(digits):
            prob += ws[b] <= big_m * betas[b], f"wub_{j}_{b}"
            prob += ws[b] <= mk, f"wm_{j}_{b}"
            prob += ws[b] >= mk - big_m * (1 - betas[b]), f"wlb_{j}_{b}"
        n_expr[j] = pulp.lpSum((1 << b) * betas[b] for b in range(digits))
        w_sum[j] = pulp.lpSum((1 << b) * ws[b] for b in range(digits))
        prob += n_expr[j] <= n // d, f"nmax_{j}"
    prob += pulp.lpSum(d * n_expr[j] for j, d in enumerate(sizes)) <= n, "ranks"
    for j, d in enumerate(sizes):
        cols = [(k, x[k, j]) for k in range(len(buckets)) if (k, j) in x]
        if not cols:
            prob += n_expr[j] == 0, f"unused_{j}"
            continue
        load = pulp.lpSum(
            var * (sum(inst.times[i][j] for i in buckets[k]) / len(buckets[k])) for k, var in cols
        )
        prob += load + inst.fixed[j] * n_expr[j] <= w_sum[j], f"time_{j}"
        toks = pulp.lpSum(
            var * (sum(inst.lengths[i] for i in buckets[k]) / len(buckets[k])) for k, var in cols
        )
        prob += toks <= n_expr[j] * d * inst.cap, f"mem_{j}"
        # Any size-d group in use must exist.
        prob += pulp.lpSum(var for _, var in cols) <= len(seq_ids) * n_expr[j], f"exists_{j}"
        for k, var in cols:
            tmax = max(inst.times[i][j] for i in buckets[k]) + inst.fixed[j]
            if tmax > floor:
                v = prob.add_variable(f"v_{k}_{j}", cat="Binary")
                prob += var <= len(buckets[k]) * v, f"use_{k}_{j}"
                prob += mk >= tmax * v, f"crit_{k}_{j}"
    solver = _make_solver(backend, time_limit_s, seed, max_nodes)
    started = time.monotonic()  # not the search's clock: the solver's limit is real seconds
    stats = prob.solve(solver)
    proven = stats.status == pulp.LpSolveStatus.Optimal
    if backend == "highs":
        timed_out = str(prob.solverModel.getModelStatus()).endswith("kTimeLimit")
    else:
        timed_out = not proven and time.monotonic() - started >= solver.timeLimit * (1 - 1e-3)
    if not stats.has_solution or any(v.varValue is None for v in x.values()):
        return incumbent, None, proven, timed_out
    counts = {key: round(var.varValue or 0) for key, var in x.items()}
    n_groups = {j: round(pulp.value(n_expr[j]) or 0) for j in range(nsz)}
    groups = _realise(inst, buckets, counts, n_groups)
    if groups is None or not groups_fit(inst, groups, cluster):
        return incumbent, None, proven, timed_out
    span = groups_makespan(inst, groups)
    if span < incumbent - 1e-9:
        return span, groups, proven, timed_out
    return incumbent, None, proven, timed_out


def _make_solver(backend: str, time_limit_s: float, seed: int, max_nodes: int) -> pulp.LpSolver:
    """One thread, fixed seed and a node limit: the same input gives the same answer unless the
    wall-clock limit (a safety net sized by the caller's budget) cuts in first."""
    limit = max(_MIN_SOLVE_S, time_limit_s) if math.isfinite(time_limit_s) else None
    if backend == "cbc":
        return pulp.COIN_CMD(
            path=require_cbc(),
            msg=False,
            timeLimit=limit,
            threads=1,
            randomSeed=seed,
            maxNodes=max_nodes,
            gapRel=1e-3,
        )
    silence_banner()  # PuLP constructs a highspy.Highs per solve (planner/search/highs.py)
    return pulp.HiGHS(
        msg=False,
        timeLimit=limit,
        threads=1,
        random_seed=seed,
        mip_rel_gap=1e-3,
        mip_max_nodes=max_nodes,
        # HiGHS's sub-MIP heuristics took 1 s of CPU within 10 nodes on a code-heavy-tail
        # micro-batch (ZeRO-1 Llama 3 8B, 64 GPUs) and found nothing the node search missed:
        # without them the node limit bounds the work (docs/results/solver.md).
        mip_heuristic_run_rins=False,
        mip_heuristic_run_rens=False,
        # Restarts (presolve and the root's cuts again), strong branching, the root's
        # reduced-cost sub-MIP and cut rounds below the root: much of HiGHS's time on short-
        # heavy micro-batches, and the suite plans the same without them (docs/solver.md,
        # "Solve time, 2026-11-27 (second)").
        mip_allow_restart=False,
        mip_pscost_minreliable=0,
        mip_heuristic_run_root_reduced_cost=False,
        mip_allow_cut_separation_at_nodes=False,
    )


def _realise(
    inst: Instance,
    buckets: list[list[int]],
    counts: dict[tuple[int, int], int],
    n_groups: dict[int, int],
) -> list[GroupSpec] | None:
    """Concrete groups from the MILP's counts: longest members to the largest sizes, then LPT."""
    sizes, nsz = inst.sizes, len(inst.sizes)
    wanted: dict[int, list[int]] = {j: [] for j in range(nsz)}
    for k, members in enumerate(buckets):
        pos = 0  # members are longest first; hand them to sizes from large to small
        for j in range(nsz - 1, -1, -1):
            c = counts.get((k, j), 0)
            wanted[j].extend(members[pos : pos + c])
            pos += c
        if pos != len(members):
            return None
    g_size: list[int] = []
    g_load: list[float] = []
    g_tok: list[int] = []
    g_ids: list[list[int]] = []
    for j in range(nsz):
        if wanted[j] and n_groups[j] == 0:
            return None
        base = len(g_size)
        for _ in range(n_groups[j]):
            g_size.append(sizes[j])
            g_load.append(0.0)
            g_tok.append(0)
            g_ids.append([])
        order = sorted(wanted[j], key=lambda i: (-inst.times[i][j], i))
        for i in order:
            best, best_load = -1, math.inf
            for g in range(base, base + n_groups[j]):
                if g_tok[g] + inst.lengths[i] <= inst.cap * sizes[j] and g_load[g] < best_load:
                    best, best_load = g, g_load[g]
            if best < 0:
                return None
            g_load[best] += inst.times[i][j]
            g_tok[best] += inst.lengths[i]
            g_ids[best].append(i)
    return [(g_size[g], tuple(g_ids[g])) for g in range(len(g_size)) if g_ids[g]]


def refine_microbatches(
    inst: Instance,
    cluster: Cluster,
    microbatches: list[tuple[float, list[GroupSpec]]],
    deadline: float | Cap,
    backend: str = "highs",
    seed: int = 0,
    max_buckets: int = 16,
    slice_s: float = math.inf,
    max_nodes: int = 300,
    min_gap: float = 0.03,
    max_solves: int | None = None,
) -> tuple[list[tuple[float, list[GroupSpec]]], str, dict[str, int]]:
    """Run the MILP on each micro-batch, biggest gap to its floor first.

    Work is limited by counts: ``max_solves`` MILPs at most (None: no limit; the rest keep their
    greedy schedules and count as ``skipped_limit``) and ``max_nodes`` branch-and-bound nodes
    each, on one thread with a fixed seed, so results do not depend on the machine's speed.
    ``deadline`` (a ``budget.now()`` value or a ``Cap``) and ``slice_s`` (per MILP) are safety
    caps only: a MILP they stop, or one they leave out, is recorded on the cap (``milp``) and
    counted in ``cut_by_cap``.

    Micro-batches within ``min_gap`` of their floor are left alone: the MILP rarely finds the
    last percent and costs tens of milliseconds each.

    Status: ``optimal`` when every micro-batch is proven optimal for its bucketed model or lies
    within ``min_gap`` of its floor (the planner's optimality tolerance, like a MIP gap);
    ``time_limit`` when a node or time limit stopped a MILP first, or ``max_solves`` left one
    out; ``fallback`` when the wall-clock budget ran out before a micro-batch that needed the
    MILP got it, and the greedy schedule stands for it.
    """
    out = list(microbatches)
    floors = [inst.microbatch_floor([i for _, ids in g for i in ids]) for _, g in out]
    order = sorted(range(len(out)), key=lambda b: (-(out[b][0] - floors[b]), b))
    stats = {
        "solved": 0,
        "proven": 0,
        "improved": 0,
        "skipped_budget": 0,
        "skipped_limit": 0,
        "near_floor": 0,
        "cut_by_cap": 0,
    }
    cap = Cap.of(deadline)
    for b in order:
        span, groups = out[b]
        if span <= floors[b] * (1 + min_gap):
            stats["near_floor"] += 1
            continue
        if max_solves is not None and stats["solved"] >= max_solves:
            stats["skipped_limit"] += 1
            continue
        share = min(cap.left(), slice_s)
        if share < _MIN_SOLVE_S:
            cap.mark("milp")  # the cap, not a count, left this micro-batch out
            stats["skipped_budget"] += 1
            continue
        ids = [i for _, g in groups for i in g]
        stats["solved"] += 1
        new_span, new_groups, proven, timed_out = solve_microbatch(
            inst, cluster, ids, span, share, backend, seed, max_buckets, max_nodes
        )
        if timed_out:
            stats["cut_by_cap"] += 1
            cap.mark("milp")
        stats["proven"] += int(proven)
        if new_groups is not None:
            out[b] = (new_span, new_groups)
            stats["improved"] += 1
    if stats["skipped_budget"]:
        status = "fallback" if stats["improved"] == 0 else "time_limit"
    elif stats["proven"] == stats["solved"] and not stats["skipped_limit"]:
        status = "optimal"
    else:
        status = "time_limit"
    return out, status, stats
