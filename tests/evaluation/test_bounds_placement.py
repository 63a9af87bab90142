"""The placement-aware LP bound: below every plan aligned blocks can hold, above plans they cannot.

The reference is ``tests.helpers.solver.brute_force_ms(..., placed=True)``: every set partition
of the batch, every size mix an exhaustive search over ``Cluster.block_starts`` places, every
assignment;
it shares no code with ``placement_bound`` (which enumerates mixes by its own search and prices
patterns by a MILP).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hsp.evaluation import placement_bound
from megatron_hsp.evaluation.placement_bound import (
    cross_node_mixes,
    node_configs,
    placement_lp_bound,
)
from megatron_hsp.planner.search.bounds import lower_bound_ms
from megatron_hsp.planner.search.instance import Instance, check_lengths, resolve_sizes
from megatron_hsp.planner.search.settings import SolverConfig
from megatron_hsp.planner.search.solver import solve
from megatron_hsp.planner.topology import Cluster
from tests.helpers.solver import brute_force_ms, toy_cost


def _bound(lengths, cost, cluster, **kw):
    sizes = resolve_sizes(cost, cluster, None)
    inst = Instance.build(check_lengths(lengths, cost, sizes), cost, cluster, sizes)
    return placement_lp_bound(inst, cluster, **kw), sizes


def test_mixes_on_eight_nodes_of_eight_are_the_ten_that_aligned_blocks_hold():
    mixes = cross_node_mixes(Cluster(64, 8), [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64])
    got = sorted(tuple(sorted((d, c) for d, c in m.items() if c)) for m in mixes)
    assert got == sorted(
        [
            ((64, 1),),
            ((56, 1),),
            ((16, 1), (48, 1)),
            ((16, 1), (40, 1)),
            ((32, 2),),
            ((24, 1), (32, 1)),  # 24 at 0, 32 at 32
            ((16, 2), (32, 1)),
            ((16, 1), (24, 2)),
            ((16, 2), (24, 1)),
            ((16, 4),),
        ]
    )
    # 40 + 24 is not there: 40 starts at 0 only, 24 at 0 or 24.
    assert not any(m.get(40) and m.get(24) for m in mixes)


def test_mixes_past_the_limit_are_not_enumerated(monkeypatch):
    monkeypatch.setattr(placement_bound, "MAX_MIXES", 3)
    assert cross_node_mixes(Cluster(64, 8), [16, 24, 32, 40, 48, 56, 64]) is None


def test_node_configurations_of_eight_slots_are_the_ten_that_offsets_hold():
    configs = node_configs(Cluster(64, 8), [1, 2, 3, 4, 5, 6, 7, 8, 16])
    got = sorted(tuple(sorted((d, c) for d, c in m.items() if c)) for m in configs)
    assert got == sorted(
        [
            ((8, 1),),
            ((7, 1),),
            ((2, 1), (6, 1)),
            ((2, 1), (5, 1)),  # 5 at 0, 2 at 6; 3 fits beside 5 nowhere (offsets 0 and 3)
            ((4, 2),),
            ((3, 1), (4, 1)),  # 3 at 0, 4 at 4
            ((2, 2), (4, 1)),
            ((2, 1), (3, 2)),
            ((2, 2), (3, 1)),
            ((2, 4),),
        ]
    )


def test_no_multi_rank_sequence_means_no_bound():
    cluster = Cluster(4, 2)
    cost = toy_cost(4, 100)
    bound, _ = _bound([50, 80, 100], cost, cluster, intra_node=True)
    assert bound is None  # every sequence fits one rank: bounds.py's facts already cover it


def test_bound_counts_the_placement_rule_inside_a_node():
    """Sequences needing 5 and 3 ranks fill a node of 8, but a 3-rank block starts at offset 0
    or 3 and the 5-rank block at 0: never side by side."""
    cluster = Cluster(8, 8)
    cost = toy_cost(8, 100, fixed=5.0, attn=1e-4, fixed_per_rank=2.0)
    lengths = [490, 290]
    bound, sizes = _bound(lengths, cost, cluster, intra_node=True)
    free = brute_force_ms(lengths, cost, cluster, sizes)
    placed = brute_force_ms(lengths, cost, cluster, sizes, placed=True)
    assert bound is not None and bound.converged
    assert free * 1.15 < bound.bound_ms <= placed * (1 + 1e-9)
    assert bound.bound_ms == pytest.approx(placed, rel=1e-6)


def test_bound_counts_the_placement_rule_on_ten_ranks():
    """A sequence needing 6 ranks and one needing 4 fill 10 ranks, but 4-rank blocks start at 0
    and 4 and the only 6-rank block at 0: they never run side by side. The bound must sit above
    the alignment-free optimum (which pairs them) and at or below the placed optimum."""
    cluster = Cluster(10, 2)
    # Fixed costs growing with the size (as calibrated models' do) make one 10-rank group for
    # both dearer than side by side.
    cost = toy_cost(10, 100, fixed=5.0, attn=1e-4, fixed_per_rank=2.0)
    lengths = [590, 390]
    bound, sizes = _bound(lengths, cost, cluster)
    free = brute_force_ms(lengths, cost, cluster, sizes)
    placed = brute_force_ms(lengths, cost, cluster, sizes, placed=True)
    assert bound is not None and bound.converged
    assert free < placed
    assert free * 1.2 < bound.bound_ms <= placed * (1 + 1e-9)
    assert bound.bound_ms == pytest.approx(placed, rel=1e-6)  # tight here
    assert lower_bound_ms(lengths, cost, cluster) < free * (1 + 1e-9)  # blind to placement


def test_bound_counts_short_sequences_inside_a_long_group_at_their_cross_node_cost():
    """A 519-token sequence needs a 6-rank group (cross-node); the 75-token one fits a rank.
    Beside the long group no rank is free, so the short one runs in another micro-batch (a
    fixed cost) or inside the long group at its 6-rank cost (all-to-all heavy here), never at
    its one-rank minimum in the long group's spare memory, which a bound pooling all memory and
    time assumed (40.55 ms against the placed optimum's 42.73)."""
    cluster = Cluster(6, 2)
    cost = toy_cost(6, 100, fixed=20.0, a2a=0.1, attn=1e-5)
    lengths = [519, 75]
    bound, sizes = _bound(lengths, cost, cluster)
    placed = brute_force_ms(lengths, cost, cluster, sizes, placed=True)
    assert bound is not None and bound.converged
    assert 0.99 * placed <= bound.bound_ms <= placed * (1 + 1e-9)


def test_bound_ties_short_sequences_work_to_their_tokens_in_every_micro_batch():
    """A 449-token sequence needs all 4 ranks; three short ones fill nearly a rank each. The
    tokens that do not fit beside the long one need a micro-batch of their own, which then also
    carries their work: a bound that put their tokens there but their work in the long
    micro-batch's idle ranks stayed at 24.30 ms against the placed optimum's 26.23. Every pass a
    barrier (ZeRO-3): the cap on a pattern's free work by its free tokens is that model's."""
    cluster = Cluster(4, 1)
    cost = replace(toy_cost(4, 200, fixed=5.0, a2a=0.02, attn=1e-4), pass_barrier=True)
    lengths = [449, 101, 101, 116]
    bound, sizes = _bound(lengths, cost, cluster)
    placed = brute_force_ms(lengths, cost, cluster, sizes, placed=True)
    assert bound is not None and bound.converged
    assert 0.98 * placed <= bound.bound_ms <= placed * (1 + 1e-9)


def test_bound_limits_each_pattern_to_the_work_its_spare_memory_holds():
    """A 741-token sequence needs 4 of 8 ranks (across nodes of 2); three short ones run beside
    it or after it. Short sequences carry little work per token here, so ranks beside the long
    group run out of memory long before they run out of time. A bound that pooled free time and
    free memory over the patterns it mixes let one pattern's idle time hold work whose tokens
    only another pattern's memory had room for: 20.88 ms against the placed optimum's 21.59.
    Each pattern now offers at most the work its own spare tokens can carry (densest first);
    where every pass is a barrier (ZeRO-3): with several passes per group the free ranks also
    hold further passes' tokens, and the cap is not applied."""
    cluster = Cluster(8, 2)
    cost = replace(
        toy_cost(8, 238, 3.04, a2a=0.002, attn=1e-4, fixed_per_rank=0.5), pass_barrier=True
    )
    lengths = [741, 129, 143, 53]
    bound, sizes = _bound(lengths, cost, cluster, rel_width=0.2)
    placed = brute_force_ms(lengths, cost, cluster, sizes, placed=True)
    assert bound is not None and bound.converged
    assert 0.99 * placed <= bound.bound_ms <= placed * (1 + 1e-9)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.sampled_from([(4, 1), (6, 2), (8, 2), (10, 2), (6, 1), (8, 8), (8, 4)]),
    cap=st.integers(50, 300),
    fixed=st.floats(0.5, 20.0),
    attn=st.sampled_from([1e-5, 1e-4, 1e-3]),
    a2a=st.sampled_from([0.002, 0.1]),  # 0.1: short sequences cost far more in big groups
    grow=st.sampled_from([0.0, 0.5]),
    barrier=st.booleans(),  # every pass a barrier (ZeRO-3) or groups' passes back to back
    data=st.data(),
)
def test_bound_below_the_placed_brute_force_optimum(
    shape, cap, fixed, attn, a2a, grow, barrier, data
):
    """Sound for every plan the runtime can place, under both pass rules of the execution
    model: the brute force enumerates placed plans with several passes per group where passes
    are not barriers (issue 30 item 6: the bound the FlexSP-preset gaps are quoted against)."""
    world, gpn = shape
    cluster = Cluster(world, gpn)
    cost = toy_cost(world, cap, fixed, a2a=a2a, attn=attn, fixed_per_rank=grow)
    cost = replace(cost, pass_barrier=barrier)
    sizes = resolve_sizes(cost, cluster, None)
    longest = cost.max_trainable_length(sizes)
    # Longer than a rank holds: placed explicitly (in a cross-node or an intra-node group).
    long = data.draw(st.lists(st.integers(cap + 1, longest), min_size=1, max_size=2))
    short = data.draw(st.lists(st.integers(1, cap), max_size=3))
    lengths = data.draw(st.permutations(long + short))
    bound, _ = _bound(
        lengths,
        cost,
        cluster,
        rel_width=data.draw(st.sampled_from([0.0, 0.2])),
        intra_node=data.draw(st.booleans()),
    )
    if bound is None:  # nothing to place explicitly: every sequence fits a node
        assert max(lengths) <= gpn * cap
        return
    optimum = brute_force_ms(lengths, cost, cluster, sizes, placed=True)
    assert bound.bound_ms <= optimum * (1 + 1e-7) + 1e-7


