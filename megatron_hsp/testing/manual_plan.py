"""Plans written by hand: for the selftest, tests and benchmarks, which need exact layouts
(e.g. three distinct group sizes in one micro-batch) rather than whatever a solver picks."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_hsp.planner.plan import Group, MicroBatch, Plan

# One micro-batch: groups in slot order, each (size, sequence ids).
Layout = Sequence[tuple[int, Sequence[int]]]


def manual_plan(
    world_size: int,
    lengths: Sequence[int],
    microbatches: Sequence[Layout],
    *,
    gpus_per_node: int | None = None,
    memory=None,
) -> Plan:
    """A validated ``Plan``: groups tile slots 0..world_size-1 left to right in the given order."""
    mbs = []
    for layout in microbatches:
        groups = []
        start = 0
        for size, seq_ids in layout:
            ranks = tuple(range(start, start + size))
            start += size
            groups.append(
                Group(
                    ranks=ranks, seq_ids=tuple(seq_ids), lengths=tuple(lengths[s] for s in seq_ids)
                )
            )
        mbs.append(MicroBatch(groups=tuple(groups)))
    plan = Plan(
        world_size=world_size,
        gpus_per_node=gpus_per_node or world_size,
        microbatches=tuple(mbs),
        cost_model="manual",
        solver="manual",
        status="heuristic",
    )
    return plan.validate(lengths=lengths, memory=memory, world_size=world_size)


def round_robin_plan(
    world_size: int,
    lengths: Sequence[int],
    group_size: int,
    num_microbatches: int,
    *,
    gpus_per_node: int | None = None,
) -> Plan:
    """Homogeneous groups of ``group_size``; sequences dealt longest-first to the least-loaded
    (micro-batch, group). A simple, valid plan for benchmarks of the runtime (not the planner)."""
    groups_per_mb = world_size // group_size
    cells = num_microbatches * groups_per_mb
    load = [0] * cells
    members: list[list[int]] = [[] for _ in range(cells)]
    for sid in sorted(range(len(lengths)), key=lambda s: -lengths[s]):
        c = min(range(cells), key=load.__getitem__)
        load[c] += lengths[sid]
        members[c].append(sid)
    layouts = [
        [(group_size, members[m * groups_per_mb + g]) for g in range(groups_per_mb)]
        for m in range(num_microbatches)
    ]
    return manual_plan(world_size, lengths, layouts, gpus_per_node=gpus_per_node)
