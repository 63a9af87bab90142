"""Fast heuristics: the per-micro-batch group builder used as warm start, fallback and filter.

A micro-batch is scheduled by *target makespan*: for a target ``M`` the builder walks the
sequences longest first and puts each into an open group that still finishes by ``M`` (and has
memory left), or opens the smallest group that can finish it by ``M``. Bisection on ``M`` finds the
smallest target the builder can meet with the cluster's ranks. Longest-first with the least-loaded
group of each size is LPT, which is within 4/3 of optimal for identical machines; the sizes make it
a heuristic, which the MILP (``milp.py``) then tries to beat.

The builder works on plain Python lists built once per batch (``Instance``): numpy scalar access in
its inner loop would cost more than the arithmetic. Whole-micro-batch sums use numpy.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from megatron_hsp.planner.groupspace import anchor_sizes
from megatron_hsp.planner.search.instance import VECTOR_MIN, GroupSpec, Instance
from megatron_hsp.planner.topology import Cluster


# ---------------------------------------------------------------------- evaluation
def group_times(inst: Instance, groups: Sequence[GroupSpec]) -> list[tuple[int, float]]:
    """(size, estimated ms) of each non-empty group."""
    index = {d: j for j, d in enumerate(inst.sizes)}
    full = [(d, ids) for d, ids in groups if ids]
    counts = [len(ids) for _, ids in full]
    if sum(counts) < VECTOR_MIN:
        times, fixed = inst.times, inst.fixed
        return [(d, sum(times[i][index[d]] for i in ids) + fixed[index[d]]) for d, ids in full]
    # One pass in numpy (bincount adds each group's times plainly; sum() compensates: the two
    # agree to rounding).
    cols = np.asarray([index[d] for d, _ in full], dtype=np.int64)
    flat = np.fromiter(chain.from_iterable(ids for _, ids in full), np.int64, sum(counts))
    seg = np.repeat(np.arange(len(full)), counts)
    sums = np.bincount(seg, weights=inst.times_at(flat, cols[seg]), minlength=len(full))
    fixed = inst.fixed
    pairs = zip(full, sums.tolist(), cols.tolist(), strict=True)
    return [(d, t + fixed[j]) for (d, _), t, j in pairs]


def groups_makespan(inst: Instance, groups: Sequence[GroupSpec]) -> float:
    """Estimated time of a micro-batch: its slowest non-empty group."""
    return max((ms for _, ms in group_times(inst, groups)), default=0.0)


# ---------------------------------------------------------------------- rank placement
# Blocks examined at most when first fit cannot place a micro-batch's cross-node groups.
PLACEMENT_SEARCH_STEPS = 4096


def _assign_starts(sizes: Sequence[int], cluster: Cluster, n: int) -> list[int] | None:
    """A legal start for each size (``sizes`` descending), or None; the ranks used come back too.

    First fit, largest first (buddy allocation), decides almost every case at once. It can miss
    mixes of cross-node sizes: on 64 ranks in nodes of 8, 32 then 24 puts 32 at rank 0, leaving
    24 no aligned block, while 24 at 0 and 32 at 32 tile. Then a bounded depth-first search over
    the cross-node groups' blocks (equal sizes in increasing start order), intra-node groups
    first-fit in what is left. ``PLACEMENT_SEARCH_STEPS`` bounds the blocks examined, each
    intra-node group a leaf places counting as one; past that, None.
    """
    starts = first_fit_starts(sizes, cluster, n, bytearray(n))
    if starts is not None:
        return starts
    width = cluster.node_width
    big = [d for d in sizes if d > width]
    if len(big) < 2:
        return None  # one cross-node group sits at the first start it fits either way
    small = [d for d in sizes if d <= width]
    used = bytearray(n)
    chosen: list[int] = []
    steps = [PLACEMENT_SEARCH_STEPS]

    def dfs(k: int) -> list[int] | None:
        if k == len(big):
            # A leaf places every intra-node group (first fit): each counts as a block examined,
            # or thousands of small groups per leaf at 1024 ranks made one failing search slow.
            steps[0] -= len(small)
            if steps[0] < 0:
                return None
            rest = first_fit_starts(small, cluster, n, bytearray(used))
            return None if rest is None else [*chosen, *rest]
        d = big[k]
        low = chosen[-1] + 1 if k and big[k - 1] == d else 0
        free = bytes(d)
        for start in cluster.block_starts(d):
            steps[0] -= 1
            if steps[0] < 0:
                return None
            if start < low or used[start : start + d] != free:
                continue
            used[start : start + d] = b"\x01" * d
            chosen.append(start)
            got = dfs(k + 1)
            if got is not None:
                return got
            chosen.pop()
            used[start : start + d] = bytes(d)
        return None

    return dfs(0)


def first_fit_starts(
    sizes: Sequence[int], cluster: Cluster, n: int, used: bytearray
) -> list[int] | None:
    """First free legal block for each size in order (marks ``used``); None if one has none.
    The one first-fit rule: the search's placement checks and the homogeneous layouts'."""
    cursor: dict[int, int] = {}
    starts: list[int] = []
    for k, d in enumerate(sizes):
        if d == 1 and max(sizes[k:]) == 1:
            # Single ranks to the end: first fit gives each the next free rank in order, so
            # they take the free ranks ascending (in one pass: 100k of them at 16,384 GPUs).
            free = np.flatnonzero(np.frombuffer(bytes(used), dtype=np.uint8) == 0)
            if len(free) < len(sizes) - k:
                return None
            take = free[: len(sizes) - k]
            arr = np.frombuffer(used, dtype=np.uint8)
            arr[take] = 1
            return starts + take.tolist()
        start = _first_free_start(used, cluster, d, cursor)
        if start < 0:
            return None
        used[start : start + d] = b"\x01" * d
        starts.append(start)
    return starts


def groups_fit(inst: Instance, groups: Sequence[GroupSpec], cluster: Cluster) -> bool:
    """Whether ``place_groups`` would succeed, without filling the spare ranks.

    Why: filling spare ranks always succeeds (single ranks fit anywhere) but costs a block
    search per spare rank; feasibility checks in loops (thousands per solve at 4096 ranks) made
    that the whole solve time.
    """
    n = inst.world_size
    if sum(d for d, _ in groups) > n:
        return False
    if inst.buddy:
        return True
    sizes = sorted((d for d, _ in groups), reverse=True)
    # Whether a mix of sizes tiles depends on the sizes alone: asked once per mix and cluster
    # (the bisection's builds repeat the same few mixes).
    key = ("tiles", cluster, *sizes)
    fit = inst.memo.get(key)
    if fit is None:
        fit = inst.memo[key] = _assign_starts(sizes, cluster, n) is not None
    return bool(fit)


class RankTiler:
    """Group sizes packed into one micro-batch's ranks, one at a time, with ``groups_fit``'s rule.

    Why: checking each added group with ``groups_fit`` re-places every earlier group, which is
    quadratic in the groups per micro-batch (hundreds of long sequences on small groups at 4096
    ranks took minutes). A group no larger than those placed goes first-fit into the ranks left
    free, where ``groups_fit``'s first fit would put it too; only when that fails, or the group
    is larger than one already placed, is the whole set placed again.
    """

    def __init__(self, inst: Instance, cluster: Cluster) -> None:
        self.inst, self.cluster = inst, cluster
        self.sizes: list[int] = []  # descending
        self.total = 0
        self.wide = 0  # groups wider than a node: only their mixes need the search
        self.used = bytearray(inst.world_size)
        self.cursor: dict[int, int] = {}
        # Sizes that did not fit: groups are only ever added, so they never will. Without this,
        # first-fit-decreasing over micro-batches re-ran the full placement search for every
        # long sequence against every full micro-batch (minutes at thousands of ranks).
        self.failed: set[int] = set()

    def add(self, d: int) -> bool:
        """Place a group of ``d`` ranks beside the others; False (and no change) if none fits."""
        n = self.inst.world_size
        if self.total + d > n or d in self.failed:
            return False
        start = -1
        wide = self.wide + (d > self.cluster.node_width)
        if self.inst.buddy:  # power-of-two sizes dividing N always tile (``_place_buddy``)
            start = 0
        elif not self.sizes or d <= self.sizes[-1]:
            start = _first_free_start(self.used, self.cluster, d, self.cursor)
            if start >= 0:
                self.used[start : start + d] = b"\x01" * d
            elif wide < 2:  # first fit is all ``_assign_starts`` would try: no search to run
                self.failed.add(d)
                return False
        if start < 0:
            trial = sorted([*self.sizes, d], reverse=True)
            starts = _assign_starts(trial, self.cluster, n)
            if starts is None:
                self.failed.add(d)
                return False
            used = bytearray(n)
            for size, at in zip(trial, starts, strict=True):
                used[at : at + size] = b"\x01" * size
            self.used, self.cursor = used, {}
        bisect.insort(self.sizes, d, key=lambda x: -x)
        self.total += d
        self.wide = wide
        return True


def place_groups(
    inst: Instance, groups: Sequence[GroupSpec], cluster: Cluster
) -> list[tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """Give each group an aligned rank block; fill spare ranks with empty groups.

    Largest first into the first free aligned block (buddy allocation): always succeeds for
    power-of-two sizes whose sum fits; other mixes may need ``_assign_starts``'s search, and
    some do not tile at all, and then we return None.
    """
    n = inst.world_size
    if sum(d for d, _ in groups) > n:
        return None
    if inst.buddy:
        return _place_buddy(inst, groups)
    order = sorted(range(len(groups)), key=lambda g: (-groups[g][0], g))
    starts = _assign_starts([groups[g][0] for g in order], cluster, n)
    if starts is None:
        return None
    used = bytearray(n)
    cursor: dict[int, int] = {}
    placed: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for g, start in zip(order, starts, strict=True):
        d, ids = groups[g]
        used[start : start + d] = b"\x01" * d
        placed.append((tuple(range(start, start + d)), tuple(sorted(ids))))
    # Spare ranks: the smallest allowed size that tiles, else single ranks.
    if placed and len(placed) and sum(used) < n:
        for d in [*inst.sizes, 1]:
            if not cluster.size_fits(d):
                continue
            while True:
                start = _first_free_start(used, cluster, d, cursor)
                if start < 0:
                    break
                used[start : start + d] = b"\x01" * d
                placed.append((tuple(range(start, start + d)), ()))
            if sum(used) == n:
                break
    elif not placed:
        tiling = cluster.tiling_sizes()
        for d in [*inst.sizes, 1]:
            if d in tiling:
                placed = [(b, ()) for b in cluster.aligned_blocks(d)]
                break
    placed.sort(key=lambda p: p[0][0])
    return placed


def _place_buddy(
    inst: Instance, groups: Sequence[GroupSpec]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Power-of-two sizes dividing N, largest first: each block starts where the last ended.

    The running offset is a sum of sizes no smaller than the current one, hence a multiple of
    it, so every block is aligned; spare ranks at the end become single-rank (or smallest
    allowed) empty groups.
    """
    placed: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    offset = 0
    for d, ids in sorted(groups, key=lambda g: (-g[0], min(g[1], default=-1))):
        placed.append((tuple(range(offset, offset + d)), tuple(sorted(ids))))
        offset += d
    n = inst.world_size
    while offset < n:
        d = next(s for s in [*reversed(inst.sizes), 1] if s <= n - offset and offset % s == 0)
        placed.append((tuple(range(offset, offset + d)), ()))
        offset += d
    return placed


