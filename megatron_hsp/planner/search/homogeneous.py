"""Homogeneous layouts (static CP/Ulysses packing, Megatron's ``dp_balanced`` packing) and the
plan a layout makes, torch-free, so that both the planner and ``evaluation/baselines.py`` use them.

Why in the planner: ``solve`` scores these layouts beside its own search and never returns a plan
priced worse than the best of them (hsp's plan space contains each of them: every layout is a
sequence of passes of aligned groups, which the runtime executes at the cost model's split).
``evaluation/baselines.py`` documents where each comes from (FlexSP's ``BestFitDecreasing``
packing, Megatron's ``dp_balanced`` scheduler) and builds the named baselines on them.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Sequence

import numpy as np

from megatron_hsp.planner.cost.costcore import CostModel
from megatron_hsp.planner.cost.execution import price, segment_increments
from megatron_hsp.planner.errors import InfeasibleError, InputError
from megatron_hsp.planner.plan import Group, MicroBatch, Plan
from megatron_hsp.planner.search.greedy import first_fit_starts
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
    """FlexSP's ``BestFitDecreasing``: bins as lists of sequence ids, or None if one is too long.

    Each sequence goes to the bin whose room left is the smallest that holds it (ties: the
    first bin), else to a new bin. The rooms are kept sorted as (room, bin) pairs, so the best
    fit is one bisection instead of a pass over every bin (thousands of numpy calls per batch
    and size). The rooms are the capacity less whole token counts, exact in float64 (a multiple
    of the capacity's last bit, no larger than it), so comparing rooms is comparing what is
    left after the sequence, as FlexSP's rule is written.
    """
    order = np.argsort(-lengths, kind="stable")
    rooms: list[tuple[float, int]] = []  # (room left, bin index), ascending
    bins: list[list[int]] = []
    for sid, n in zip(order.tolist(), lengths[order].tolist(), strict=True):
        s = float(n)
        if s > capacity:
            return None
        k = bisect.bisect_left(rooms, (s, -1))  # the first bin with room >= s
        if k < len(rooms):
            room, b = rooms.pop(k)
            bisect.insort(rooms, (room - s, b))
            bins[b].append(sid)
            continue
        bisect.insort(rooms, (capacity - s, len(bins)))
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
    split: Callable[[int], tuple[int, int]] | None = None,
    ring: str = "overlap",
) -> Plan:
    """A ``Plan`` from passes of ``(group_size, seq_ids)`` placed as aligned blocks, priced by
    the execution model (``execution.price``).

    Groups are placed largest first, each at the lowest free aligned block, which tiles the
    cluster whenever the sizes sum to the world size and each divides the next larger one; ranks
    left over are idle groups of one. ``split`` gives the (ulysses, ring) a group of a size runs
    with (default: the cost model's, ``CostModel.recorded_split``); ``ring`` is
    ``CostModel.seq_ms``'s sensitivity knob.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    split_of = split or cost.recorded_split
    microbatches: list[MicroBatch] = []
    splits: dict[int, tuple[int, int]] = {}  # per size, asked once
    mixes: dict[tuple[int, ...], tuple[int, ...] | None] = {}
    for mb in layout:
        blocks = _place(mb, cluster, mixes)
        if blocks is None:
            raise InfeasibleError(
                f"groups of sizes {sorted((s for s, _ in mb), reverse=True)} cannot be "
                f"placed as aligned blocks on {cluster.world_size} ranks"
            )
        placed: list[Group] = []
        used = bytearray(cluster.world_size)  # 1: the rank is in a group
        for start, size, ids in blocks:
            used[start : start + size] = b"\x01" * size
            glens = tuple(lens[ids].tolist()) if ids else ()
            if size not in splits:
                splits[size] = split_of(size)
            block = tuple(range(start, start + size))
            placed.append(Group(block, tuple(ids), glens, 0.0, *splits[size]))
        for r in (r for r in range(cluster.world_size) if not used[r]):
            placed.append(Group((r,), (), (), 0.0, *cost.recorded_split(1)))
        placed.sort(key=lambda g: g.ranks[0])
        microbatches.append(MicroBatch(tuple(placed)))
    plan = Plan(
        world_size=cluster.world_size,
        gpus_per_node=cluster.gpus_per_node,
        microbatches=tuple(microbatches),
        cost_model=cost.name,
        solver=solver,
        status=status,
        extra=dict(extra or {}),
    )
    return price(plan, cost, ring)


Layout = Sequence[Sequence[tuple[int, Sequence[int]]]]


def _place(
    mb: Sequence[tuple[int, Sequence[int]]],
    cluster: Cluster,
    mixes: dict[tuple[int, ...], tuple[int, ...] | None],
) -> list[tuple[int, int, list[int]]] | None:
    """One pass's groups as (first rank, size, sorted ids): largest first, each at the lowest
    free aligned block (``plan_from_layout``'s rule, and ``layout_step_ms``'s); None where one
    finds no free block. An illegal size raises, naming the legal ones.

    The starts are a function of the sizes alone, and a layout's passes repeat a few mixes (a
    homogeneous layout, one): ``mixes`` (one per layout) keeps each mix's starts."""
    ordered = sorted(mb, key=lambda t: -t[0])
    sizes = tuple(size for size, _ in ordered)
    if sizes not in mixes:
        mixes[sizes] = _first_free_blocks(sizes, cluster)
    starts = mixes[sizes]
    if starts is None:
        return None
    return [
        (start, size, sorted(map(int, ids)))
        for start, (size, ids) in zip(starts, ordered, strict=True)
    ]


def _first_free_blocks(sizes: tuple[int, ...], cluster: Cluster) -> tuple[int, ...] | None:
    """Each size (largest first) at the lowest free aligned block (``greedy.first_fit_starts``,
    the search's rule); None where one finds none. An illegal size raises, naming the legal
    ones, unless a size before it found no block."""
    n = cluster.world_size
    k = next((i for i, size in enumerate(sizes) if not cluster.size_fits(size)), len(sizes))
    starts = first_fit_starts(sizes[:k], cluster, n, bytearray(n))
    if starts is not None and k < len(sizes):
        cluster.aligned_blocks(sizes[k])  # raises, naming the legal sizes
    return None if starts is None else tuple(starts)


def homogeneous_layouts(
    lengths: Sequence[int] | np.ndarray,
    cost: CostModel,
    cluster: Cluster,
    sizes: Sequence[int] | None = None,
) -> dict[str, Layout]:
    """Every static (FlexSP packing) and ``dp_balanced`` layout of one batch that can be built,
    keyed ``static-N`` / ``dp-balanced-N``: what ``solve`` scores beside its own search. Not yet
    placed, priced or validated (``dp_balanced`` packs by tokens and can overflow memory)."""
    out: dict[str, Layout] = {}
    for d in homogeneous_sizes(cost, cluster, sizes):
        static = static_layout(lengths, cost, cluster.world_size, d)
        if static is not None:
            out[f"static-{d}"] = [[(d, g) for g in mb] for mb in static]
        with contextlib.suppress(InfeasibleError):
            out[f"dp-balanced-{d}"] = dp_balanced_layout(lengths, cost, cluster.world_size, d)
    return out


def layout_step_ms(
    lengths: Sequence[int] | np.ndarray, cost: CostModel, cluster: Cluster, layout: Layout
) -> float | None:
    """``plan_from_layout(...).est_step_ms`` to the bit, without building the plan (None where
    the layout does not place). Why: ``solve`` prices a dozen layouts of hundreds of groups per
    batch and needs the plan of only the cheapest valid one; building each cost more than its
    search's last stage. The same placement (largest first, lowest free aligned block), the same
    pass times (``execution.pass_times``'s rule: one ``seq_ms`` call per size, each group's
    sequences summed in id order) and the same segment sums as ``execution.price``."""
    lens = np.asarray(lengths, dtype=np.int64)
    blocks: list[list[tuple[int, int]]] = []  # per micro-batch: (start, size), layout order
    members: list[list[list[int]]] = []
    mixes: dict[tuple[int, ...], tuple[int, ...] | None] = {}
    for mb in layout:
        got = _place(mb, cluster, mixes)
        if got is None:
            return None
        blocks.append([(start, size) for start, size, _ in got])
        members.append([ids for _, _, ids in got])
    # Pass times, batched per size as ``pass_times`` does (elementwise ``seq_ms``, slice sums).
    flat: dict[int, list[int]] = {}
    for placed, ids_of in zip(blocks, members, strict=True):
        for (_, size), ids in zip(placed, ids_of, strict=True):
            if ids:
                flat.setdefault(size, []).extend(ids)
    per_size: dict[int, tuple[np.ndarray, float]] = {}
    for size, ids in flat.items():
        recorded = cost.recorded_split(size)  # (0, 0) where the model records none
        split = recorded if recorded[0] else None
        per_size[size] = (
            cost.seq_ms(lens[ids].astype(np.float64), size, split),
            cost.fixed_ms(size, split),
        )
    at = dict.fromkeys(flat, 0)
    times: list[dict[tuple[int, int], float]] = []
    for placed, ids_of in zip(blocks, members, strict=True):
        t: dict[tuple[int, int], float] = {}
        for (start, size), ids in zip(placed, ids_of, strict=True):
            if not ids:
                t[(start, size)] = 0.0
                continue
            per_seq, fixed = per_size[size]
            end = at[size] + len(ids)
            t[(start, size)] = float(per_seq[at[size] : end].sum()) + fixed
            at[size] = end
        times.append(t)
    # Segments as ``execution.segments``: consecutive passes of one rank partition (its blocks
    # above one rank; single ranks, grouped or idle, are the rest), each pass its own where
    # passes are barriers; priced by ``execution.segment_increments``, as ``price`` does.
    keys = [frozenset(b for b in placed if b[1] > 1) for placed in blocks]
    runs: list[range] = []
    m = 0
    while m < len(layout):
        end = m + 1
        while not cost.pass_barrier and end < len(layout) and keys[end] == keys[m]:
            end += 1
        runs.append(range(m, end))
        m = end
    return float(sum(segment_increments(times, runs)))


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


def cheapest_homogeneous(
    lengths: Sequence[int],
    cost: CostModel,
    cluster: Cluster,
    sizes: Sequence[int],
    pipelined: Callable[[Plan], Plan | None] | None = None,
) -> tuple[float, str, Plan] | None:
    """(price, name, plan) of the cheapest valid homogeneous layout (ties: by name), or None:
    what ``solve`` never returns a plan worse than.

    Without a pipeline each layout is priced without building its plan (``layout_step_ms``,
    the plan's price to the bit), and plans are built and validated cheapest first until one
    passes: a dozen layouts of hundreds of groups each were the largest part of this stage.
    ``pipelined``: the plan priced under the solve's pipeline (None: a count its schedule
    refuses); then each plan is built and priced by the schedule.
    """
    layouts = homogeneous_layouts(lengths, cost, cluster, sizes)
    built: dict[str, Plan] = {}  # under a pipeline each is built to be priced
    priced: list[tuple[float, str]] = []
    for name, layout in layouts.items():
        if pipelined is None:
            ms = layout_step_ms(lengths, cost, cluster, layout)
        else:
            try:
                built[name] = plan_from_layout(lengths, cost, cluster, layout, solver=name)
            except InfeasibleError:
                continue
            piped = pipelined(built[name])
            ms = None if piped is None else piped.est_step_ms
        if ms is not None:
            priced.append((ms, name))
    checked = list(map(int, lengths))
    for _, name in sorted(priced):
        plan = built.get(name) or plan_from_layout(
            lengths, cost, cluster, layouts[name], solver=name
        )
        if not plan.problems(checked, cost, cluster.world_size):
            piped = plan if pipelined is None else pipelined(plan)
            if piped is not None:
                return piped.est_step_ms, name, piped
    return None
