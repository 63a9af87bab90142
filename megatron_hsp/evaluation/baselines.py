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
- ``flexsp-style``: FlexSP's heterogeneous planner *emulated* on our MILP solver
  (``flexsp_style_config``): our solver restricted to FlexSP's choices, priced by the cost model
  in use with the runtime's executable Ulysses x ring split. Not FlexSP's code: its released
  solver prices with its own hard-coded model (benchmarks/flexsp_solver_compare.py runs it).

Candidate N: sizes that divide the world size (a homogeneous layout must use every GPU), the
cluster can place as aligned blocks, and the cost model can cost. ``megatron-dcp`` lives in
``megatron_hsp.evaluation.torch_side.dcp_baseline`` because it runs megatron-core's scheduler, which
imports torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from megatron_hsp.planner.cost.costmodel import CostModel
from megatron_hsp.planner.errors import InfeasibleError, InputError
from megatron_hsp.planner.groupspace import largest_ulysses
from megatron_hsp.planner.plan import Group, MicroBatch, Plan
from megatron_hsp.planner.topology import Cluster

if TYPE_CHECKING:
    from megatron_hsp.planner.search.settings import SolverConfig

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


# ---------------------------------------------------------------------- FlexSP, emulated
# FlexSP's search space (arXiv 2412.01523; Galvatron's flexsp branch): power-of-two SP
# groups of at least 2 ranks (every sequence pays an all-to-all), micro-batches chunked
# contiguously by tokens, one MILP per micro-batch and nothing that moves sequences between
# micro-batches afterwards.
FLEXSP_STYLE_MIN_SIZE = 2
FLEXSP_STYLE_CHUNKING = "contiguous-tokens"


def flexsp_style_sizes(
    cost: CostModel, cluster: Cluster, sizes: Sequence[int] | None = None
) -> tuple[int, ...]:
    """FlexSP's group sizes here: powers of two >= 2 that tile the cluster and are costed
    (within ``sizes`` when the user restricted them)."""
    pool = set(cost.sizes) if sizes is None else set(sizes) & set(cost.sizes)
    out = tuple(
        d
        for d in cluster.power_of_two_sizes()
        if d >= FLEXSP_STYLE_MIN_SIZE and d in pool and cluster.size_fits(d)
    )
    if not out:
        raise InputError(
            f"flexsp-style: no power-of-two group size >= {FLEXSP_STYLE_MIN_SIZE} among "
            f"{sorted(pool)} fits {cluster.world_size} ranks; widen --sizes (e.g. pow2)"
        )
    return out


def flexsp_style_config(
    cost: CostModel,
    cluster: Cluster,
    base: SolverConfig | None = None,
    sizes: Sequence[int] | None = None,
) -> SolverConfig:
    """Our solver restricted to FlexSP's choices (the one place they are written down).

    ``base`` supplies what is not FlexSP's choice (backend, budget, seed, MILP work limits);
    the pipeline is dropped because FlexSP plans without one (``bench`` prices the plan under
    the pipeline in its own order, as every baseline). What remains differs from FlexSP's own
    solver: our bucketed MILP and HiGHS instead of its SCIP model, and our cost model's prices
    (docs/baselines.md).
    """
    from megatron_hsp.planner.search.settings import SolverConfig

    return dataclasses.replace(
        base or SolverConfig(),
        sizes=flexsp_style_sizes(cost, cluster, sizes),
        chunkings=(FLEXSP_STYLE_CHUNKING,),
        improve_evals=0,  # no local search between micro-batches
        use_milp=True,  # FlexSP always solves its MILP (hsp's greedy mode is not its choice)
        milp_min_gap=0.0,  # every micro-batch goes to the MILP, however close to its floor
        pipeline=None,
    )


def flexsp_style_plan(
    lengths: Sequence[int] | np.ndarray,
    cost: CostModel,
    cluster: Cluster,
    base: SolverConfig | None = None,
    sizes: Sequence[int] | None = None,
) -> Plan:
    """``flexsp-style``: one batch planned by ``flexsp_style_config``'s restricted solver."""
    from megatron_hsp.planner.search.solver import solve

    config = flexsp_style_config(cost, cluster, base, sizes)
    plan = solve([int(x) for x in lengths], cost, cluster, config)
    extra = {**plan.extra, "method": "flexsp-style", "milp_backend": plan.solver}
    return dataclasses.replace(plan, solver="flexsp-style", extra=extra)


