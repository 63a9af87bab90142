"""``megatron-static-cp<N>``: the user's static CP as stock Megatron runs their flags (issue 43
item 2): packed ``--seq-length`` samples, dealt per data-parallel rank as Megatron's sampler
deals them, causal over each sample unless the samples carry ``cu_seqlens``, ``--cp-comm-type``
honoured, priced by the one price function."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron_hsp.evaluation.baselines import (
    StockCP,
    megatron_static_plan,
    stock_samples,
    trained_lengths,
)
from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.cost.execution import price
from megatron_hsp.planner.errors import InfeasibleError, InputError
from megatron_hsp.planner.topology import Cluster


@pytest.fixture(scope="module")
def cost():
    return load_cost_model("llama3-8b-h100", world_size=8)  # 32 / 8 heads, 3261 tokens per GPU


def test_samples_are_the_documents_concatenated_and_cut_at_seq_length():
    # stream 5 | 3 | 10 | 2, windows of 6: [5, 1] [2, 4] [6] and what is left, [2]
    assert stock_samples([5, 3, 10, 2], 6) == [[5, 1], [2, 4], [6], [2]]
    assert stock_samples([6, 6], 6) == [[6], [6]]
    assert stock_samples([13], 4) == [[4], [4], [4], [1]]


def test_samples_are_dealt_to_data_parallel_ranks_as_megatrons_sampler_deals_them(cost):
    """8 GPUs, CP 2: 4 data-parallel ranks; micro-batch size 2: micro-batch m gives rank r the
    samples 8m + 2r and 8m + 2r + 1 (``MegatronPretrainingSampler``)."""
    stock = StockCP(cp=2, seq_length=1000, micro_batch_size=2)
    lengths = [1000] * 16
    plan = megatron_static_plan(lengths, cost, Cluster(8, 8), stock)
    assert len(plan.microbatches) == 2
    for m, mb in enumerate(plan.microbatches):
        for r, g in enumerate(mb.groups):
            assert g.ranks == (2 * r, 2 * r + 1)
            assert g.seq_ids == (8 * m + 2 * r, 8 * m + 2 * r + 1)
            assert g.lengths == (1000, 1000)


def test_attention_is_causal_over_the_sample_unless_it_carries_cu_seqlens(cost):
    rng = np.random.default_rng(3)
    lengths = rng.integers(50, 1500, size=60)
    cluster = Cluster(8, 8)
    causal = megatron_static_plan(lengths, cost, cluster, StockCP(cp=4, seq_length=4096))
    thd = megatron_static_plan(
        lengths, cost, cluster, StockCP(cp=4, seq_length=4096, per_document=True)
    )
    samples = stock_samples(lengths, 4096)
    groups = [g for mb in causal.microbatches for g in mb.groups if g.lengths]
    assert [g.lengths for g in groups] == [(sum(s),) for s in samples]  # one unit per sample
    pieces = [g.lengths for mb in thd.microbatches for g in mb.groups if g.lengths]
    assert pieces == [tuple(s) for s in samples]
    for plan in (causal, thd):  # the batch's tokens, no more and no fewer
        assert sum(g.tokens for mb in plan.microbatches for g in mb.groups) == lengths.sum()
        plan.validate(trained_lengths(plan, lengths).tolist(), cost, 8)
    # attention over the whole 4096-token sample costs more than over its documents
    assert causal.est_step_ms > thd.est_step_ms
    # priced by the one price function
    assert price(causal, cost).est_step_ms == pytest.approx(causal.est_step_ms, rel=1e-12)


def test_cp_comm_type_sets_the_split_and_its_pricing(cost):
    lengths = [4096] * 8
    cluster = Cluster(8, 8)

    def plan(**kw):
        return megatron_static_plan(lengths, cost, cluster, StockCP(cp=4, seq_length=4096, **kw))

    def splits(p):
        return {(g.ulysses, g.ring) for mb in p.microbatches for g in mb.groups if g.lengths}

    p2p, a2a = plan(), plan(comm="a2a")
    gather = plan(comm="allgather")
    hier = plan(comm="a2a+p2p", a2a_size=2)
    assert splits(p2p) == {(1, 4)} and splits(gather) == {(1, 4)}
    assert splits(a2a) == {(4, 1)} and splits(hier) == {(2, 2)}
    # allgather gathers K/V before attention: nothing of the ring's traffic overlapped
    assert gather.est_step_ms > p2p.est_step_ms
    assert gather.extra["ring"] == "exposed" and p2p.extra["ring"] == "overlap"


def test_a2a_the_heads_do_not_divide_is_refused_as_megatron_refuses_it():
    cost = load_cost_model("llama3-8b-h100", world_size=6, gpus_per_node=6)
    with pytest.raises(InputError, match="query heads per tensor-parallel rank \\(32\\)"):
        megatron_static_plan([3000] * 4, cost, Cluster(6, 6), StockCP(3, 3000, comm="a2a"))
    with pytest.raises(InputError, match="--cp-comm-type"):
        StockCP(2, 1000, comm="ring")
    with pytest.raises(InputError, match="must divide --context-parallel-size 4"):
        StockCP(4, 1000, comm="a2a+p2p", a2a_size=3)


def test_a_stock_step_over_memory_is_infeasible_naming_the_cap(cost):
    stock = StockCP(cp=1, seq_length=8192)  # 8192 tokens on one GPU of 3261
    with pytest.raises(InfeasibleError, match="memory cap of 3261 tokens"):
        megatron_static_plan([8192] * 8, cost, Cluster(8, 8), stock)
    fits = megatron_static_plan([8192] * 8, cost, Cluster(8, 8), dataclasses.replace(stock, cp=4))
    assert fits.extra["samples"] == 8 and len(fits.microbatches) == 4  # 8 samples over DP 2
