"""The lower bound is a true bound: below brute-force optima and below every plan we make."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from solver_helpers import brute_force_ms, toy_cost

from megatron_hsp.planner.bounds import lower_bound_ms
from megatron_hsp.planner.errors import InfeasibleError
from megatron_hsp.planner.instance import resolve_sizes
from megatron_hsp.planner.solver import SolverConfig, solve
from megatron_hsp.planner.topology import Cluster


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world=st.sampled_from([1, 2, 4]),
    cap=st.integers(50, 400),
    fixed=st.floats(0.0, 20.0),
    attn=st.sampled_from([1e-6, 1e-5, 1e-4, 1e-3]),
    a2a=st.sampled_from([0.0005, 0.002, 0.02]),
    data=st.data(),
)
def test_bound_below_brute_force_optimum(world, cap, fixed, attn, a2a, data):
    cluster = Cluster(world, world)
    cost = toy_cost(world, cap, fixed, a2a=a2a, attn=attn)
    sizes = resolve_sizes(cost, cluster, None)
    longest = cost.max_trainable_length(sizes)
    lengths = data.draw(st.lists(st.integers(1, longest), min_size=1, max_size=4))
    optimum = brute_force_ms(lengths, cost, cluster, sizes)
    bound = lower_bound_ms(lengths, cost, cluster)
    assert bound <= optimum * (1 + 1e-9) + 1e-9
    plan = solve(lengths, cost, cluster, SolverConfig(time_budget_s=5.0))
    assert plan.est_step_ms >= optimum * (1 - 1e-9) - 1e-9
    assert plan.lower_bound_ms == pytest.approx(bound)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4000), min_size=1, max_size=80),
    nodes=st.integers(1, 4),
    gpn=st.sampled_from([1, 2, 4, 8]),
    cap=st.integers(500, 3000),
)
def test_bound_below_every_plan(lengths, nodes, gpn, cap):
    cluster = Cluster(nodes * gpn, gpn)
    cost = toy_cost(cluster.world_size, cap)
    try:
        bound = lower_bound_ms(lengths, cost, cluster)
    except InfeasibleError:
        return
    plan = solve(lengths, cost, cluster, SolverConfig(use_milp=False))
    assert bound <= plan.est_step_ms * (1 + 1e-9)


def test_bound_rejects_untrainable_sequence():
    cluster = Cluster(4, 4)
    cost = toy_cost(4, 100)
    with pytest.raises(InfeasibleError, match=r"sequence 1 has length 401.*longest trainable"):
        lower_bound_ms([10, 401], cost, cluster)