# ---------------------------------------------------------------------- Megatron's own schedulers
# How much of a Megatron CP group's ring traffic shows (``RingAssumptions.overlap``), mapped to
# ``CostModel.seq_ms``'s ``ring`` knob; "cost-model" is the rule hsp's ring groups get.
RING_OVERLAP = {"cost-model": "overlap", "fully-hidden": "hidden", "exposed": "exposed"}


@dataclass(frozen=True)
class RingAssumptions:
    """How a Megatron CP group (pure ring attention, split (1, d)) is costed; docs/baselines.md.

    The default prices it exactly as the cost model prices any ring group, hsp's included
    (``CostModel.group_ms(lengths, d, split=(1, d))``): same ring-step figures, same overlap of
    each K/V transfer with the previous block's attention. The other values exist only to show
    the sensitivity of the comparison (``benchmarks/dcp_sensitivity.py``):

    overlap: "cost-model" (the one rule, the headline), "fully-hidden" (ring traffic free: the
        bound most favourable to Megatron) or "exposed" (no transfer hidden).
    fixed_per_sequence: charge the group's fixed cost once per sub-sample pass (upstream's
        dynamic-CP schedule runs one forward/backward per sequence) instead of once per group.
    ulysses: Megatron/TE hierarchical CP (``cp_comm_type="a2a+p2p"``,
        ``hierarchical_context_parallel_sizes``): all-to-all over this many ranks (e.g. a node),
        ring across; a group of d runs split (u, d/u) with u the largest degree dividing
        ``gcd(d, ulysses)`` and the query heads (``groupspace.largest_ulysses``). 1: pure p2p ring.
    """

    overlap: str = "cost-model"
    fixed_per_sequence: bool = False
    ulysses: int = 1

    def __post_init__(self) -> None:
        if self.overlap not in RING_OVERLAP:
            raise InputError(
                f"ring assumptions: overlap must be one of {sorted(RING_OVERLAP)}, "
                f"got {self.overlap!r}"
            )
        if self.ulysses < 1:
            raise InputError(f"ring assumptions: ulysses must be >= 1, got {self.ulysses}")

    def split(self, d: int, cost: CostModel) -> tuple[int, int]:
        """(ulysses, ring) a Megatron CP group of ``d`` runs with under these assumptions."""
        u = math.gcd(d, self.ulysses)
        if cost.heads is not None:
            u = largest_ulysses(u, cost.heads[0])
        return u, d // u


def ring_group_ms(
    lengths: Sequence[int] | np.ndarray, d: int, cost: CostModel, assume: RingAssumptions
) -> float:
    """Time (ms) of a Megatron CP group of ``d`` (pure ring) training ``lengths``.

    ``CostModel.group_ms`` at split ``(1, d)`` (``assume.split``); with ``fixed_per_sequence``
    the fixed cost is paid once per sequence (one pass each) instead of once.
    """
    s = np.asarray(lengths, dtype=np.float64)
    if s.size == 0:
        return 0.0
    split = assume.split(d, cost)
    ring = RING_OVERLAP[assume.overlap]
    passes = int(s.size) if assume.fixed_per_sequence else 1
    return float(cost.seq_ms(s, d, split, ring).sum()) + passes * cost.fixed_ms(d, split)


class PerSequenceMemory:
    """Memory check for plans whose groups run their sequences in separate passes.

    Upstream's dynamic-CP schedule trains each sub-sample of a group in its own forward/backward,
    so only one sequence at a time must fit; ``Plan.problems`` takes this instead of the cost
    model for such plans (``plan.extra['execution'] == SEQUENTIAL``).
    """

    def __init__(self, cost: CostModel) -> None:
        self._cost = cost

    def fits(self, lengths: Sequence[int], group_size: int) -> bool:
        return all(self._cost.fits([int(x)], group_size) for x in lengths)


SEQUENTIAL = "one-pass-per-sequence"


def memory_model_for(plan: Plan, cost: CostModel) -> CostModel | PerSequenceMemory:
    """The memory check that matches how ``plan`` executes (see ``PerSequenceMemory``)."""
    return PerSequenceMemory(cost) if plan.extra.get("execution") == SEQUENTIAL else cost