def _first_free_start(used: bytearray, cluster: Cluster, d: int, cursor: dict[int, int]) -> int:
    """First start of a legal block of ``d`` free ranks (``Cluster.block_starts``); -1 if none.

    ``used`` only ever fills up, so the first free block for a size never moves backwards:
    ``cursor`` remembers its index per size, which keeps placing n single ranks linear instead of
    quadratic in n (it dominated solve time at 1024 ranks).
    """
    zero = bytes(d)
    starts = cluster.block_starts(d)
    for k in range(cursor.get(d, 0), len(starts)):
        start = starts[k]
        if used[start : start + d] == zero:
            cursor[d] = k
            return start
    cursor[d] = len(starts)
    return -1


# ---------------------------------------------------------------------- group builder
def build_groups(
    inst: Instance,
    seq_ids: Sequence[int],
    target: float,
    ranks: int | None = None,
    min_size: int = 1,
    same: list[float] | None = None,
) -> list[GroupSpec] | None:
    """Groups finishing every sequence by ``target`` ms with at most ``ranks`` ranks, or None.

    ``seq_ids`` must be sorted longest first. Sizes that are not powers of two are only used when
    the cluster lets them tile (``place_groups`` has the final word). ``min_size``: no group
    smaller (pooled memory, see ``schedule_microbatch``).

    ``same``: set to ``[lo, hi]``, the targets whose walk, and so result, is this one's
    (``_same_targets``).
    """
    ranks = inst.world_size if ranks is None else ranks
    sizes, times, fixed, lengths = inst.sizes, inst.times, inst.fixed, inst.lengths
    nsz = len(sizes)
    jfloor = bisect.bisect_left(sizes, min_size)  # the first size >= min_size (ascending)
    # Per size: heap of (load_ms, group index); group state in parallel lists.
    # (Made when a size's first group opens: most builds open a few sizes of many.)
    heaps: list[list[tuple[float, int]]] = [None] * nsz  # type: ignore[list-item]
    g_size: list[int] = []
    g_load: list[float] = []
    g_tokens: list[int] = []
    g_ids: list[list[int]] = []
    used = 0
    open_js: list[int] = []  # size indices with at least one open group, ascending
    dmin = inst.dmin
    # When rank-ms never falls with size, the first feasible size (ascending) is the cheapest.
    first_fit = inst.work_grows_with_size
    cheapest = inst.no_cheaper_larger_bits
    # Per size: the latest load a group may have before a sequence's time (target less the
    # fixed cost) and its token capacity; hoisted out of the per-sequence loop, which is the
    # solve's hot spot at 16,384 GPUs (131k sequences, several builds per micro-batch).
    room_ms = [target - f for f in fixed]
    room_tokens = inst.size_tokens
    heappush, heapreplace = heapq.heappush, heapq.heapreplace
    state: _Groups | None = None  # made on the first bulk placement (long walks only)
    # Thresholds (load + fixed) of the target comparisons: the largest met, the smallest missed.
    met, missed = -math.inf, math.inf
    n = len(seq_ids)
    pos, bulk_end = 0, n - CATCH_UP_MIN
    while pos < n:
        i = seq_ids[pos]
        row, ln = times[i], lengths[i]
        jmin = dmin[i]
        if jmin < jfloor:
            jmin = jfloor
        if pos < bulk_end and open_js and jmin <= open_js[0]:
            # A group far below the others in the size this sequence tries first takes many
            # sequences in a row: placed in bulk, exactly as below (``_catch_up``); this is
            # most of the walk's tail at 16,384 GPUs (131k sequences).
            j0 = open_js[0]
            heap = heaps[j0]
            if len(heap) > 2:
                # Worth a bulk call (tens of microseconds) only when the top group takes many.
                reach = heap[0][0] + CATCH_UP_MIN * row[j0]
                if reach < heap[1][0] and reach < heap[2][0]:
                    # Without first fit a larger open size may cost fewer rank-ms: checked.
                    if state is None:
                        state = _Groups(g_load, g_tokens, g_ids, np.asarray(seq_ids, np.int64))
                    took, taken_end = _catch_up(
                        inst, state.order, pos, heap, j0, not first_fit and len(open_js) > 1,
                        room_ms[j0], room_tokens[j0], state,
                    )  # fmt: skip
                    if taken_end + fixed[j0] > met:
                        met = taken_end + fixed[j0]
                    if took:
                        pos += took
                        continue
        pos += 1
        best_j, best_g, best_at, best_cost = -1, -1, 0, math.inf
        for j in open_js:
            if j < jmin:
                continue
            heap = heaps[j]
            load, g = heap[0]
            t = row[j]
            end = load + t
            if end > room_ms[j]:
                if end + fixed[j] < missed:
                    missed = end + fixed[j]
                continue  # the emptiest group of this size is too late: every one is
            if end + fixed[j] > met:
                met = end + fixed[j]
            at = 0
            if g_tokens[g] + ln > room_tokens[j]:
                # The emptiest group is out of memory; another of this size may have room
                # (long sequences in groups of 8 leave room for short ones in each; asking only
                # the emptiest opened a group per short sequence, ran out of ranks and pooled
                # everything into larger groups, a slower step than the one that fits).
                at, lowest = _emptiest_with_room(
                    heap, g_tokens, room_tokens[j] - ln, room_ms[j] - t
                )
                if at < 0:
                    if lowest + t + fixed[j] < missed:  # the first that would have room
                        missed = lowest + t + fixed[j]
                    continue
                g = heap[at][1]
                if heap[at][0] + t + fixed[j] > met:
                    met = heap[at][0] + t + fixed[j]
            # Prefer the size that costs the fewest rank-ms, then the emptier group.
            c = t * sizes[j]
            if c < best_cost:
                best_j, best_g, best_at, best_cost = j, g, at, c
                # No larger size costs this sequence fewer rank-ms: none can replace it.
                if first_fit or cheapest[i] >> j & 1:
                    break
        if best_g < 0:
            for j in range(jmin, nsz):
                if row[j] <= room_ms[j]:
                    if row[j] + fixed[j] > met:
                        met = row[j] + fixed[j]
                    if used + sizes[j] <= ranks:
                        best_j = j
                        break
                elif row[j] + fixed[j] < missed:
                    missed = row[j] + fixed[j]
            if best_j < 0:
                if same is not None:
                    same[:] = _same_targets(target, met, missed)
                return None
            best_g = len(g_size)
            g_size.append(sizes[best_j])
            g_load.append(row[best_j])
            g_tokens.append(ln)
            g_ids.append([i])
            used += sizes[best_j]
            heap = heaps[best_j]
            if heap is None:
                heaps[best_j] = heap = []
                open_js.append(best_j)
                open_js.sort()
            heappush(heap, (row[best_j], best_g))
        else:
            load = g_load[best_g] + row[best_j]
            g_load[best_g] = load
            g_tokens[best_g] += ln
            g_ids[best_g].append(i)
            if best_at == 0:
                heapreplace(heaps[best_j], (load, best_g))
            else:
                _raise_load(heaps[best_j], best_at, (load, best_g))
    if same is not None:
        same[:] = _same_targets(target, met, missed)
    return [(g_size[g], tuple(g_ids[g])) for g in range(len(g_size))]


