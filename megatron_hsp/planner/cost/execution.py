"""The execution model and the one price function every method's plan is priced by.

What a plan states, and what the runtime does with it (``runtime/schedule.py``):

- A plan's micro-batches are **passes**: in each, every group runs one forward and backward on
  its sequences (a group without sequences skips it). Memory is checked per pass
  (``Plan.problems`` with the cost model: the whole pass must fit its group).
- Ranks walk the passes in plan order and meet only inside their own group's collectives: no
  barrier is needed between passes (``runtime/schedule.py``'s docstring). So a run of
  consecutive passes with the **same rank partition** is one **segment**: each group runs its
  passes back to back, at its own pace, and the segment ends when its slowest group does. A
  group with several passes in a segment is what Megatron's dynamic CP calls sequential
  sub-sample passes; a group with fewer passes idles at the segment's end.
- A **barrier** (every rank waits for every other) separates segments: a change of layout (a rank
  cannot start its next group before all its new partners are there; priced as if all ranks
  wait, which is exact when one group spans the cluster and conservative otherwise), and every
  pass when the training setup makes each pass a global collective
  (``CostModel.pass_barrier``: ZeRO-3's per-pass parameter all-gathers and gradient
  reduce-scatter over all data-parallel ranks). Under a pipeline every pass is a pipeline
  micro-batch, priced by ``cost/pipeline.py``'s schedule instead.

Which fixed term is paid how often is the cost model's, derived from the training setup
(``first_principles``): per pass and group ``CostModel.fixed_ms`` (kernel calls, collective
latencies, and ZeRO-3's traffic where every pass is a barrier); per step
``CostModel.step_overhead_ms`` (gradient reduction under ZeRO-0/1/2, the optimizer), the same
for every plan of a step and so outside ``est_step_ms``.

The price of a plan is the sum over segments of the segment's time: with barriers per pass,
``sum_k max_g pass(g, k)``; otherwise ``max_g sum_k pass(g, k)``, ``pass(g, k)`` being
``CostModel.group_ms`` of group ``g``'s sequences in pass ``k`` at the split the group records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np

from megatron_hsp.planner.cost.costcore import CostModel
from megatron_hsp.planner.plan import Group, MicroBatch, Plan


def layout_key(mb: MicroBatch) -> tuple[tuple[int, ...], ...]:
    """A micro-batch's rank partition (what must be equal for two passes to share a segment)."""
    return tuple(sorted(g.ranks for g in mb.groups))


def segments(plan: Plan, cost: CostModel, pipelined: bool = False) -> list[range]:
    """Runs of micro-batch indices that execute without a barrier between them (module doc);
    ``pipelined``: every pass is a pipeline micro-batch, hence a barrier."""
    out: list[range] = []
    start = 0
    mbs = plan.microbatches
    for i in range(1, len(mbs) + 1):
        barrier = cost.pass_barrier or pipelined
        if i == len(mbs) or barrier or layout_key(mbs[i]) != layout_key(mbs[start]):
            out.append(range(start, i))
            start = i
    return out


def pass_ms(group: Group, cost: CostModel, ring: str = "overlap") -> float:
    """One group's pass: ``CostModel.group_ms`` at the split it records (0 without sequences)."""
    if not group.lengths:
        return 0.0
    split = (group.ulysses, group.ring) if group.ulysses else None
    return cost.group_ms(cost.padded(group.lengths, group.size), group.size, split, ring)


def pass_times(groups: Sequence[Group], cost: CostModel, ring: str = "overlap") -> list[float]:
    """``pass_ms`` of each of ``groups``, in order, to the bit: one ``CostModel.seq_ms`` call per
    (size, split) over every group's lengths (it is elementwise), each group's slice summed as
    ``group_ms`` sums it. Why: a homogeneous layout has hundreds of groups, and one ``seq_ms``
    call per group was most of what pricing it cost."""
    by_key: dict[tuple[int, tuple[int, int] | None], list[int]] = {}
    for k, g in enumerate(groups):
        if g.lengths:
            by_key.setdefault((g.size, (g.ulysses, g.ring) if g.ulysses else None), []).append(k)
    out = [0.0] * len(groups)
    for (d, split), ks in by_key.items():
        flat = [n for k in ks for n in groups[k].lengths]
        # each document as the group holds it (TE's padding: ``CostModel.doc_multiple``)
        per_seq = cost.seq_ms(cost.padded(flat, d).astype(np.float64), d, split, ring)
        fixed = cost.fixed_ms(d, split)
        at = 0
        for k in ks:
            end = at + len(groups[k].lengths)
            out[k] = float(per_seq[at:end].sum()) + fixed
            at = end
    return out


