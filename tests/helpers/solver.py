"""Small cost models and a brute-force optimum for tiny instances (shared by solver tests)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from megatron_hsp.planner.cost.costmodel import CostModel
from megatron_hsp.planner.topology import Cluster


def toy_cost(
    world_size: int,
    cap: int,
    fixed: float = 5.0,
    a2a: float = 0.002,
    attn: float = 1e-5,
    fixed_per_rank: float = 0.0,
) -> CostModel:
    """A cost model with numbers for every size up to ``world_size`` (non powers of two too).
    ``fixed_per_rank`` > 0 makes the fixed cost grow with the group size, as in the calibrated
    models (collective latencies)."""
    fixed_ms = {0: fixed, **{d: fixed + fixed_per_rank * d for d in range(1, world_size + 1)}}
    return CostModel(
        name="toy",
        attn_ms_per_token2=attn,
        linear_ms_per_token=0.05,
        group_fixed_ms=fixed_ms,
        a2a_ms_per_token={d: a2a * (1 + d / 8) / d for d in range(2, world_size + 1)},
        tokens_per_rank=cap,
    )


def _set_partitions(items: list[int]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for k in range(len(part)):
            yield [*part[:k], [first, *part[k]], *part[k + 1 :]]
        yield [[first], *part]


def _size_multisets(total: int, sizes: list[int]):
    """Multisets of sizes summing to at most ``total`` (spare ranks idle)."""
    out = []

    def rec(start: int, left: int, acc: list[int]) -> None:
        if acc:
            out.append(list(acc))
        for j in range(start, len(sizes)):
            if sizes[j] <= left:
                acc.append(sizes[j])
                rec(j, left - sizes[j], acc)
                acc.pop()

    rec(0, total, [])
    return out


def _placeable(cfg: list[int], cluster: Cluster) -> bool:
    """Whether aligned blocks (``Cluster.block_starts``) hold every group of ``cfg`` at once:
    exhaustive search, independent of the planner's placement code."""
    used = [False] * cluster.world_size

    def rec(k: int) -> bool:
        if k == len(cfg):
            return True
        d = cfg[k]
        for s in cluster.block_starts(d):
            if not any(used[s : s + d]):
                used[s : s + d] = [True] * d
                if rec(k + 1):
                    return True
                used[s : s + d] = [False] * d
        return False

    return rec(0)


def brute_force_ms(
    lengths: Sequence[int],
    cost: CostModel,
    cluster: Cluster,
    sizes: list[int],
    placed: bool = False,
) -> float:
    """Optimal step time by enumeration, under the execution model the runtime runs (written
    here from its statement in docs/costmodel.md, not from the planner's price code): a step
    is a sequence of segments; in a segment the ranks keep one layout (``cfg``), each group
    runs its sequences in one or more passes back to back (every pass must fit), and the
    segment lasts as long as its slowest group; where every pass is a barrier
    (``cost.pass_barrier``) a segment holds one pass per group. By default it ignores rank
    alignment, so it is a true lower value; ``placed`` keeps only the size mixes aligned blocks
    hold (the runtime's rule)."""
    configs = _size_multisets(cluster.world_size, sizes)
    if placed:
        configs = [cfg for cfg in configs if _placeable(sorted(cfg, reverse=True), cluster)]
    multi_pass = not cost.pass_barrier
    inf = float("inf")

    def group_time(member: list[int], d: int) -> float:
        if not multi_pass:
            return cost.group_ms(member, d) if cost.fits(member, d) else inf
        best = inf
        for passes in _set_partitions(list(range(len(member)))):
            chunks = [[member[i] for i in part] for part in passes]
            if all(cost.fits(c, d) for c in chunks):
                best = min(best, sum(cost.group_ms(c, d) for c in chunks))
        return best

    memo: dict[tuple[int, ...], float] = {}

    def segment(ids: tuple[int, ...]) -> float:
        if ids in memo:
            return memo[ids]
        best = inf
        for cfg in configs:
            if len(cfg) > len(ids):
                continue
            for assign in itertools.product(range(len(cfg)), repeat=len(ids)):
                span = 0.0
                for g, d in enumerate(cfg):
                    member = [lengths[i] for i, a in zip(ids, assign, strict=True) if a == g]
                    if member:
                        span = max(span, group_time(member, d))
                    if span >= best:
                        break
                best = min(best, span)
        memo[ids] = best
        return best

    return min(
        sum(segment(tuple(sorted(part))) for part in parts)
        for parts in _set_partitions(list(range(len(lengths))))
    )