# Relative allowance for rounding in ``target - fixed`` (a few ulps are ~1e-15): thresholds
# closer than this to a target are treated as not shown either way.
SAME_MARGIN = 1e-9


def _same_targets(target: float, met: float, missed: float) -> list[float]:
    """``[lo, hi]``: the targets whose walk ``build_groups`` showed equal to ``target``'s.

    The target enters the walk only through comparisons of a load with ``target - fixed``, each
    monotone in the target: the walk stays as it is while every comparison it made keeps its
    outcome. A comparison met at ``target`` stays met above it and, below it, down to its
    threshold (load + fixed), the largest of which is ``met``; one missed stays missed below
    ``target`` and, above it, up to its threshold, the smallest of which is ``missed``; each
    less a relative ``SAME_MARGIN`` for rounding. A bisection then asks the builder only for
    targets outside the intervals it has seen (``_schedule_sorted``)."""
    lo = min(target, met + SAME_MARGIN * abs(met)) if met > -math.inf else -math.inf
    hi = max(target, missed - SAME_MARGIN * abs(missed)) if missed < math.inf else math.inf
    return [lo, hi]


# Heap entries ``build_groups`` scans for a group with memory left when the emptiest has none:
# the heap's top six levels, the least loaded (bounded: 131k sequences at 16,384 GPUs).
ROOM_SCAN = 63


