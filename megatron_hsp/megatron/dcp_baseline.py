"""``megatron-dcp`` baseline: megatron-core's own dynamic-CP scheduler, costed by our model.

Runs ``BalancedCPScheduler`` from ``megatron.core.pipeline_parallel.hybrid_cp_schedule``
in-process on the batch's lengths and turns its micro-batches into a ``Plan``. It imports torch
(through megatron-core), which is why it lives outside ``planner/``; ``megatron-hsp bench``
imports it only when ``--methods`` names ``megatron-dcp``.

What we adapt, and why it never makes the baseline look worse than it is:

- The scheduler only calls ``dp_cp_group.size()``; ``_WorldSizeOnly`` is the minimal
  process-group stand-in that answers it (no torch.distributed initialisation needed).
- ``max_seq_len_per_rank`` (its ``--max-seqlen-per-dp-cp-rank``) is our memory model's
  ``tokens_per_rank``, so its CP size per sequence is the memory-minimal power of two.
- Its groups are contiguous rank ranges that may start anywhere; we re-place each micro-batch's
  groups as aligned blocks (largest first), which never crosses a node boundary the original
  did not, so our a2a cost is at most what its own placement would pay.
- Its balancing ignores memory: a group can collect more tokens than fit. Such a micro-batch is
  replayed in as many sub-micro-batches as the fullest group needs, each group training the
  next slice of its sequences (greedy in its order) that fits; ``extra['memory_splits']``
  counts those extra passes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

from megatron_hsp.planner.baselines import plan_from_layout
from megatron_hsp.planner.costmodel import CostModel
from megatron_hsp.planner.errors import InfeasibleError, InputError
from megatron_hsp.planner.plan import Plan
from megatron_hsp.planner.topology import Cluster


class _WorldSizeOnly:
    """Minimal process-group stand-in: ``BalancedCPScheduler.__init__`` only calls ``size()``."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def _groups_of_microbatch(
    sample_ids_per_gpu: Sequence[Sequence[int]],
) -> list[tuple[int, list[int]]]:
    """(size, sample ids) per group: ranks holding the same sample form one CP group."""
    members: dict[int, set[int]] = {}
    for rank, ids in enumerate(sample_ids_per_gpu):
        for sid in ids:
            members.setdefault(int(sid), set()).add(rank)
    groups: dict[tuple[int, ...], list[int]] = {}
    for sid, ranks in members.items():
        groups.setdefault(tuple(sorted(ranks)), []).append(sid)
    return [(len(r), ids) for r, ids in sorted(groups.items())]


def _split_for_memory(
    group_ids: list[tuple[int, list[int]]], lens: np.ndarray, cost: CostModel
) -> list[list[tuple[int, list[int]]]]:
    """Replay a micro-batch in as many passes as needed for every group to fit memory."""
    slices: list[list[list[int]]] = []
    for size, ids in group_ids:
        cap = cost.capacity(size)
        parts: list[list[int]] = [[]]
        used = 0
        for sid in ids:
            n = int(lens[sid])
            if n > cap:
                raise InfeasibleError(
                    f"megatron-dcp: sequence {sid} of length {n} exceeds the capacity of its "
                    f"group of {size} ({cap} tokens)"
                )
            if used + n > cap and parts[-1]:
                parts.append([])
                used = 0
            parts[-1].append(sid)
            used += n
        slices.append(parts)
    passes = max(len(p) for p in slices)
    return [
        [
            (size, parts[t] if t < len(parts) else [])
            for (size, _), parts in zip(group_ids, slices, strict=True)
        ]
        for t in range(passes)
    ]


def megatron_dcp_plan(
    lengths: Sequence[int] | np.ndarray, cost: CostModel, cluster: Cluster
) -> Plan:
    """Schedule one global batch with megatron-core's ``BalancedCPScheduler``."""
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.size == 0:
        raise InputError("the global batch is empty; nothing to plan")
    n = cluster.world_size
    if n & (n - 1):
        raise InputError(
            f"megatron-dcp: megatron-core's scheduler uses power-of-two CP groups; --gpus {n} "
            "is not a power of two"
        )
    longest = int(lens.max())
    need = 2 ** math.ceil(math.log2(max(1.0, longest / cost.tokens_per_rank)))
    if need > n:
        raise InfeasibleError(
            f"megatron-dcp: sequence of length {longest} needs a CP group of {need} > {n} GPUs"
        )
    scheduler = BalancedCPScheduler(cost.tokens_per_rank, _WorldSizeOnly(n))
    try:
        _, sample_id_groups = scheduler.get_groups_and_subsamples(
            [(i, int(x)) for i, x in enumerate(lens.tolist())], config=None
        )
    except AssertionError as exc:  # its internal invariants, e.g. "cannot redistribute"
        raise InfeasibleError(f"megatron-dcp: megatron-core's scheduler gave up: {exc}") from None
    layout: list[list[tuple[int, list[int]]]] = []
    splits = 0
    for sample_ids in sample_id_groups:
        groups = _groups_of_microbatch(sample_ids)
        passes = _split_for_memory(groups, lens, cost)
        splits += len(passes) - 1
        layout.extend(passes)
    return plan_from_layout(
        lens,
        cost,
        cluster,
        layout,
        solver="megatron-dcp",
        extra={
            "method": "megatron-dcp",
            "scheduler_microbatches": len(sample_id_groups),
            "memory_splits": splits,
        },
    )
