"""``megatron-dcp`` plans equal what megatron-core's own ``BalancedCPScheduler`` returns.

Batch by batch, on the dynamic-CP benchmark's batches (``benchmarks/dcp_published.py``; the
lognormal set and a more skewed one) at 4-64 GPUs, the expected execution is derived from the
installed megatron-core's ``get_groups_and_subsamples`` output as
``hybrid_context_parallel_forward_backward`` runs it: in scheduler group j, DPxCP rank r runs
one forward/backward per sub-sample of ``sample_id_groups[j][r]``, in that order, with a CP
group of every rank holding that sub-sample (``partner_cp_size``), and a barrier between groups.
The plan re-places groups as aligned rank blocks, so ranks are compared as a multiset of per-rank
sequences of (sample id, CP size, length); no padding is added by main's scheduler. Runs on both
megatron-core versions CI installs (0.19.2 in ``make test``, 0.18.0 in ``make test-oldest-torch``).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")

from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

from megatron_hsp.evaluation.torch_side.dcp_baseline import megatron_dcp_plan
from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.topology import Cluster

FIXTURE = Path(__file__).parent.parent / "fixtures/megatron_dev_schedules.json"
CAP = 2048  # the benchmark's --max-seqlen-per-dp-cp-rank


class _Group:
    """What the scheduler's constructor reads of its process group."""

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def _cases() -> list[dict]:
    return json.loads(FIXTURE.read_text())["cases"]


def expected_rank_runs(lengths: list[int], world: int) -> tuple[list[Counter], int]:
    """Per scheduler group, the multiset of per-rank runs (sample, CP size, length), and the
    number of sub-sample passes the busiest rank runs in all (megatron-core called directly)."""
    sched = BalancedCPScheduler(CAP, _Group(world))
    _, sample_id_groups = sched.get_groups_and_subsamples(list(enumerate(lengths)), None)
    out, passes = [], 0
    for group in sample_id_groups:
        ranks = list(group) + [[]] * (world - len(group))
        runs = Counter()
        for ids in ranks:
            cp = [sum(sid in other for other in ranks) for sid in ids]
            runs[tuple((sid, c, lengths[sid]) for sid, c in zip(ids, cp, strict=True))] += 1
        out.append(runs)
        passes += max(len(ids) for ids in ranks)
    return out, passes


def plan_rank_runs(plan, world: int) -> list[Counter]:
    """The plan's passes cut into scheduler groups (``extra['scheduler_passes']``), each as the
    multiset of per-rank runs (sample, group size, length) in pass order."""
    out, at = [], 0
    for n in plan.extra["scheduler_passes"]:
        per_rank: dict[int, list] = {r: [] for r in range(world)}
        for mb in plan.microbatches[at : at + n]:
            for g in mb.groups:
                for r in g.ranks:
                    per_rank[r].extend(
                        (sid, g.size, ln) for sid, ln in zip(g.seq_ids, g.lengths, strict=True)
                    )
        out.append(Counter(tuple(v) for v in per_rank.values()))
        at += n
    assert at == len(plan.microbatches)
    return out


@pytest.mark.parametrize("world", [4, 8, 16, 32, 64])
def test_plans_equal_megatron_cores_scheduler_batch_by_batch(world: int) -> None:
    cost = dataclasses.replace(
        load_cost_model("llama3-8b-h100", world_size=world), tokens_per_rank=CAP
    )
    cluster = Cluster(world, 4)
    cases = [c for c in _cases() if c["world"] == world]
    assert len(cases) >= 8
    for case in cases:
        lengths = case["lengths"]
        want, passes = expected_rank_runs(lengths, world)
        plan = megatron_dcp_plan(lengths, cost, cluster)
        plan.validate(lengths, cost, world)  # main's scheduler pads nothing
        assert plan.extra["scheduler_microbatches"] == len(want)
        assert len(plan.microbatches) == passes
        assert plan_rank_runs(plan, world) == want, (case["set"], case["step"])