def _emptiest_with_room(
    heap: list[tuple[float, int]], tokens: list[int], max_tokens: int, max_load: float
) -> tuple[int, float]:
    """Heap position, among the first ``ROOM_SCAN``, of the least-loaded group holding at most
    ``max_tokens`` tokens and ``max_load`` ms (ties: the lower group index), or -1; and the
    least load among those with the tokens' room but too late (inf if none: where no group
    qualifies, the first that would with a later target)."""
    at, key = -1, (math.inf, -1)
    late = math.inf
    for k in range(min(len(heap), ROOM_SCAN)):
        load, g = heap[k]
        if tokens[g] <= max_tokens:
            if load > max_load:
                if load < late:
                    late = load
            elif (load, g) < key:
                at, key = k, (load, g)
    return at, late


def _raise_load(heap: list[tuple[float, int]], pos: int, item: tuple[float, int]) -> None:
    """Put ``item``, no smaller than ``heap[pos]``, at ``pos`` and sift it towards the leaves."""
    n = len(heap)
    while True:
        child = 2 * pos + 1
        if child >= n:
            break
        if child + 1 < n and heap[child + 1] < heap[child]:
            child += 1
        if heap[child] < item:
            heap[pos] = heap[child]
            pos = child
        else:
            break
    heap[pos] = item


