"""Fact 5 of the lower bound (issue 19): memory granularity against fixed costs."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megatron_hsp.planner.search.bounds as bounds
from megatron_hsp.planner.search.instance import Instance, check_lengths, resolve_sizes
from megatron_hsp.planner.topology import Cluster
from tests.helpers.solver import brute_force_ms, toy_cost


def _inst(world, cap, fixed, attn, a2a, lengths):
    cluster = Cluster(world, world)
    cost = toy_cost(world, cap, fixed, a2a=a2a, attn=attn)
    sizes = resolve_sizes(cost, cluster, None)
    inst = Instance.build(check_lengths(lengths, cost, sizes), cost, cluster, sizes)
    m_min = max(1, math.ceil(sum(lengths) / (world * inst.cap)))
    return inst, m_min, cost, cluster, sizes


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world=st.sampled_from([1, 2, 4]),
    cap=st.integers(50, 400),
    fixed=st.floats(0.0, 20.0),
    attn=st.sampled_from([1e-6, 1e-5, 1e-4, 1e-3]),
    a2a=st.sampled_from([0.0005, 0.002, 0.02]),
    data=st.data(),
)
def test_fact5_below_brute_force_optimum(world, cap, fixed, attn, a2a, data):
    cost = toy_cost(world, cap, fixed, a2a=a2a, attn=attn)
    cluster = Cluster(world, world)
    longest = cost.max_trainable_length(resolve_sizes(cost, cluster, None))
    lengths = data.draw(st.lists(st.integers(1, longest), min_size=1, max_size=5))
    inst, m_min, cost, cluster, sizes = _inst(world, cap, fixed, attn, a2a, lengths)
    optimum = brute_force_ms(lengths, cost, cluster, sizes)
    assert bounds._memory_packing_bound(inst, m_min) <= optimum * (1 + 1e-9) + 1e-9
    assert bounds.instance_lower_bound(inst) <= optimum * (1 + 1e-9) + 1e-9


def test_fact5_charges_sequences_over_half_a_rank(monkeypatch):
    # One rank of 210 tokens; 144, 157 and 187 each take more than half of it, so no two share a
    # micro-batch, while facts 1-4 pack the 575 tokens into 3 micro-batches' worth of work.
    args = (1, 210, 9.901, 1e-3, 5e-4, [87, 144, 157, 187])
    inst, m_min, cost, cluster, sizes = _inst(*args)
    optimum = brute_force_ms(args[-1], cost, cluster, sizes)
    fact5 = bounds._memory_packing_bound(inst, m_min)
    monkeypatch.setattr(bounds, "_memory_packing_bound", lambda *a, **k: 0.0)
    facts_1_to_4 = bounds.instance_lower_bound(inst)
    assert fact5 > 1.05 * facts_1_to_4
    assert fact5 <= optimum * (1 + 1e-9)
    assert fact5 >= 0.99 * optimum  # tight here
