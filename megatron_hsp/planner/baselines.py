"""Homogeneous sequence-parallel baselines in our harness and cost model (numpy only).

- ``static-N``: every sequence trains in a group of N, i.e. static Megatron CP / DeepSpeed
  Ulysses with packing. Packing and micro-batch chunking are a faithful port of FlexSP's
  ``solve_homo_sp_ffd_bfd_globalbatch`` (PKU-DAIR/Hetu-Galvatron, branch flexsp,
  galvatron/flexsp_solver/solver.py, with ``BestFitDecreasing`` from utils.py), because FlexSP's
  published static and adaptive numbers come from exactly this code:

  1. best-fit-decreasing (stable sort by length, descending; best fit = least room left, first
     bin on ties) into bins of ``max(0.9 * tokens_per_rank * N, longest length)`` tokens;
  2. bins are groups; consecutive runs of ``world_size // N`` groups form micro-batches;
  3. ``fill_empty``: each empty group of the last micro-batch takes the lowest-id sequence of
     the nearest earlier group holding more than one;
  4. for N >= 16 and when step 3 had empty groups, tokens of the last micro-batch are evened
     out towards their mean (FlexSP's ``even_distribute``);
  5. a micro-batch costs its slowest group; a group over the (un-discounted) memory cap makes N
     infeasible.

- ``static-best``: the one N with the least summed step time over the whole run (hindsight).
- ``batchada``: the best N for each batch separately (FlexSP's ``adaptive``).

Candidate N: sizes that divide the world size (a homogeneous layout must use every GPU), the
cluster can place as aligned blocks, and the cost model can cost. ``megatron-dcp`` lives in
``megatron_hsp.megatron.dcp_baseline`` because it runs megatron-core's scheduler, which
imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_hsp.planner.costmodel import CostModel
from megatron_hsp.planner.errors import InfeasibleError, InputError
from megatron_hsp.planner.plan import Group, MicroBatch, Plan
from megatron_hsp.planner.topology import Cluster

FLEXSP_BIN_FILL = 0.9  # FlexSP packs bins to 90% of the memory-cap token capacity


def homogeneous_sizes(
    cost: CostModel, cluster: Cluster, sizes: Sequence[int] | None = None
) -> list[int]:
    """Degrees a homogeneous baseline may use on this cluster with this cost model."""
    pool = set(cost.sizes) if sizes is None else set(sizes)
    tiling = set(cluster.tiling_sizes())
    return [
        d
        for d in cluster.legal_sizes(pool)
        if d in tiling and (d == 1 or d in cost.a2a_ms_per_token)
    ]


def _best_fit_decreasing(lengths: np.ndarray, capacity: float) -> list[list[int]] | None:
    """FlexSP's ``BestFitDecreasing``: bins as lists of sequence ids, or None if one is too long."""
    order = np.argsort(-lengths, kind="stable")
    remaining = np.empty(len(lengths), dtype=np.float64)
    bins: list[list[int]] = []
    for sid in order.tolist():
        s = float(lengths[sid])
        if s > capacity:
            return None
        used = len(bins)
        if used:
            room = remaining[:used] - s
            room[room < 0] = np.inf
            best = int(np.argmin(room))
            if np.isfinite(room[best]):
                remaining[best] -= s
                bins[best].append(sid)
                continue
        remaining[used] = capacity - s
        bins.append([sid])
    return bins