def test_bound_below_the_planner_on_a_long_heavy_batch():
    """A 64-rank batch like the suite's bimodal one (long sequences of 50-100% of the longest
    trainable, the rest short): the planner's plan is placeable, so it can be no better."""
    import numpy as np

    cluster = Cluster(64, 8)
    cost = toy_cost(64, 200, fixed=20.0, attn=2e-4, fixed_per_rank=0.1)
    sizes = resolve_sizes(cost, cluster, None)
    rng = np.random.default_rng(3)
    longest = cost.max_trainable_length(sizes)
    lengths = [int(x) for x in rng.integers(longest // 2, longest, 12)]
    lengths += [int(x) for x in rng.integers(20, 400, 60)]
    bound, _ = _bound(lengths, cost, cluster, time_limit_s=30.0)
    plan = solve(lengths, cost, cluster, SolverConfig(time_budget_s=2.0))
    assert bound is not None
    assert bound.bound_ms <= plan.est_step_ms * (1 + 1e-9)
    assert bound.bound_ms > 0.5 * plan.est_step_ms  # not a trivial bound
    assert bound.long_sequences == 12


def test_bound_lets_a_group_run_further_passes_beside_a_long_one():
    """The 212-token sequence needs 4 of 6 ranks; 54 and 53 tokens overflow the 2 free ranks'
    106 by one token. Per micro-batch that token forced a second micro-batch (14.236 ms), but
    the free ranks' group runs a second pass beside the long one: the optimum is the long
    group's 14.224 ms, and a bound that counted per micro-batch exceeded it. (13.24 ms now:
    without the free-work cap, which several passes per group make unsound as it stands.)"""
    cluster = Cluster(6, 2)
    cost = toy_cost(6, 53, 0.5, a2a=0.1, attn=1e-4, fixed_per_rank=0.5)
    lengths = [54, 212, 53]
    bound, sizes = _bound(lengths, cost, cluster)
    placed = brute_force_ms(lengths, cost, cluster, sizes, placed=True)
    assert bound is not None
    assert 0.9 * placed <= bound.bound_ms <= placed * (1 + 1e-9)
