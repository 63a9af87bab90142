"""Local improvement between micro-batches: move or swap long sequences, keep what helps.

Chunking decides micro-batches from per-sequence estimates; only scheduling reveals where a
micro-batch is stuck (a long sequence's group sets the makespan while memory-bound single-rank
groups idle, say). Moving one of the longest sequences to another micro-batch, or swapping two,
and re-scheduling both with the greedy builder finds those trades. A move is first checked
against both micro-batches' floors, then the greedy builder is asked for the one target that
would improve (one build, not a bisection), so most rejections are cheap. Deterministic:
candidates come in a fixed order and the first improving move is taken. Before the moves, the
lightest micro-batch is merged into another wherever that saves time (``_merge_lightest``).
"""

from __future__ import annotations

from collections.abc import Iterator

from megatron_hsp.planner.search.budget import Cap
from megatron_hsp.planner.search.greedy import schedule_microbatch
from megatron_hsp.planner.search.instance import GroupSpec, Instance
from megatron_hsp.planner.topology import Cluster

Scheduled = tuple[float, list[GroupSpec]]


def _ids(mb: Scheduled) -> list[int]:
    return [i for _, g in mb[1] for i in g]


_SHIFTS = (0.05, 0.15, 0.35)  # shares of a micro-batch's tokens moved as its shortest sequences


def _moves(inst: Instance, members: list[list[int]], spans: list[float], top: int) -> Iterator:
    """(a, b, out_of_a, into_a): worst micro-batch first, longest sequences first.

    ``out_of_a`` is a tuple of sequences moved from ``a`` to ``b`` and ``into_a`` one moved
    back (a swap) or None. Besides single long sequences, the shortest sequences of ``a`` are
    shifted in bulk: that is how a micro-batch whose long sequence's group sets the makespan
    sheds the short ones that memory-bound its other ranks.
    """
    gaps = [spans[b] - inst.microbatch_floor(members[b]) for b in range(len(members))]
    longest = [sorted(ids, key=lambda i: (-inst.lengths[i], i))[:top] for ids in members]
    for a in sorted(range(len(members)), key=lambda b: (-gaps[b], b)):
        shortest = sorted(members[a], key=lambda i: (inst.lengths[i], i))
        total = sum(inst.lengths[i] for i in shortest)
        for b in range(len(members)):
            if b == a:
                continue
            for i in longest[a]:
                yield a, b, (i,), None
                for k in longest[b]:
                    yield a, b, (i,), k
            for share in _SHIFTS:
                bulk, acc = [], 0
                for i in shortest[:-1]:  # never empty ``a``
                    if acc >= share * total:
                        break
                    bulk.append(i)
                    acc += inst.lengths[i]
                if bulk:
                    yield a, b, tuple(bulk), None


# Micro-batches a merge tries as the receiver of the lightest (most token room first).
MERGE_TRIES = 8


def _merge_lightest(
    inst: Instance, cluster: Cluster, mbs: list[Scheduled], cap: Cap
) -> tuple[bool, int]:
    """Empty the shortest micro-batch into another whose schedule grows by less than it lasts;
    (merged, schedules evaluated).

    Why: chunkings open a micro-batch when no other has room beside its long groups, so the
    last one often holds a few tiny sequences (a whole pass, mostly its fixed cost), which a
    long group's spare memory takes almost for free. The moves
    below never empty a micro-batch.
    """
    a = min(range(len(mbs)), key=lambda b: (mbs[b][0], b))
    out = _ids(mbs[a])
    tokens = sum(inst.lengths[i] for i in out)
    room = inst.world_size * inst.cap
    members = [_ids(mb) for mb in mbs]
    spare = [room - sum(inst.lengths[i] for i in ids) for ids in members]
    order = sorted((b for b in range(len(mbs)) if b != a and spare[b] >= tokens),
                   key=lambda b: (-spare[b], b))  # fmt: skip
    evals = 0
    for b in order[:MERGE_TRIES]:
        if cap.past("improve"):
            break
        need = (mbs[a][0] + mbs[b][0]) * (1 - 1e-6)
        joined = members[b] + out
        if inst.microbatch_floor(joined) >= need:
            continue
        evals += 1
        got = schedule_microbatch(inst, joined, cluster, limit=need)
        if got is not None and got[0] < need:
            mbs[b] = got
            del mbs[a]
            return True, evals
    return False, evals


def improve(
    inst: Instance,
    cluster: Cluster,
    microbatches: list[Scheduled],
    deadline: float | Cap,
    max_evals: int = 120,
    top: int = 6,
    merge: bool = True,
) -> tuple[list[Scheduled], int]:
    """First-improvement descent; returns the micro-batches and the schedules evaluated.
    ``merge``: micro-batches may be merged (not when their count must stay a multiple).
    ``max_evals`` limits the work; ``deadline`` (a ``budget.now()`` value or a ``Cap``) is only a
    safety cap."""
    cap = Cap.of(deadline)
    mbs = list(microbatches)
    evals = 0
    room = inst.world_size * inst.cap
    # Past the deadline already (huge batches spend the budget in the greedy phase): the first
    # move would be refused anyway, after sorting every micro-batch (costly at 100k sequences).
    improved = len(mbs) > 1 and not cap.past("improve")
    while merge and improved and len(mbs) > 1 and evals < max_evals:
        improved, spent = _merge_lightest(inst, cluster, mbs, cap)
        evals += spent
    improved = len(mbs) > 1 and not cap.past("improve")
    while improved:
        improved = False
        members = [_ids(mb) for mb in mbs]
        tokens = [sum(inst.lengths[i] for i in ids) for ids in members]
        for a, b, out, in_k in _moves(inst, members, [s for s, _ in mbs], top):
            if evals >= max_evals or cap.past("improve"):
                return mbs, evals
            delta = sum(inst.lengths[i] for i in out) - (0 if in_k is None else inst.lengths[in_k])
            if tokens[b] + delta > room or (in_k is None and len(members[a]) == len(out)):
                continue
            gone = set(out)
            new_a = [x for x in members[a] if x not in gone]
            new_b = [x for x in members[b] if x != in_k] + list(out)
            if in_k is not None:
                new_a.append(in_k)
            need = (mbs[a][0] + mbs[b][0]) * (1 - 1e-6)
            floor_b = inst.microbatch_floor(new_b)
            if inst.microbatch_floor(new_a) + floor_b >= need:
                continue
            evals += 1
            got_a = schedule_microbatch(inst, new_a, cluster, limit=need - floor_b)
            if got_a is None:
                continue
            got_b = schedule_microbatch(inst, new_b, cluster, limit=need - got_a[0])
            if got_b is None:
                continue
            mbs[a], mbs[b] = got_a, got_b
            improved = True
            break
    return mbs, evals