def cp_groups_of_microbatch(
    sample_ids_per_gpu: Sequence[Sequence[int]],
) -> list[tuple[int, list[int]]]:
    """(size, sample ids) per group of one Megatron scheduler micro-batch (its per-rank lists of
    sample ids): ranks holding the same sample form one CP group."""
    members: dict[int, set[int]] = {}
    for rank, ids in enumerate(sample_ids_per_gpu):
        for sid in ids:
            members.setdefault(int(sid), set()).add(rank)
    groups: dict[tuple[int, ...], list[int]] = {}
    for sid, ranks in members.items():
        groups.setdefault(tuple(sorted(ranks)), []).append(sid)
    return [(len(r), ids) for r, ids in sorted(groups.items())]


def plan_from_scheduler(
    lens: np.ndarray,
    cost: CostModel,
    cluster: Cluster,
    schedule: Callable[[list[tuple[int, int]]], list],
    *,
    method: str,
    who: str,
    sequential: bool,
    assume: RingAssumptions | None = None,
) -> Plan:
    """A Megatron scheduler's micro-batches as a ring ``Plan`` (both ``megatron-dcp`` baselines).

    ``schedule`` maps ``[(sample id, length)]`` to the scheduler's groups of sample ids per
    micro-batch; its internal assertions (e.g. "cannot redistribute") become an
    ``InfeasibleError`` naming ``method`` and ``who``.
    """
    try:
        sample_id_groups = schedule([(i, int(x)) for i, x in enumerate(lens.tolist())])
    except AssertionError as exc:
        raise InfeasibleError(f"{method}: {who} gave up: {exc}") from None
    layout = [cp_groups_of_microbatch(sample_ids) for sample_ids in sample_id_groups]
    return ring_plan_from_layout(
        lens,
        cost,
        cluster,
        layout,
        assume or RingAssumptions(),
        sequential=sequential,
        solver=method,
        extra={"method": method, "scheduler_microbatches": len(sample_id_groups)},
    )