# Sequences a catch-up looks ahead at most, and the fewest it must be able to take.
CATCH_UP_WINDOW = 4096
CATCH_UP_MIN = 16


@dataclass
class _Groups:
    """``build_groups``' per-group state (parallel lists, indexed by group)."""

    load: list[float]
    tokens: list[int]
    ids: list[list[int]]
    order: np.ndarray  # the walk's sequence order as an array


def _catch_up(
    inst: Instance,
    seq_ids: np.ndarray,
    pos: int,
    heap: list[tuple[float, int]],
    j: int,
    by_cost: bool,
    room_ms: float,
    room_tokens: int,
    groups: _Groups,
) -> tuple[int, float]:
    """Put ``seq_ids[pos:]`` into the heap's top group for as long as ``build_groups``' loop
    would; returns how many (0: none shown, the loop goes on).

    The loop gives each sequence the least-loaded group of the first size it tries when it
    fits. A group far below the others (one opened late in a longest-first walk) therefore
    takes sequence after sequence while its load, summed in the loop's order, stays below the
    heap's second entry (ties broken by group index, as the heap's tuples are), each fitting in
    time and tokens. Where the loop compares sizes by rank-ms (``by_cost``), each sequence must
    also cost no more in size ``j`` than in any larger size (stricter than the loop's check
    over the open ones). The result is the loop's to the bit (a test compares them).
    Also returns the last taken sequence's end (-inf if none): the largest load its target
    comparisons met.
    """
    load0, g0 = heap[0]
    second = min(heap[1], heap[2])
    # Sequences come longest first: about gap / (this one's time) go in; look at twice that.
    first = inst.times[int(seq_ids[pos])][j]
    gap = second[0] - load0
    window = CATCH_UP_WINDOW if first <= 0 else min(CATCH_UP_WINDOW, int(2 * gap / first) + 8)
    ids = seq_ids[pos : pos + window]
    after = np.add.accumulate(np.concatenate([[load0], inst.times_at(ids, j)]))
    before, after = after[:-1], after[1:]
    tokens = groups.tokens[g0] + np.cumsum(inst.lengths_np[ids])
    ok = (before < second[0]) | ((before == second[0]) & (g0 < second[1]))
    ok &= (after <= room_ms) & (tokens <= room_tokens)
    if by_cost:
        ok &= inst.no_cheaper_larger_at(ids, j)
    took = len(ok) if ok.all() else int(np.argmin(ok))
    # For ``build_groups``' ``same``: the sequences taken met their target comparisons (the
    # one that stopped the run is the loop's next, which records its own).
    met = float(after[took - 1]) if took else -math.inf
    if took:
        groups.load[g0] = float(after[took - 1])
        groups.tokens[g0] = int(tokens[took - 1])
        groups.ids[g0].extend(ids[:took].tolist())
        heapq.heapreplace(heap, (groups.load[g0], g0))
    return took, met


