"""Micro-batch count and chunking: which sequences share a micro-batch.

The memory cap decides the fewest micro-batches (all tokens must fit ``world_size * cap``); each
extra micro-batch costs one more fixed per-pass overhead but gives the packer room. So we try a
few counts from the memory minimum up and keep the one whose scheduled total is smallest.

For a given count, FlexSP splits the length-sorted batch into contiguous runs of equal *tokens*.
Tokens are the wrong currency: a 64k sequence costs ~16x the attention of four 16k ones. The
default here balances estimated *time* (rank-ms each sequence must cost at its cheapest fitting
size) longest first, under each micro-batch's token capacity, which spreads long sequences over
micro-batches so that each has short ones to fill the ranks beside its long group. The contiguous
token split is kept as a second candidate: when a batch has several sequences that each need the
whole cluster, grouping them wins, and the solver keeps whichever schedules faster.

Both strategies live here. The token- and time-based ones (``chunk_time_balanced``,
``chunk_contiguous``) are built at every candidate count; the long-sequence ones are built once
per solve for batches whose long sequences need more than one rank: ``chunk_long_grouped`` packs
the long sequences by rank need (similar times together) and lets short ones fill the gaps;
``chunk_long_sized`` (when a sequence needs more than a node and ``long-grouped`` does not apply)
puts each cross-node sequence at the size that shortens the step most beside short work
(``cross_node_size``). ``solver._chunkings`` decides which are tried, and in what order.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Sequence

import numpy as np

from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.search.budget import Cap
from megatron_hsp.planner.search.greedy import RankTiler
from megatron_hsp.planner.search.instance import Instance, longest_first_ids
from megatron_hsp.planner.topology import Cluster

#: The most micro-batches one step is planned in. Planning time grows about linearly with them
#: (figures: docs/reliability.md); a batch whose memory floor is above it is refused up front
#: rather than planned for minutes.
MAX_MICROBATCHES = 4096


def min_microbatches(inst: Instance) -> int:
    """Memory floor on the micro-batch count: every token needs a rank slot."""
    total = sum(inst.lengths)
    return max(1, math.ceil(total / (inst.world_size * inst.cap)))


def check_microbatch_floor(inst: Instance) -> None:
    """Refuse, before any search, a batch that needs more than ``MAX_MICROBATCHES`` micro-batches
    under the memory cap, naming the figures and what would help."""
    floor = min_microbatches(inst)
    if floor > MAX_MICROBATCHES:
        raise InputError(
            f"this batch holds {sum(inst.lengths)} tokens; {inst.world_size} ranks of "
            f"{inst.cap} tokens each need at least {floor} micro-batches, more than the "
            f"{MAX_MICROBATCHES} one step is planned in: use a smaller batch, --overlong drop, "
            "more GPUs or a larger memory cap"
        )


def candidate_counts(inst: Instance, extra: int) -> list[int]:
    lo = min_microbatches(inst)
    hi = min(len(inst.lengths), lo + extra)
    return list(range(lo, max(lo, hi) + 1))


def longest_first(inst: Instance, seq_ids: Sequence[int] | None = None) -> list[int]:
    return inst.longest_first(seq_ids)


def chunk_time_balanced(inst: Instance, m: int, fill: float = 1.0) -> list[list[int]]:
    """LPT over micro-batches by rank-ms, respecting ``fill`` x the micro-batch token capacity.

    A sequence goes to the least-loaded micro-batch that still has token room; if none has, to
    the one with the most room (the scheduler will then report the chunking infeasible).
    """
    if m == 1:
        return [longest_first(inst)]  # every sequence in the one micro-batch, as the loop puts it
    room = fill * inst.world_size * inst.cap
    lengths, work_min = inst.lengths, inst.work_min
    loads = [0.0] * m
    tokens = [0] * m
    # (load, micro-batch) ascending: the first with token room is the least loaded one with
    # room, ties to the lowest index (one short scan instead of a pass over all ``m``).
    by_load = [(0.0, b) for b in range(m)]
    out: list[list[int]] = [[] for _ in range(m)]
    for i in longest_first(inst):
        ln = lengths[i]
        k = next((k for k, (_, b) in enumerate(by_load) if tokens[b] + ln <= room), -1)
        if k >= 0:
            chosen = by_load[k][1]
        else:
            chosen = min(range(m), key=lambda b: (tokens[b], b))
            k = by_load.index((loads[chosen], chosen))
        del by_load[k]
        tokens[chosen] += ln
        loads[chosen] += work_min[i]
        bisect.insort(by_load, (loads[chosen], chosen))
        out[chosen].append(i)
    return [b for b in out if b]


def chunk_contiguous(inst: Instance, m: int, weight: str = "tokens") -> list[list[int]]:
    """Split the longest-first order into ``m`` contiguous runs minimising the heaviest run.

    ``weight`` is ``tokens`` (FlexSP's rule) or ``work`` (rank-ms). Bisection on the run limit
    with a greedy cut is exact for contiguous partitions.
    """
    if weight == "tokens":
        # A function of the lengths alone: shared between the instances of one batch (hsp's
        # search and the flexsp-style baseline's ask for the same counts; docs/solver.md).
        return [list(run) for run in _contiguous_by_tokens(tuple(inst.lengths), m)]
    # The order and its prefix sums do not depend on ``m``: built once per instance (the solver
    # asks for every candidate count).
    key = ("contiguous", weight)
    if key not in inst.memo:
        order = longest_first(inst)
        inst.memo[key] = _prefix(order, [inst.work_min[i] for i in order])
    return _contiguous_runs(*inst.memo[key], m)  # type: ignore[misc]


@functools.lru_cache(maxsize=128)
def _contiguous_by_tokens(lengths: tuple[int, ...], m: int) -> tuple[tuple[int, ...], ...]:
    """``chunk_contiguous`` by tokens of a batch of ``lengths`` (longest first, ties by index)."""
    order = _order_and_sums(lengths)
    return tuple(tuple(run) for run in _contiguous_runs(*order, m))


@functools.lru_cache(maxsize=8)
def _order_and_sums(lengths: tuple[int, ...]) -> tuple[list[int], float, list[float]]:
    arr = np.asarray(lengths, dtype=np.int64)
    order = longest_first_ids(arr, np.arange(len(arr)))
    return _prefix(order, [float(lengths[i]) for i in order])


def _prefix(order: list[int], weights: list[float]) -> tuple[list[int], float, list[float]]:
    """The order, its heaviest weight and its prefix sums as Python floats (the same doubles:
    ``bisect`` on them gives searchsorted's answer without a numpy call per run)."""
    w = np.asarray(weights, dtype=np.float64)
    return order, float(w.max()), np.concatenate([[0.0], np.cumsum(w)]).tolist()


def _contiguous_runs(
    order: list[int], heaviest: float, sums: list[float], m: int
) -> list[list[int]]:
    n = len(order)

    def cuts(limit: float) -> list[int] | None:
        """Greedy run ends: each run takes as many as fit under ``limit`` (at least one)."""
        ends, pos = [], 0
        while pos < n:
            end = bisect.bisect_right(sums, sums[pos] + limit) - 1
            if end <= pos:
                end = pos + 1  # at least one
            ends.append(end)
            pos = end
            if len(ends) > m:
                return None
        return ends

    lo, hi = heaviest, sums[-1]
    best = cuts(hi)
    for _ in range(50):
        if hi - lo <= 1e-6 * hi:
            break
        mid = 0.5 * (lo + hi)
        got = cuts(mid)
        if got is None:
            lo = mid
        else:
            best, hi = got, mid
    assert best is not None
    out, start = [], 0
    for end in best:
        out.append(order[start:end])
        start = end
    return out


def _first_fit_by_blocks(
    inst: Instance,
    cluster: Cluster,
    order: Sequence[int],
    size_of: Callable[[int], int],
    deadline: float | Cap,
) -> tuple[list[list[int]], list[int]] | None:
    """First fit of ``order`` (longest first), one group of ``size_of(i)`` each, into
    micro-batches whose aligned blocks hold every group (``RankTiler``: 32 + 24 does not tile 64
    ranks); returns the micro-batches and the ranks each uses; None past ``deadline``."""
    cap = Cap.of(deadline)
    chunks: list[list[int]] = []
    ranks: list[int] = []
    tilers: list[RankTiler] = []
    for i in order:
        if cap.past("chunking"):
            return None
        d = size_of(i)
        for c in range(len(chunks)):
            if ranks[c] + d <= inst.world_size and tilers[c].add(d):
                chunks[c].append(i)
                ranks[c] += d
                break
        else:
            tiler = RankTiler(inst, cluster)
            tiler.add(d)
            tilers.append(tiler)
            chunks.append([i])
            ranks.append(d)
    return chunks, ranks


def _long_heavy(inst: Instance, m: int) -> bool:
    """Whether the multi-rank sequences' own groups fill more than half of ``m`` micro-batches'
    ranks: then ``long-grouped`` is worth building (below that, token-based chunkings tile and
    it costs time) and ``long-sized`` is not (its sequences' sizes rarely matter there)."""
    need = sum(
        inst.sizes[inst.dmin[i]] for i in range(len(inst.lengths)) if inst.lengths[i] > inst.cap
    )
    return 2 * need > inst.world_size * m


def chunk_long_grouped(
    inst: Instance,
    cluster: Cluster,
    m: int,
    deadline: float | Cap = math.inf,
    scored_share: float | None = None,
) -> list[list[int]] | None:
    """Long sequences packed by rank need, similar times together; short ones fill the gaps.

    Why: when many sequences each need a multi-rank group (long-context SFT mixes, bimodal
    batches), token-based chunkings put more long sequences in a micro-batch than its ranks can
    hold once group sizes are rounded up to legal ones (a 100k sequence needing 17 ranks takes a
    group of 24), so every count near the memory floor is infeasible and the solver falls back to
    many extra micro-batches; and spreading the longest ones puts a 6 s group beside 3 s ones.
    Here sequences that cannot run on one rank go first-fit decreasing (by best time) into
    micro-batches by the size of the smallest group that holds each alone, so the ranks always
    suffice and neighbours have similar times; the rest go longest first to the micro-batch whose
    estimated makespan (its longest sequence, or its work over all ranks) grows least, within
    the token room beside the long groups. Up to ``m`` micro-batches, more if the long groups
    need them (and one more whenever a short sequence finds no room); None if the long groups
    fill less than half of ``m`` micro-batches' ranks, or past ``deadline``.

    ``scored_share``: sequences that need more than a node take ``cross_node_size`` (the size
    that shortens the step most with short work beside it) or their cheapest size instead
    (``_scored_sizes``; 1: all at the scored size). More micro-batches, each closer to its
    floor: on lognormal-dcp, where most long sequences' cheapest sizes (24, 40) are far above
    what memory needs (16), 1.3-2.0% shorter steps with every one scored; on batches where the
    long groups decide the count (sft-long-mix, bimodal) it loses and the memory sizes stay.
    """
    n, cap = inst.world_size, inst.cap
    long_ids = sorted(
        (i for i in range(len(inst.lengths)) if inst.lengths[i] > cap),
        key=lambda i: (-inst.best[i], i),
    )
    if not _long_heavy(inst, m):
        return None
    size = {i: inst.sizes[inst.dmin[i]] for i in long_ids}
    if scored_share is not None:
        size.update(_scored_sizes(inst, cluster, scored_share))
    if scored_share is not None and scored_share < 1:
        # A partial share mixes wide groups and cheapest (narrower, slower) ones, so the best
        # time no longer says which neighbours finish together: order by the time at the size
        # each takes (lognormal-dcp 0.5% shorter; with every sequence scored, the best-time
        # order is 2.9% better on a code-heavy-tail batch, so it stays there).
        j_of = {d: j for j, d in enumerate(inst.sizes)}
        long_ids.sort(key=lambda i: (-inst.times[i][j_of[size[i]]], i))
    placed = _first_fit_by_blocks(inst, cluster, long_ids, size.__getitem__, deadline)
    if placed is None:
        return None
    chunks, ranks = placed
    # Tokens short sequences may still take: only the ranks beside the long groups count, since
    # the group builder does not reliably fill a long group's spare memory.
    room = [float((n - r) * cap) for r in ranks]
    crit = [inst.best[c[0]] for c in chunks]  # the first is the longest
    work = []
    for c in chunks:  # left to right as before (sum() compensates since Python 3.12)
        w = 0.0
        for i in c:
            w += inst.work_min[i]
        work.append(w)
    while len(chunks) < m:
        chunks.append([])
        ranks.append(0)
        room.append(float(n * cap))
        crit.append(0.0)
        work.append(0.0)
    short = sorted(
        set(range(len(inst.lengths))) - set(long_ids), key=lambda i: (-inst.lengths[i], i)
    )
    # The short work of a micro-batch is spread over all its ranks here (the group builder may
    # put it beside the long groups or pool it), and ties go to the least work.
    _fill_short(inst, chunks, crit, room, work, [n] * len(chunks), short, per_rank_key=False)
    return [c for c in chunks if c]


def _fill_short(
    inst: Instance,
    chunks: list[list[int]],
    crit: list[float],
    room: list[float],
    work: list[float],
    free: list[int],
    order: Sequence[int],
    *,
    per_rank_key: bool,
) -> None:
    """Each sequence of ``order`` (longest first) into the micro-batch whose estimated makespan
    grows least, within its ``room`` tokens: the makespan is its long groups' time ``crit`` or
    the fixed cost plus its short ``work`` over its ``free`` ranks, and ties go to the least
    work (per free rank with ``per_rank_key``). Where no micro-batch has room, a new one of
    short sequences (all ranks free). The one fill rule of ``chunk_long_grouped`` and
    ``chunk_long_sized``; the lists are updated in place."""
    n, cap, base = inst.world_size, inst.cap, inst.min_fixed
    lengths, work_min, best = inst.lengths, inst.work_min, inst.best

    def makespan(c: int) -> float:  # a micro-batch's estimate before the next sequence
        return max(crit[c], base + work[c] / free[c]) if free[c] > 0 else math.inf

    def tie(c: int) -> float:  # the second key: least work (per free rank)
        return work[c] / free[c] if per_rank_key else work[c]

    # Each micro-batch's estimate changes only when it takes a sequence: kept, not recomputed
    # for every sequence and micro-batch.
    before = [makespan(c) for c in range(len(chunks))]
    # The micro-batches with free ranks by (second key, index): the chosen one is the least
    # (growth, second key, index), and growth is never negative, so a walk in this order stops
    # at the first that does not grow; most short sequences find one among the first few
    # (a scan of every micro-batch per sequence was most of the candidates' chunking time).
    ranked = sorted((tie(c), c) for c in range(len(chunks)) if free[c] > 0)
    for i in order:
        ln, w, own = lengths[i], work_min[i], best[i]
        chosen, best_key = -1, (math.inf, math.inf, -1)
        for second, c in ranked:
            if room[c] < ln:
                continue
            after = max(crit[c], own, base + (work[c] + w) / free[c])
            key = (after - before[c], second, c)
            if key < best_key:
                chosen, best_key = c, key
                if after == before[c]:
                    break  # no growth: nothing later in the order beats it
        if chosen < 0:  # the long groups left no room anywhere: a micro-batch of short ones
            chunks.append([])
            free.append(n)
            room.append(float(n * cap))
            crit.append(0.0)
            work.append(0.0)
            before.append(0.0)
            chosen = len(chunks) - 1
        else:
            del ranked[bisect.bisect_left(ranked, (tie(chosen), chosen))]
        chunks[chosen].append(i)
        room[chosen] -= ln
        work[chosen] += w
        crit[chosen] = max(crit[chosen], own)
        before[chosen] = makespan(chosen)
        bisect.insort(ranked, (tie(chosen), chosen))


LONG_SIZED_FILL = 0.9


def cross_node_size(inst: Instance, i: int, absorb_density: float) -> int:
    """The group size for cross-node sequence ``i`` that shortens the step most, alone in its
    micro-batch with the other ranks running short sequences.

    Why: the cheapest size in rank-ms leaves ranks beside the group that short sequences cannot
    keep busy, because a rank holds only ``cap`` tokens and short sequences carry little work per
    token (a 192k sequence at 40 of 64 ranks: 6.3 s, its 24 other ranks hold 155k tokens, about
    a third of the work needed to stay busy; at 56 ranks: 4.8 s beside 8 nearly busy ranks).
    Each size is scored by its micro-batch's makespan less the short work and tokens the other
    ranks absorb (``absorb_density``: the short sequences' work per token), which would
    otherwise cost time and fixed costs in other micro-batches.
    """
    n, cap, b = inst.world_size, inst.cap, inst.min_fixed
    best_j, best_score = inst.dmin[i], math.inf
    for j in range(inst.dmin[i], len(inst.sizes)):
        t = inst.times[i][j]
        if t == math.inf:  # sizes from ``dmin`` up all hold it (``Instance.dmin``)
            continue
        span = t + inst.fixed[j]
        free = n - inst.sizes[j]
        work = min(free * (span - b), absorb_density * free * cap)
        tokens = work / absorb_density if absorb_density > 0 else 0.0
        score = span - work / n - b * tokens / (n * cap)
        if score < best_score - 1e-9:
            best_j, best_score = j, score
    return inst.sizes[best_j]


def _scored_sizes(inst: Instance, cluster: Cluster, share: float = 1.0) -> dict[int, int]:
    """``cross_node_size`` of every sequence that needs more than a node, at the work per
    token of the others (the short sequences that would run beside it); with ``share`` < 1,
    only for the longest ``share`` of those whose scored size is not their cheapest in rank-ms
    (smallest on ties), the cheapest for the rest.

    Why the share: the scored size assumes a sequence alone in its micro-batch beside short
    work, which memory keeps sparse (a rank holds ``cap`` tokens of little work each); several
    long sequences at their cheapest sizes fill a micro-batch's ranks instead. The longest gain
    most from wide groups (a 192k sequence: 4.2 s on 56 ranks, 5.7 s on 40 for 3% less work);
    on lognormal-dcp 100-150k sequences do better back at 24 ranks (40-48 scored), two or
    three to a micro-batch. Which share is best varies by batch: a candidate per share.
    """
    g = cluster.node_width
    wide = [i for i in range(len(inst.lengths)) if inst.sizes[inst.dmin[i]] > g]
    # Longest first, as ``chunk_long_sized`` walks them (the float sum's order is kept).
    rest = sorted(set(range(len(inst.lengths))) - set(wide), key=lambda i: (-inst.lengths[i], i))
    tokens = sum(inst.lengths[i] for i in rest)
    density = sum(inst.work_min[i] for i in rest) / tokens if tokens else 0.0
    scored = {i: cross_node_size(inst, i, density) for i in wide}
    if share >= 1:
        return scored
    out, differ = {}, []
    for i, d in scored.items():
        work = [inst.sizes[j] * inst.times[i][j] for j in range(len(inst.sizes))]
        out[i] = inst.sizes[min(range(inst.dmin[i], len(work)), key=lambda j: (work[j], j))]
        if out[i] != d:
            differ.append(i)
    differ.sort(key=lambda i: (-inst.lengths[i], i))
    for i in differ[: round(share * len(differ))]:
        out[i] = scored[i]
    return out


def chunk_long_sized(
    inst: Instance, cluster: Cluster, m: int, deadline: float | Cap = math.inf
) -> list[list[int]] | None:
    """Cross-node sequences at ``cross_node_size``, first-fit decreasing into micro-batches
    whose aligned blocks hold them; every other sequence, longest first, where the estimated
    makespan grows least: the long groups' time, or the short work over the ranks beside them,
    within those ranks' tokens. At least ``m`` micro-batches; None when no sequence needs more
    than a node, when ``long-grouped`` applies (``_long_heavy``), or past ``deadline``.
    """
    n, cap, g = inst.world_size, inst.cap, cluster.node_width
    wide = [i for i in range(len(inst.lengths)) if inst.sizes[inst.dmin[i]] > g]
    if not wide or _long_heavy(inst, m):
        return None
    rest = sorted(set(range(len(inst.lengths))) - set(wide), key=lambda i: (-inst.lengths[i], i))
    tokens = sum(inst.lengths[i] for i in rest)
    size = _scored_sizes(inst, cluster)
    j_of = {d: j for j, d in enumerate(inst.sizes)}
    span = {i: inst.times[i][j_of[size[i]]] + inst.fixed[j_of[size[i]]] for i in wide}
    order = sorted(wide, key=lambda i: (-span[i], i))
    placed = _first_fit_by_blocks(inst, cluster, order, size.__getitem__, deadline)
    if placed is None:
        return None
    chunks, ranks = placed
    crit = [span[c[0]] for c in chunks]  # the first is the longest
    # Micro-batches of short sequences only: enough for the tokens the long ones leave at
    # ``LONG_SIZED_FILL`` of their memory (a memory-full micro-batch packs badly), at least ``m``.
    beside = sum(LONG_SIZED_FILL * (n - r) * cap for r in ranks)
    more = math.ceil(max(0.0, tokens - beside) / (LONG_SIZED_FILL * n * cap))
    for _ in range(max(more, m - len(chunks))):
        chunks.append([])
        ranks.append(0)
        crit.append(0.0)
    room = [float(LONG_SIZED_FILL * (n - r) * cap) for r in ranks]
    # Short work runs on the ranks beside the long groups only (their memory is taken).
    free = [n - r for r in ranks]
    _fill_short(inst, chunks, crit, room, [0.0] * len(chunks), free, rest, per_rank_key=True)
    return [c for c in chunks if c]
