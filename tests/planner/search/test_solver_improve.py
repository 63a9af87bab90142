"""Local search between micro-batches (``planner/search/improve.py``): what it may change."""

from __future__ import annotations

import time

from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.search.greedy import schedule_microbatch
from megatron_hsp.planner.search.improve import improve
from megatron_hsp.planner.search.instance import Instance, resolve_sizes
from megatron_hsp.planner.topology import Cluster


def _tiny_tail():
    """A 192k sequence on 56 of 64 ranks leaves 169k tokens of its group's memory spare; thirty
    600-token sequences in a micro-batch of their own cost 0.69 s, mostly its fixed cost."""
    cost = load_cost_model("flexsp-gpt-7b", world_size=64, max_seq_k=192)
    cluster = Cluster(64, 8)
    lengths = [192_000] + [600] * 30
    inst = Instance.build(lengths, cost, cluster, resolve_sizes(cost, cluster, None))
    tail = list(range(1, len(lengths)))
    mbs = [schedule_microbatch(inst, [0], cluster), schedule_microbatch(inst, tail, cluster)]
    return inst, cluster, mbs


def test_the_lightest_micro_batch_is_merged_where_it_saves_time():
    inst, cluster, mbs = _tiny_tail()
    before = sum(s for s, _ in mbs)
    out, evals = improve(inst, cluster, list(mbs), time.perf_counter() + 30)
    assert len(out) == 1 and evals >= 1
    assert out[0][0] < before - 0.5 * mbs[1][0]  # the tail's 0.69 s, less 11 ms
    held = sorted(i for _, ids in out[0][1] for i in ids)
    assert held == list(range(len(inst.lengths)))


def test_no_merge_keeps_the_count():
    """Pipelined plans keep their micro-batch count a multiple of the stages."""
    inst, cluster, mbs = _tiny_tail()
    out, _ = improve(inst, cluster, list(mbs), time.perf_counter() + 30, merge=False)
    assert len(out) == 2
    assert sum(s for s, _ in out) <= sum(s for s, _ in mbs)