def static_layout(
    lengths: Sequence[int] | np.ndarray, cost: CostModel, world_size: int, degree: int
) -> list[list[list[int]]] | None:
    """Micro-batches of ``world_size // degree`` groups (sequence-id lists), FlexSP's way.

    Returns None when ``degree`` cannot hold the batch under the memory cap.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.size == 0:
        raise InputError("the global batch is empty; nothing to plan")
    per_mb = world_size // degree
    capacity = max(cost.tokens_per_rank * degree * FLEXSP_BIN_FILL, float(lens.max()))
    bins = _best_fit_decreasing(lens, capacity)
    if bins is None:
        return None
    mb_num = (len(bins) + per_mb - 1) // per_mb
    empty = per_mb * mb_num - len(bins)
    groups: list[list[int]] = [sorted(b) for b in bins] + [[] for _ in range(empty)]
    tokens = [int(lens[g].sum()) if g else 0 for g in groups]

    # fill_empty: FlexSP asserts a donor exists; with fewer sequences than groups we leave the
    # rest empty instead (a valid plan: idle ranks), where FlexSP would stop with an error.
    g0, g1, g2 = (mb_num - 1) * per_mb, mb_num * per_mb - empty, mb_num * per_mb
    for i in range(g1, g2):
        j = g1 - 1
        while j >= 0 and len(groups[j]) <= 1:
            j -= 1
        if j < 0:
            break
        k = groups[j].pop(0)
        groups[i].append(k)
        tokens[j] -= int(lens[k])
        tokens[i] += int(lens[k])

    # even_distribute (FlexSP: for degree >= 16, only when the last micro-batch had empty
    # groups). FlexSP scans k = 0, 1, ... over all ids and moves k from j to i while i is below
    # the mean and j above it; scanning only j's members in id order is the same walk (others
    # do nothing). FlexSP would index past the end if the scan ran out; we stop there.
    if degree >= 16 and empty > 0:
        avg = sum(tokens[g0:g2]) // per_mb
        for i in range(g0 + 1, g2):
            if tokens[i] > avg:
                continue
            for j in range(g0, i):
                for k in list(groups[j]):
                    if not (tokens[i] < avg and tokens[j] > avg and len(groups[j]) > 1):
                        break
                    if tokens[i] + int(lens[k]) <= capacity:
                        groups[j].remove(k)
                        groups[i].append(k)
                        tokens[j] -= int(lens[k])
                        tokens[i] += int(lens[k])
                groups[i].sort()

    layout = [groups[m * per_mb : (m + 1) * per_mb] for m in range(mb_num)]
    for mb in layout:
        for g in mb:
            if g and not cost.fits(lens[g].tolist(), degree):
                return None
    return layout


def plan_from_layout(
    lengths: Sequence[int] | np.ndarray,
    cost: CostModel,
    cluster: Cluster,
    layout: Sequence[Sequence[tuple[int, Sequence[int]]]],
    *,
    solver: str,
    status: str = "heuristic",
    extra: dict | None = None,
) -> Plan:
    """A ``Plan`` from micro-batches of ``(group_size, seq_ids)`` placed as aligned blocks.

    Groups are placed largest first, each at the lowest free aligned block, which tiles the
    cluster whenever the sizes sum to the world size and each divides the next larger one.
    Empty groups cost nothing; a micro-batch costs its slowest group.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    microbatches: list[MicroBatch] = []
    for mb in layout:
        placed: list[Group] = []
        free = [True] * cluster.world_size
        for size, ids in sorted(mb, key=lambda t: -t[0]):
            block = next(
                (b for b in cluster.aligned_blocks(size) if all(free[r] for r in b)),
                None,
            )
            if block is None:
                raise InfeasibleError(
                    f"groups of sizes {sorted((s for s, _ in mb), reverse=True)} cannot be "
                    f"placed as aligned blocks on {cluster.world_size} ranks"
                )
            for r in block:
                free[r] = False
            ids = sorted(int(i) for i in ids)
            glens = tuple(int(x) for x in lens[ids]) if ids else ()
            est = cost.group_ms(glens, size) if ids else 0.0
            placed.append(Group(tuple(block), tuple(ids), glens, est, *cost.recorded_split(size)))
        for r in (r for r in range(cluster.world_size) if free[r]):
            placed.append(Group((r,), (), (), 0.0, *cost.recorded_split(1)))
        placed.sort(key=lambda g: g.ranks[0])
        microbatches.append(MicroBatch(tuple(placed), max(g.est_ms for g in placed)))
    return Plan(
        world_size=cluster.world_size,
        gpus_per_node=cluster.gpus_per_node,
        microbatches=tuple(microbatches),
        cost_model=cost.name,
        est_step_ms=float(sum(mb.est_ms for mb in microbatches)),
        solver=solver,
        status=status,
        extra=dict(extra or {}),
    )


