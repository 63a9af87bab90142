"""``megatron-dcp-dev`` and ``dp-balanced`` plans against what dev's own schedulers returned.

Megatron-LM dev's ``DefaultDynamicCPScheduler`` and ``DpBalancedScheduler`` are in no released
megatron-core, so their outputs on the dynamic-CP benchmark's batches were recorded by running
dev's code (``benchmarks/record_megatron_schedules.py``; commit and command in the fixture).
For every recorded batch: the dev plan, fed those groups, holds dev's micro-batches, per-rank
sample lists, CP sizes (ranks holding a sample, as ``build_packed_microbatches`` counts them)
and padded lengths, one packed pass per micro-batch; our ``dp_balanced_layout`` port returns
dev's packs, padded as dev's dataset pads (``2 * cp``), with CP 4 groups.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest

from megatron_hsp.evaluation.baselines import dp_balanced_plan
from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.topology import Cluster

FIXTURE = Path(__file__).parent.parent / "fixtures/megatron_dev_schedules.json"
DATA = json.loads(FIXTURE.read_text())
CAP = DATA["max_seqlen_per_dp_cp_rank"]
WORLDS = sorted({c["world"] for c in DATA["cases"]})


def _cost(world: int):
    cost = load_cost_model("llama3-8b-h100", world_size=world)
    return dataclasses.replace(cost, tokens_per_rank=CAP)


def _rank_multiset(groups_per_rank: list[list[int]], lengths: list[int]) -> Counter:
    """One micro-batch as the multiset of per-rank (sorted samples, CP size, lengths)."""
    out = Counter()
    for ids in groups_per_rank:
        cp = {sum(sid in other for other in groups_per_rank) for sid in ids}
        assert len(cp) <= 1  # one CP size per rank and micro-batch (dev packs them together)
        out[
            (tuple(sorted(ids)), cp.pop() if cp else 0, tuple(lengths[i] for i in sorted(ids)))
        ] += 1
    return out


def _plan_multiset(mb, world: int) -> Counter:
    per_rank = {r: ((), 0, ()) for r in range(world)}
    for g in mb.groups:
        order = sorted(range(len(g.seq_ids)), key=lambda k: g.seq_ids[k])
        key = (
            tuple(g.seq_ids[k] for k in order),
            g.size if g.seq_ids else 0,
            tuple(g.lengths[k] for k in order),
        )
        for r in g.ranks:
            per_rank[r] = key
    return Counter(per_rank.values())


def test_fixture_records_devs_commit_and_command() -> None:
    assert DATA["commit"] == "d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1"
    assert "record_megatron_schedules.py" in DATA["command"]
    assert {c["set"] for c in DATA["cases"]} == {"default", "skewed"}


@pytest.mark.parametrize("world", WORLDS)
def test_dev_plan_holds_devs_micro_batches_groups_and_paddings(world: int) -> None:
    from megatron_hsp.evaluation.torch_side.dcp_dev_baseline import megatron_dcp_dev_plan

    cost, cluster = _cost(world), Cluster(world, 4)
    for case in (c for c in DATA["cases"] if c["world"] == world):
        padded, groups = case["dynamic_cp_padded"], case["dynamic_cp_groups"]

        def replay(samples, n, cap, padded=padded, groups=groups):
            assert [s for _, s in samples] == padded and n == world and cap == CAP
            return groups

        plan = megatron_dcp_dev_plan(case["lengths"], cost, cluster, replay)
        plan.validate(padded, cost, world)
        assert plan.extra["thd_pad_divisor"] == 2 * world
        assert plan.extra["padding_tokens"] == sum(padded) - sum(case["lengths"])
        assert len(plan.microbatches) == len(groups)  # one packed pass per micro-batch
        for mb, want in zip(plan.microbatches, groups, strict=True):
            ranks = list(want) + [[]] * (world - len(want))
            assert _plan_multiset(mb, world) == _rank_multiset(ranks, padded)


@pytest.mark.parametrize("world", WORLDS)
def test_dp_balanced_port_returns_devs_packs(world: int) -> None:
    cost, cluster = _cost(world), Cluster(world, 4)
    cp = DATA["cp"]
    for case in (c for c in DATA["cases"] if c["world"] == world):
        padded, groups = case["dp_balanced_padded"], case["dp_balanced_groups"]
        plan = dp_balanced_plan(case["lengths"], cost, cluster, cp)
        plan.validate(padded, cost, world)
        assert plan.extra["thd_pad_divisor"] == 2 * cp
        assert len(plan.microbatches) == len(groups)
        for mb, want in zip(plan.microbatches, groups, strict=True):
            assert _plan_multiset(mb, world) == _rank_multiset(want, padded)
            assert all(g.size == cp and (g.ulysses, g.ring) == (1, cp) for g in mb.groups)