def _pool_sizes(inst: Instance) -> list[int]:
    """Minimum group sizes ``schedule_microbatch`` tries for pooled memory, ascending: the
    anchor sizes above 1 (``groupspace.anchor_sizes``), a bounded number of builder runs (each
    a few ms) even where hundreds of sizes are legal."""
    return [d for d in anchor_sizes(inst.sizes, inst.gpus_per_node) if d > 1]


def schedule_microbatch(
    inst: Instance,
    seq_ids: Sequence[int],
    cluster: Cluster,
    rel_tol: float | None = None,
    limit: float | None = None,
    hint: float | None = None,
) -> tuple[float, list[GroupSpec]] | None:
    """Smallest target makespan the builder meets (bisection), with its placeable groups.

    Returns None when no target works (the sequences do not fit the ranks' memory together) or,
    given ``limit``, when the builder cannot finish by ``limit`` (one build call: cheap rejects
    for local search; no pooled memory there, so a move that would need it is rejected).
    ``hint``: the makespan / floor ratio a similar micro-batch reached (the previous chunk of
    the same batch); micro-batches of thousands of sequences try it first (below).
    """
    ids = inst.longest_first(seq_ids)
    if not ids:
        return 0.0, []
    floor = inst.microbatch_floor(ids)
    if rel_tol is None:
        # Thousands of sequences per micro-batch: each build costs more, and the bracket is
        # already tight, so stop bisecting at 1% there.
        rel_tol = 3e-3 if len(ids) <= 1024 else 1e-2
    if not (len(ids) > 1024 and floor > inst.best[ids[0]]):
        hint = None  # read only for thousands of sequences under a work floor (below)
    # A pure function of its inputs: asked again (a chunk two counts share, a local-search
    # move tried twice), the answer is the one computed before (``Instance.memo``).
    key = ("schedule", cluster, tuple(ids), rel_tol, limit, hint)
    got = inst.memo.get(key, _MISSING)
    if got is _MISSING:
        got = _schedule_sorted(inst, ids, floor, cluster, rel_tol, limit, hint)
        inst.memo[key] = got
    if got is None:
        return None
    return got[0], list(got[1])  # the caller's own list


