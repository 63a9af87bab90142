"""The execution model's price (``planner/cost/execution.py``), checked against prices written
out by hand from ``CostModel.group_ms``: passes of one layout share a segment unless every pass
is a barrier (ZeRO-3), layouts change at barriers."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.cost.execution import balance_segments, group_by_layout, price, segments
from megatron_hsp.planner.plan import Group, MicroBatch, Plan


def _plan(cost) -> Plan:
    def g(ranks, ids, lens):
        return Group(tuple(ranks), tuple(ids), tuple(lens), 0.0, *cost.recorded_split(len(ranks)))

    left, right, whole = range(4), range(4, 8), range(8)
    return Plan(
        8,
        8,
        (
            MicroBatch((g(left, [0], [9000]), g(right, [1], [1000]))),
            MicroBatch((g(whole, [2], [20000]),)),
            MicroBatch((g(left, [3], [1000]), g(right, [4], [8000]))),
        ),
    )


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_price_by_hand(zero_stage: int) -> None:
    spec = {"preset": "llama3-8b-h100", "training": {"zero_stage": zero_stage}}
    cost = load_cost_model(spec, world_size=8)
    assert cost.pass_barrier == (zero_stage == 3)
    plan = _plan(cost)

    def t(lens: list[int], d: int) -> float:
        return cost.group_ms(lens, d)

    whole = t([20000], 8)
    if zero_stage == 3:  # every pass a barrier: the slowest group of each pass
        expect = max(t([9000], 4), t([1000], 4)) + whole + max(t([1000], 4), t([8000], 4))
        assert [len(s) for s in segments(plan, cost)] == [1, 1, 1]
    else:  # the layout changes at every pass here: the same as above
        expect = max(t([9000], 4), t([1000], 4)) + whole + max(t([1000], 4), t([8000], 4))
    assert price(plan, cost).est_step_ms == pytest.approx(expect)
    # Passes of one layout made adjacent share a segment where passes are not barriers: each
    # group runs its two passes back to back.
    grouped = price(group_by_layout(plan), cost)
    assert [len(mb.groups) for mb in grouped.microbatches] == [2, 2, 1]
    if zero_stage == 3:
        assert grouped.est_step_ms == pytest.approx(expect)
    else:
        pair = max(t([9000], 4) + t([1000], 4), t([1000], 4) + t([8000], 4))
        assert grouped.est_step_ms == pytest.approx(pair + whole)
        assert grouped.est_step_ms < expect
    # The micro-batches' estimates add up to the step; groups carry their pass time.
    assert sum(mb.est_ms for mb in grouped.microbatches) == pytest.approx(grouped.est_step_ms)
    assert grouped.microbatches[0].groups[0].est_ms == pytest.approx(t([9000], 4))
    # Coverage and fingerprints of the work are unchanged by pricing.
    assert price(plan, cost).fingerprint() == plan.fingerprint()


def test_pass_barrier_round_trips_and_is_derived_from_the_setup(tmp_path) -> None:
    z1 = load_cost_model("llama3-8b-h100", world_size=64)
    assert not z1.pass_barrier and z1.details["zero3_ms_per_microbatch"] == 0.0
    flex = load_cost_model("flexsp-gpt-7b", world_size=64)
    assert flex.pass_barrier  # FlexSP's setup is ZeRO-3
    for m in (z1, flex):
        assert load_cost_model(m.to_spec(), world_size=64) == m
    assert not dataclasses.replace(flex, pass_barrier=False).pass_barrier
    from megatron_hsp.planner.cost.first_principles import TrainingConfig

    assert TrainingConfig(zero_stage=3).pass_barrier(64)
    assert not TrainingConfig(zero_stage=3).pass_barrier(1)  # one rank: nothing to synchronise
    assert not TrainingConfig(zero_stage=1).pass_barrier(64)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_balance_segments_spreads_heavy_groups_over_the_blocks(zero_stage: int) -> None:
    """Two passes of one layout, the heavier group of each on the first block: balanced, the
    second pass's groups swap blocks, and the segment ends at the larger of the two crossed
    sums (written out from ``group_ms``); each pass keeps its sequences, sizes and splits.
    Where every pass is a barrier, nothing moves."""
    spec = {"preset": "llama3-8b-h100", "training": {"zero_stage": zero_stage}}
    cost = load_cost_model(spec, world_size=8)

    def g(ranks, ids, lens):
        return Group(tuple(ranks), tuple(ids), tuple(lens), 0.0, *cost.recorded_split(len(ranks)))

    left, right = range(4), range(4, 8)
    plan = Plan(
        8,
        8,
        (
            MicroBatch((g(left, [0], [9000]), g(right, [1], [1000]))),
            MicroBatch((g(left, [2], [8000]), g(right, [3], [2000]))),
        ),
    )
    balanced = price(balance_segments(plan, cost), cost)
    balanced.validate([9000, 1000, 8000, 2000], cost, 8)

    def t(lens: list[int]) -> float:
        return cost.group_ms(lens, 4)

    stacked = max(t([9000]) + t([8000]), t([1000]) + t([2000]))
    if zero_stage == 3:
        assert balanced == price(plan, cost)
        return
    assert price(plan, cost).est_step_ms == pytest.approx(stacked)
    crossed = max(t([9000]) + t([2000]), t([1000]) + t([8000]))
    assert balanced.est_step_ms == pytest.approx(crossed) and crossed < stacked
    for before, after in zip(plan.microbatches, balanced.microbatches, strict=True):
        assert {(g.seq_ids, g.size, g.ulysses, g.ring) for g in before.groups} == {
            (g.seq_ids, g.size, g.ulysses, g.ring) for g in after.groups
        }
        assert sorted(g.ranks for g in before.groups) == sorted(g.ranks for g in after.groups)


def test_step_wall_ms_is_the_one_step_rule() -> None:
    """A step's predicted time is the plan's price plus the per-step terms, for every method and
    for the training loop's logged prediction alike; the gradient all-reduce moves fp32 main
    grads (Megatron's default under --bf16), half that with --grad-reduce-in-bf16."""
    import types

    from megatron_hsp.megatron.model_cost import choose_hardware, default_cost_model_spec
    from megatron_hsp.planner.cost.costmodel import load_cost_model
    from megatron_hsp.planner.cost.execution import price, step_wall_ms
    from megatron_hsp.planner.search.solver import solve
    from megatron_hsp.planner.topology import Cluster
    from megatron_hsp.step.observe import predicted_step_ms

    flags = dict(num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=1024, bf16=True)
    hw = choose_hardware("h100-sxm")
    fp32, _ = default_cost_model_spec(types.SimpleNamespace(**flags), hw, 1)
    bf16, _ = default_cost_model_spec(
        types.SimpleNamespace(**flags, grad_reduce_in_bf16=True), hw, 1
    )
    cost = load_cost_model(fp32, world_size=8, gpus_per_node=8)
    half = load_cost_model(bf16, world_size=8, gpus_per_node=8)
    reduce32 = cost.details["grad_reduce_ms_per_step"]
    assert half.details["grad_reduce_ms_per_step"] == pytest.approx(reduce32 / 2)
    plan = solve([900, 700, 500, 300, 200, 100, 100, 50], cost, Cluster(8, 8))
    assert step_wall_ms(plan, cost) == pytest.approx(plan.est_step_ms + cost.step_overhead_ms)
    assert cost.step_overhead_ms > 0
    assert predicted_step_ms(plan, cost) == step_wall_ms(price(plan, cost), cost)
