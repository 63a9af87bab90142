"""solve(): a valid plan or a clear HSPError, for random batches and cluster shapes."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hsp.planner.errors import HSPError
from megatron_hsp.planner.search.settings import SolverConfig
from megatron_hsp.planner.search.solver import solve
from megatron_hsp.planner.topology import Cluster
from tests.helpers.solver import toy_cost


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world=st.integers(1, 64),
    gpn=st.integers(1, 8),
    cap=st.integers(64, 5000),
    lengths=st.lists(st.integers(-5, 60_000), min_size=0, max_size=120),
    use_milp=st.booleans(),
    pow2_only=st.booleans(),
)
def test_valid_plan_or_clear_error(world, gpn, cap, lengths, use_milp, pow2_only):
    try:
        cluster = Cluster(world, gpn)
        cost = toy_cost(world, cap)
        sizes = None
        if pow2_only:
            sizes = tuple(d for d in cluster.power_of_two_sizes())
        plan = solve(
            lengths,
            cost,
            cluster,
            SolverConfig(time_budget_s=0.3, use_milp=use_milp, sizes=sizes, milp_slice_s=0.05),
        )
    except HSPError as exc:
        assert str(exc)  # every error says something
        return
    assert plan.problems(lengths, cost, world) == []
    assert plan.status in ("optimal", "time_limit", "fallback", "heuristic")
    assert plan.lower_bound_ms <= plan.est_step_ms * (1 + 1e-9)
    total = sum(mb.est_ms for mb in plan.microbatches)
    assert abs(total - plan.est_step_ms) <= 1e-6 * max(1.0, total)
    for mb in plan.microbatches:
        for g in mb.groups:
            if g.seq_ids:
                assert abs(g.est_ms - cost.group_ms(g.lengths, g.size)) <= 1e-6 * g.est_ms
    # The execution model by hand: consecutive passes of one rank partition form a segment
    # (``toy_cost`` has no per-pass barrier), which ends when its busiest group does.
    by_hand, run = 0.0, {}
    for i, mb in enumerate(plan.microbatches):
        layout = sorted(g.ranks for g in mb.groups)
        if i and layout != sorted(g.ranks for g in plan.microbatches[i - 1].groups):
            by_hand, run = by_hand + max(run.values()), {}
        for g in mb.groups:
            run[g.ranks] = run.get(g.ranks, 0.0) + g.est_ms
    by_hand += max(run.values())
    assert abs(by_hand - plan.est_step_ms) <= 1e-6 * max(1.0, by_hand)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=st.integers(1, 8),
    gpn=st.integers(1, 8),
    cap=st.integers(64, 5000),
    use_milp=st.booleans(),
    data=st.data(),
)
def test_trainable_batches_always_get_a_valid_plan(nodes, gpn, cap, use_milp, data):
    """Lengths the largest group can hold never fail: the planner must find a plan."""
    cluster = Cluster(nodes * gpn, gpn)
    cost = toy_cost(cluster.world_size, cap)
    longest = cost.max_trainable_length(cluster.legal_sizes())
    lengths = data.draw(
        st.lists(
            st.one_of(st.integers(1, max(1, cap // 4)), st.integers(1, longest)),
            min_size=1,
            max_size=150,
        )
    )
    plan = solve(lengths, cost, cluster, SolverConfig(time_budget_s=0.3, use_milp=use_milp))
    assert plan.problems(lengths, cost, cluster.world_size) == []
    assert plan.num_sequences == len(lengths)


@pytest.mark.spawns
def test_planner_never_imports_torch():
    code = (
        "import sys, megatron_hsp.planner.search.solver, megatron_hsp.planner.search.milp; "
        "assert 'torch' not in sys.modules, 'planner imported torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
