"""``megatron-dcp`` baseline: megatron-core's own dynamic-CP scheduler, costed as it executes.

Runs ``BalancedCPScheduler`` from ``megatron.core.pipeline_parallel.hybrid_cp_schedule`` (identical
on Megatron-LM main d98e8a64 and in megatron-core 0.19.2) in-process on the batch's lengths and
turns its micro-batches into a ``Plan`` costed by ``evaluation.baselines.ring_plan_from_layout``:
each scheduler group becomes its passes, every CP group training its sub-samples one
forward/backward each (``hybrid_context_parallel_forward_backward``), ring attention for its
communication, priced and memory-checked per pass by the execution model
(``planner/cost/execution.py``) like every plan. It imports torch (through megatron-core), which is
why it lives outside ``planner/``; ``megatron-hsp bench`` imports it only when ``--methods`` names
``megatron-dcp``.

What we adapt, and why it never makes the baseline look worse than it is:

- The scheduler only calls ``dp_cp_group.size()``; ``_WorldSizeOnly`` is the minimal
  process-group stand-in that answers it (no torch.distributed initialisation needed).
- ``max_seq_len_per_rank`` (its ``--max-seqlen-per-dp-cp-rank``) is our memory model's
  ``tokens_per_rank``, so its CP size per sequence is the memory-minimal power of two.
- Its groups are contiguous rank ranges that may start anywhere; we re-place each micro-batch's
  groups as aligned blocks (largest first), which never crosses a node boundary the original
  did not, so our a2a cost is at most what its own placement would pay.
- Each sub-sample is its own pass (``baselines.sequential_passes``): each must fit its group's
  memory, and each pays the pass's fixed cost. That is main's execution, not a choice of ours:
  ``hybrid_context_parallel_forward_backward`` calls ``forward_step``/``backward_step`` once per
  entry of ``sample_id_groups[j][rank]`` (in 0.18.0 and 0.19.2 alike), with a barrier after each
  scheduler group; dev's packing scheduler is ``megatron-dcp-dev``.
  ``tests/evaluation/test_megatron_dcp_matches_scheduler.py`` checks the plan against the
  scheduler's output batch by batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

from megatron_hsp.evaluation.baselines import RingAssumptions, plan_from_scheduler
from megatron_hsp.planner.cost.costmodel import CostModel
from megatron_hsp.planner.errors import InfeasibleError, InputError
from megatron_hsp.planner.plan import Plan
from megatron_hsp.planner.run_spec import megatron_dcp_sizes
from megatron_hsp.planner.topology import Cluster


class _WorldSizeOnly:
    """Minimal process-group stand-in: ``BalancedCPScheduler.__init__`` only calls ``size()``."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def megatron_dcp_plan(
    lengths: Sequence[int] | np.ndarray,
    cost: CostModel,
    cluster: Cluster,
    assume: RingAssumptions | None = None,
) -> Plan:
    """Schedule one global batch with megatron-core's ``BalancedCPScheduler``."""
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.size == 0:
        raise InputError("the global batch is empty; nothing to plan")
    n = cluster.world_size
    megatron_dcp_sizes(n)
    longest = int(lens.max())
    need = 2 ** math.ceil(math.log2(max(1.0, longest / cost.tokens_per_rank)))
    if need > n:
        raise InfeasibleError(
            f"megatron-dcp: sequence of length {longest} needs a CP group of {need} > {n} GPUs"
        )
    scheduler = BalancedCPScheduler(cost.tokens_per_rank, _WorldSizeOnly(n))
    return plan_from_scheduler(
        lens,
        cost,
        cluster,
        lambda samples: scheduler.get_groups_and_subsamples(samples, config=None)[1],
        method="megatron-dcp",
        who="megatron-core's scheduler",
        sequential=True,
        assume=assume,
    )
