"""Lower bound on the step time: what no plan can beat (design.md section 2).

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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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


def instance_lower_bound(inst: Instance) -> float:
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
    return max(work, critical, exclusive)
