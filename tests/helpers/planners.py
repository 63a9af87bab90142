"""Planner factories for the planner-service tests (importable by the spawned planner process).

They build real, valid ``Plan`` objects with a trivial layout so that the service's process
protocol (ordering, waiting, errors) is tested apart from the MILP, which has its own tests.
"""

from __future__ import annotations

import time

from megatron_hsp.planner.errors import InfeasibleError
from megatron_hsp.planner.plan import Group, MicroBatch, Plan


def one_group_per_rank(spec):
    """Round-robin sequences over size-1 groups; ``options['sleep_s']`` delays every solve."""
    sleep_s = float(spec.options.get("sleep_s", 0.0))

    def plan(lengths):
        time.sleep(sleep_s)
        if any(x > spec.max_seq for x in lengths):
            raise InfeasibleError(f"sequence longer than {spec.max_seq}")
        n = spec.world_size
        groups = tuple(
            Group(
                ranks=(r,),
                seq_ids=tuple(range(r, len(lengths), n)),
                lengths=tuple(lengths[r::n]),
            )
            for r in range(n)
        )
        return Plan(n, spec.gpus_per_node, (MicroBatch(groups),), solver="test", status="heuristic")

    return plan


def broken_factory(spec):
    raise ValueError("cost model file not found: nope.yaml")
