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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from megatron_hsp.planner.search.greedy import Instance


def min_microbatches(inst: Instance) -> int:
    """Memory floor on the micro-batch count: every token needs a rank slot."""
    total = sum(inst.lengths)
    return max(1, math.ceil(total / (inst.world_size * inst.cap)))


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
    loads = [0.0] * m
    tokens = [0] * m
    out: list[list[int]] = [[] for _ in range(m)]
    for i in longest_first(inst):
        ln = inst.lengths[i]
        chosen, best = -1, float("inf")
        for b in range(m):
            if tokens[b] + ln <= room and loads[b] < best:
                chosen, best = b, loads[b]
        if chosen < 0:
            chosen = min(range(m), key=lambda b: (tokens[b], b))
        tokens[chosen] += ln
        loads[chosen] += inst.work_min[i]
        out[chosen].append(i)
    return [b for b in out if b]


def chunk_contiguous(inst: Instance, m: int, weight: str = "tokens") -> list[list[int]]:
    """Split the longest-first order into ``m`` contiguous runs minimising the heaviest run.

    ``weight`` is ``tokens`` (FlexSP's rule) or ``work`` (rank-ms). Bisection on the run limit
    with a greedy cut is exact for contiguous partitions.
    """
    order = longest_first(inst)
    w = np.asarray(
        [float(inst.lengths[i]) if weight == "tokens" else inst.work_min[i] for i in order]
    )
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    n = len(order)

    def cuts(limit: float) -> list[int] | None:
        """Greedy run ends: each run takes as many as fit under ``limit`` (at least one)."""
        ends, pos = [], 0
        while pos < n:
            end = int(np.searchsorted(prefix, prefix[pos] + limit, side="right")) - 1
            end = max(end, pos + 1)
            ends.append(end)
            pos = end
            if len(ends) > m:
                return None
        return ends

    lo, hi = float(w.max()), float(prefix[-1])
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