_MISSING = object()


def _schedule_sorted(
    inst: Instance,
    ids: list[int],
    floor: float,
    cluster: Cluster,
    rel_tol: float,
    limit: float | None,
    hint: float | None,
) -> tuple[float, list[GroupSpec]] | None:
    """``schedule_microbatch`` of ``ids`` (longest first, non-empty; ``floor`` theirs)."""

    # Memory first: when the builder cannot fit the sequences even with no time target, each
    # sequence on the smallest group that holds it fragments the memory (three sequences of
    # 0.6 x a rank's capacity need three ranks alone, two as one group of 2; three 115k
    # sequences need 3 x 24 ranks alone, 64 together). Then pool: the smallest minimum group
    # size that fits, at the price of larger groups. None if even that does not fit.
    # Placement counts too: nine groups of 6-7 ranks need nine nodes of 8 whatever their sum.
    def fits(min_size: int) -> bool:
        return attempt(math.inf, min_size) is not None

    pool = 1
    # Per minimum size, the target intervals over which a build showed its result unchanged
    # (``build_groups``' ``same``), with that result: a bisection's later targets mostly fall
    # in one, and are answered without a build (the same answer the build would give).
    seen: dict[int, list[tuple[float, float, list[GroupSpec] | None]]] = {}

    def attempt(target: float, min_size: int | None = None) -> list[GroupSpec] | None:
        size = pool if min_size is None else min_size
        known = seen.setdefault(size, [])
        for lo, hi, got in known:
            if lo <= target <= hi:
                return got
        same = [target, target]
        groups = build_groups(inst, ids, target, min_size=size, same=same)
        # Power-of-two sizes dividing the world size always tile (buddy allocation); other
        # mixes need the placement check.
        if groups is not None and not groups_fit(inst, groups, cluster):
            groups = None
        known.append((same[0], same[1], groups))
        return groups

    # Bracket upwards from the floor in growing steps (most micro-batches land within a few
    # percent of it), then bisect between the last failure and the best success.
    best: list[GroupSpec] | None = None
    failed = floor
    if limit is not None:
        if limit < floor:
            return None
        best = attempt(limit)
        if best is None:
            return None
    factors: tuple[float, ...] = (1.0, 1.02, 1.06, 1.15, 1.4, *(1.4 * 1.5**k for k in range(1, 40)))
    check_after = MEMORY_CHECK_AFTER
    if len(ids) > 1024 and floor > inst.best[ids[0]]:
        # Thousands of sequences under a work floor (tens of thousands per micro-batch at 16,384
        # GPUs, each build costly). Meeting the floor exactly needs every rank at the average load
        # with every sequence at its cheapest size, which a greedy walk does not do, and the
        # bisection would next try the midpoint ``1 + rel_tol``: start there (the same plan whenever
        # the floor itself fails). A step at 1.10 too, tried before the memory check: a bracket of
        # 6% leaves two bisection builds where 1.06-1.15 leaves four, and a met target makes the
        # check's build unnecessary.
        factors = (1.0 + rel_tol, 1.02, 1.06, 1.10, *factors[3:])
        check_after = MEMORY_CHECK_AFTER + 1
        if hint is not None and hint > 1.0 + rel_tol and best is None:
            # Chunks of one batch land at similar ratios to their floors (a 16,384-GPU batch's
            # two micro-batches: 1.100 and 1.090): try the previous one's ratio, then, if met,
            # half-tolerance steps below it, which bracket the answer in two to four builds
            # where the ladder from 1 + rel_tol takes five or six. Still a bracket of a failed
            # target and a met one, so the result is within ``rel_tol`` of a failure as before.
            factors = (hint, *(f for f in factors if f > hint * (1.0 + rel_tol)))
    else:
        hint = None
    # The memory check (``fits``) is one more full build, so it runs only once a few targets
    # near the floor failed: a target the builder meets with single ranks allowed already
    # shows the sequences fit, and most micro-batches are met within 6% of their floor.
    checked = best is not None
    for k, factor in enumerate(() if best is not None else factors):
        if not checked and k == check_after:
            checked = True
            if not fits(1):
                pool = next((d for d in _pool_sizes(inst) if fits(d)), 0)
                if not pool:
                    return None
                failed = floor  # the failures so far were at the smaller minimum size
        target = floor * factor
        best = attempt(target)
        if best is not None:
            break
        failed = target
    if best is None:
        return None
    hi = groups_makespan(inst, best)
    # The hint was met at once: half-tolerance steps below it (at most three) until one fails,
    # for the failure the bracket needs; each met step lowers ``hi`` as bisection would.
    for _ in range(3 if hint is not None and failed == floor else 0):
        target = hi / (1.0 + 0.5 * rel_tol)
        if target <= floor:
            break
        below = attempt(target)
        if below is None:
            failed = target
            break
        best, hi = below, groups_makespan(inst, below)
    lo = min(failed, hi)
    hi, best = _bisect(inst, attempt, lo, hi, best, rel_tol)
    if limit is None:
        # Wider groups: the builder opens, for each long sequence, the smallest group that
        # finishes it by the target, which can strand the rest: four long sequences on 64 ranks
        # where the longest opens a 56-rank group leave 8 ranks the others cannot use, so every
        # target below a 32 + 32 schedule fails, while all four in one 64-rank group would
        # meet it (docs/results/solver.md has the batch). Retrying with larger minimum sizes (one
        # build rejects a size that cannot beat ``hi``) finds such schedules.
        for d in _wider_sizes(inst, best, hi):
            if hi * (1.0 - rel_tol) < floor:
                break  # no schedule beats the floor: the retry's target cannot be met
            got = attempt(hi * (1.0 - rel_tol), d)
            if got is not None:
                hi, best = _bisect(
                    inst, lambda t, d=d: attempt(t, d), floor, groups_makespan(inst, got), got,
                    rel_tol,
                )  # fmt: skip
    return hi, best