def ring_plan_from_layout(
    lengths: Sequence[int] | np.ndarray,
    cost: CostModel,
    cluster: Cluster,
    layout: Sequence[Sequence[tuple[int, Sequence[int]]]],
    assume: RingAssumptions,
    *,
    sequential: bool,
    solver: str,
    extra: dict | None = None,
) -> Plan:
    """A ``Plan`` of Megatron CP groups: every micro-batch is one synchronised scheduler group.

    All groups of a micro-batch finish before the next starts (upstream synchronises between
    scheduler groups), so a micro-batch costs its slowest group, each group costed with
    ``ring_group_ms`` and recorded with its split (pure ring by default). ``sequential``
    groups train their sequences one pass each, so only the longest must fit; otherwise the whole
    pack must.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    unpriced = sorted(
        {size for mb in layout for size, ids in mb if ids and assume.split(size, cost)[1] > 1}
        - set(cost.ring_step_ms_per_token)
    )
    if unpriced and assume.overlap != "fully-hidden":
        method = solver.rsplit("-", 1)[0] if solver.startswith("dp-balanced") else solver
        raise InputError(
            f"{solver}: cost model {cost.name!r} has no ring_step_ms_per_token for group sizes "
            f"{unpriced}, so Megatron's ring attention cannot be priced; add "
            "coefficients.ring_step_ms_per_token to the cost model, or leave "
            f"{method} out of --methods"
        )
    for mb in layout:
        for size, ids in mb:
            glens = [int(lens[i]) for i in ids]
            need = [max(glens)] if (sequential and glens) else glens
            if glens and not cost.fits(need, size):
                raise InfeasibleError(
                    f"{solver}: a group of {size} holds {sum(need)} tokens in one pass, over its "
                    f"memory cap of {cost.capacity(size)} tokens"
                )
    plan = plan_from_layout(lens, cost, cluster, layout, solver=solver, extra=extra)
    if not sequential:  # a packed group is one forward/backward: one fixed cost
        assume = dataclasses.replace(assume, fixed_per_sequence=False)
    microbatches: list[MicroBatch] = []
    for mb in plan.microbatches:
        groups = tuple(
            dataclasses.replace(
                g,
                est_ms=ring_group_ms(g.lengths, g.size, cost, assume),
                ulysses=assume.split(g.size, cost)[0],
                ring=assume.split(g.size, cost)[1],
            )
            for g in mb.groups
        )
        microbatches.append(MicroBatch(groups, max(g.est_ms for g in groups)))
    info = {
        **plan.extra,
        "execution": SEQUENTIAL if sequential else "one-pass-per-group",
        "ring_assumptions": dataclasses.asdict(assume),
    }
    return dataclasses.replace(
        plan,
        microbatches=tuple(microbatches),
        est_step_ms=float(sum(mb.est_ms for mb in microbatches)),
        extra=info,
    )


def dp_balanced_layout(
    lengths: Sequence[int] | np.ndarray, cost: CostModel, world_size: int, cp: int
) -> list[list[tuple[int, list[int]]]]:
    """Megatron's ``dp_balanced`` packing scheduler, described from its behaviour.

    Sequences are packed in arrival order into packs of at most ``tokens_per_rank * cp`` tokens
    (a new pack starts when the next sequence would overflow); when the number of packs is not a
    multiple of the DP size, the last sequence of the latest multi-sequence pack becomes a pack of
    its own until it is; micro-batch ``i`` is packs ``i*dp .. i*dp+dp-1``, one per CP group.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.size == 0:
        raise InputError("the global batch is empty; nothing to plan")
    dp = world_size // cp
    limit = cost.capacity(cp)
    packs: list[list[int]] = []
    used = 0
    for sid, n in enumerate(lens.tolist()):
        if packs and used + n <= limit:
            packs[-1].append(sid)
            used += n
        else:
            packs.append([sid])
            used = n
    short = -len(packs) % dp
    i = len(packs) - 1
    while short > 0:
        if i < 0:
            raise InfeasibleError(
                f"dp-balanced-{cp}: {lens.size} sequences cannot fill {dp} data-parallel groups"
            )
        if len(packs[i]) > 1:
            packs.append([packs[i].pop()])
            short -= 1
        else:
            i -= 1
    return [[(cp, p) for p in packs[m : m + dp]] for m in range(0, len(packs), dp)]


def dp_balanced_plan(
    lengths: Sequence[int] | np.ndarray,
    cost: CostModel,
    cluster: Cluster,
    cp: int,
    assume: RingAssumptions | None = None,
) -> Plan:
    """``dp-balanced-<cp>``: static Megatron CP of ``cp`` with arrival-order sequence packing."""
    if cp not in homogeneous_sizes(cost, cluster, [cp]):
        raise InputError(
            f"dp-balanced-{cp}: the CP size must divide --gpus {cluster.world_size}, be a legal "
            f"group size and be costed by the model; choose from {homogeneous_sizes(cost, cluster)}"
        )
    layout = dp_balanced_layout(lengths, cost, cluster.world_size, cp)
    return ring_plan_from_layout(
        lengths,
        cost,
        cluster,
        layout,
        assume or RingAssumptions(),
        sequential=False,
        solver=f"dp-balanced-{cp}",
        extra={"method": f"dp-balanced-{cp}", "degree": cp},
    )


def dp_balanced_best_degree(
    batches: Sequence[Sequence[int] | np.ndarray],
    cost: CostModel,
    cluster: Cluster,
    sizes: Sequence[int] | None = None,
    assume: RingAssumptions | None = None,
) -> tuple[int, dict[int, list[Plan]]]:
    """``dp-balanced``: the one CP size with the least total over ``batches`` (hindsight)."""
    candidates = homogeneous_sizes(cost, cluster, sizes)
    per_degree: dict[int, list[Plan]] = {}
    for d in candidates:
        try:
            per_degree[d] = [dp_balanced_plan(b, cost, cluster, d, assume) for b in batches]
        except InfeasibleError:
            continue
    if not per_degree:
        raise InfeasibleError(
            f"dp-balanced: no single CP size in {candidates} fits every batch under the memory "
            "cap; use more GPUs, a larger --memory-cap-gb or --overlong drop/split"
        )
    best = min(sorted(per_degree), key=lambda d: sum(p.est_step_ms for p in per_degree[d]))
    return best, per_degree