def static_plan(
    lengths: Sequence[int] | np.ndarray, cost: CostModel, cluster: Cluster, degree: int
) -> Plan:
    """``static-<degree>``: every sequence in a group of ``degree`` (FlexSP's BFD packing)."""
    if degree not in homogeneous_sizes(cost, cluster, [degree]):
        raise InputError(
            f"static-{degree}: degree must divide --gpus {cluster.world_size}, be a legal group "
            f"size and be costed by the model; choose from {homogeneous_sizes(cost, cluster)}"
        )
    layout = static_layout(lengths, cost, cluster.world_size, degree)
    if layout is None:
        longest = int(np.max(lengths))
        raise InfeasibleError(
            f"static-{degree}: the batch does not fit groups of {degree} under the memory cap "
            f"({cost.capacity(degree)} tokens per group, longest sequence {longest}); use a "
            "larger degree"
        )
    return plan_from_layout(
        lengths,
        cost,
        cluster,
        [[(degree, g) for g in mb] for mb in layout],
        solver=f"static-{degree}",
        extra={"method": f"static-{degree}", "degree": degree},
    )


def static_plans_by_degree(
    lengths: Sequence[int] | np.ndarray,
    cost: CostModel,
    cluster: Cluster,
    sizes: Sequence[int] | None = None,
) -> dict[int, Plan]:
    """Every feasible homogeneous plan of one batch, keyed by degree."""
    out: dict[int, Plan] = {}
    for d in homogeneous_sizes(cost, cluster, sizes):
        try:
            out[d] = static_plan(lengths, cost, cluster, d)
        except InfeasibleError:
            continue
    return out


def batchada_plan(
    lengths: Sequence[int] | np.ndarray,
    cost: CostModel,
    cluster: Cluster,
    sizes: Sequence[int] | None = None,
) -> Plan:
    """``batchada``: the fastest homogeneous degree for this batch (FlexSP's ``adaptive``).

    Ties go to the smaller degree, as FlexSP's ascending scan with a strict ``<`` does.
    """
    plans = static_plans_by_degree(lengths, cost, cluster, sizes)
    if not plans:
        raise InfeasibleError(
            f"batchada: no homogeneous degree in {homogeneous_sizes(cost, cluster, sizes)} "
            "fits this batch under the memory cap"
        )
    best = min(sorted(plans), key=lambda d: plans[d].est_step_ms)
    p = plans[best]
    return Plan(
        **{
            **{f: getattr(p, f) for f in ("world_size", "gpus_per_node", "microbatches")},
            "cost_model": p.cost_model,
            "est_step_ms": p.est_step_ms,
            "solver": "batchada",
            "status": "heuristic",
            "extra": {"method": "batchada", "degree": best},
        }
    )


def static_best_degree(
    batches: Sequence[Sequence[int] | np.ndarray],
    cost: CostModel,
    cluster: Cluster,
    sizes: Sequence[int] | None = None,
) -> tuple[int, dict[int, list[Plan]]]:
    """The one degree with the least total step time over ``batches`` (chosen in hindsight).

    Returns the degree and, for every degree feasible on all batches, its plans.
    """
    candidates = homogeneous_sizes(cost, cluster, sizes)
    per_degree: dict[int, list[Plan]] = {}
    for d in candidates:
        plans: list[Plan] = []
        for b in batches:
            try:
                plans.append(static_plan(b, cost, cluster, d))
            except InfeasibleError:
                break
        else:
            per_degree[d] = plans
    if not per_degree:
        raise InfeasibleError(
            f"static-best: no single degree in {candidates} fits every batch under the memory "
            "cap; use more GPUs, a larger --memory-cap-gb or --overlong drop/split"
        )
    best = min(sorted(per_degree), key=lambda d: sum(p.est_step_ms for p in per_degree[d]))
    return best, per_degree