# Failed targets after which ``schedule_microbatch`` checks memory with no time target.
MEMORY_CHECK_AFTER = 3


def _bisect(
    inst: Instance,
    attempt: Callable[[float], list[GroupSpec] | None],
    lo: float,
    hi: float,
    best: list[GroupSpec],
    rel_tol: float,
) -> tuple[float, list[GroupSpec]]:
    """Smallest makespan ``attempt`` meets between ``lo`` (failed or a floor) and ``hi`` (met by
    ``best``). Bounded: |hi| keeps the tolerance positive, and the step cap ends the search even
    for costs that defeat the tolerance (60 halvings exhaust float64 precision)."""
    for _ in range(60):
        if hi - lo <= rel_tol * abs(hi):
            break
        mid = 0.5 * (lo + hi)
        got = attempt(mid)
        if got is None:
            lo = mid
        else:
            best, hi = got, groups_makespan(inst, got)
    return hi, best


def _wider_sizes(inst: Instance, groups: Sequence[GroupSpec], makespan: float) -> list[int]:
    """Minimum group sizes worth a retry: when the group that sets ``makespan`` spans at least a
    node, twice its size and the whole cluster (where legal and larger); inside a node, a whole
    node (groups of 7 beside single ranks strand memory that groups of 8 share, so the wider
    schedule can be the faster one).
    Bounded: at most two retries per micro-batch."""
    at_makespan = [d for d, ms in group_times(inst, groups) if ms >= makespan * (1 - 1e-9)]
    crit = max(at_makespan, default=0)  # the largest group whose time is the makespan
    legal = set(inst.sizes)
    g = inst.gpus_per_node
    if crit < g:
        return [g] if g in legal else []
    return sorted({d for d in (2 * crit, inst.sizes[-1]) if d in legal and d > crit})