def price(plan: Plan, cost: CostModel, ring: str = "overlap", *, pipelined: bool = False) -> Plan:
    """``plan`` with every estimate set by the execution model (the one price function).

    A group's ``est_ms`` is its pass time; a micro-batch's ``est_ms`` is how much it lengthens
    its segment (the segment's finish after this pass minus before it, so the micro-batches'
    sum is the step's price); ``est_step_ms`` is the sum over segments. ``ring`` is
    ``CostModel.seq_ms``'s sensitivity knob, for baselines' ring groups only. ``pipelined``:
    price each pass on its own, for ``cost/pipeline.py``'s schedule to order.
    """
    flat = [g for mb in plan.microbatches for g in mb.groups]
    times = iter(pass_times(flat, cost, ring))
    est = [[next(times) for _ in mb.groups] for mb in plan.microbatches]
    passes = [
        {g.ranks: t for g, t in zip(mb.groups, est[m], strict=True)}
        for m, mb in enumerate(plan.microbatches)
    ]
    grows = segment_increments(passes, segments(plan, cost, pipelined))
    microbatches = [
        MicroBatch(
            tuple(dataclasses.replace(g, est_ms=t) for g, t in zip(mb.groups, est[m], strict=True)),
            grows[m],
        )
        for m, mb in enumerate(plan.microbatches)
    ]
    return dataclasses.replace(
        plan,
        microbatches=tuple(microbatches),
        est_step_ms=float(sum(grows)),
    )


def segment_increments(
    passes: Sequence[dict[Hashable, float]], runs: Sequence[range]
) -> list[float]:
    """How much each pass lengthens its segment, in pass order: ``passes`` are each pass's
    {rank block: pass time}, ``runs`` the segments (``segments``), consecutive and covering
    every pass. A segment ends when its busiest block does (``max_g sum_k pass(g, k)``). The one
    segment rule of ``price`` and of ``homogeneous.layout_step_ms``."""
    out: list[float] = []
    for run in runs:
        done: dict[Hashable, float] = {}
        finish = 0.0
        for m in run:
            for block, t in passes[m].items():
                done[block] = done.get(block, 0.0) + t
            now = max(done.values(), default=0.0)
            out.append(now - finish)
            finish = now
    return out


def group_by_layout(plan: Plan) -> Plan:
    """``plan`` with micro-batches of equal rank partitions made adjacent (first-seen order of
    layouts, plan order inside one), so that they share a segment. The order of passes is free
    without a pipeline: every sequence is trained once per step whatever its pass."""
    order: dict[tuple[tuple[int, ...], ...], list[MicroBatch]] = {}
    for mb in plan.microbatches:
        order.setdefault(layout_key(mb), []).append(mb)
    mbs: Sequence[MicroBatch] = [mb for run in order.values() for mb in run]
    return dataclasses.replace(plan, microbatches=tuple(mbs))


def balance_segments(plan: Plan, cost: CostModel) -> Plan:
    """``plan`` with, inside each segment, every pass's groups of one size moved between that
    size's blocks so that no block's summed passes set a later finish than needed.

    Why: a segment ends when its busiest block does (``max_g sum_k pass(g, k)``), so which
    block runs which of a pass's equal-size groups decides its price, while each pass keeps
    its layout, its groups' sequences, sizes and splits (still a valid, executable plan). A
    planner that always puts a pass's heaviest group at the first block stacks them: on
    sft-long-mix on the calibrated model, 26 passes of two 32-rank groups priced as the sum of
    their spans (docs/results). Longest processing time first: passes by their longest group,
    each pass's groups, longest first, to the least-loaded blocks of their size; a segment
    keeps its order where that is not cheaper. Passes that are barriers are left alone.
    """
    if cost.pass_barrier:
        return plan
    mbs = list(plan.microbatches)
    for seg in segments(plan, cost):
        if len(seg) < 2:
            continue
        times = {m: pass_times(mbs[m].groups, cost) for m in seg}
        before: dict[tuple[int, ...], float] = {}
        for m in seg:
            for g, t in zip(mbs[m].groups, times[m], strict=True):
                before[g.ranks] = before.get(g.ranks, 0.0) + t
        load: dict[tuple[int, ...], float] = {}
        moved: dict[int, MicroBatch] = {}
        for m in sorted(seg, key=lambda m: (-max(times[m], default=0.0), m)):
            groups = mbs[m].groups
            by_size: dict[int, list[int]] = {}
            for k, g in enumerate(groups):
                by_size.setdefault(g.size, []).append(k)
            out = list(groups)
            for ks in by_size.values():
                blocks = sorted((groups[k].ranks for k in ks), key=lambda r: (load.get(r, 0.0), r))
                heavy = sorted(ks, key=lambda k: (-times[m][k], k))
                for ranks, k in zip(blocks, heavy, strict=True):
                    out[k] = dataclasses.replace(groups[k], ranks=ranks)
                    load[ranks] = load.get(ranks, 0.0) + times[m][k]
            out.sort(key=lambda g: g.ranks[0])
            moved[m] = MicroBatch(tuple(out), mbs[m].est_ms)
        if max(load.values()) < max(before.values()):
            for m, mb in moved.items():
                mbs[m] = mb
    return dataclasses.replace(plan, microbatches=tuple(mbs))


def step_wall_ms(plan: Plan, cost: CostModel) -> float:
    """A step's predicted wall time: the plan's price (``est_step_ms``, what ``price`` sets)
    plus what the step pays once beyond its passes (``CostModel.step_overhead_ms``: gradient
    reduction and optimizer step). The one rule of every prediction of a step's time, the
    training loop's logged prediction (``step/observe.py``) and the benchmarks' alike."""
    return float(plan.est_step_ms) + cost.step_overhead_ms
