"""The column-generation (configuration LP) bound is a true bound and is tighter where it should be.

Reference: ``tests.helpers.solver.brute_force_ms`` enumerates every partition and group mix; it
shares no code with ``bounds.instance_lp_bound``.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hsp.planner.search.bounds import lower_bound_ms, lp_lower_bound_ms
from megatron_hsp.planner.search.instance import resolve_sizes
from megatron_hsp.planner.topology import Cluster
from tests.helpers.solver import brute_force_ms, toy_cost


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world=st.sampled_from([1, 2, 4]),
    cap=st.integers(50, 400),
    fixed=st.floats(0.0, 20.0),
    attn=st.sampled_from([1e-6, 1e-5, 1e-4, 1e-3]),
    a2a=st.sampled_from([0.0005, 0.002, 0.02]),
    rel_width=st.sampled_from([0.0, 0.3]),
    data=st.data(),
)
def test_lp_bound_below_brute_force_optimum(world, cap, fixed, attn, a2a, rel_width, data):
    cluster = Cluster(world, world)
    cost = toy_cost(world, cap, fixed, a2a=a2a, attn=attn)
    longest = cost.max_trainable_length(resolve_sizes(cost, cluster, None))
    lengths = data.draw(st.lists(st.integers(1, longest), min_size=1, max_size=4))
    optimum = brute_force_ms(lengths, cost, cluster, resolve_sizes(cost, cluster, None))
    lp = lp_lower_bound_ms(lengths, cost, cluster, rel_width=rel_width)
    assert lp.bound_ms <= optimum * (1 + 1e-9) + 1e-9
    assert lp.bound_ms <= lp.lp_ms * (1 + 1e-9) + 1e-9


def test_lp_bound_tighter_than_combinatorial_when_ranks_round_up():
    # Four sequences that each need 2 or 3 of 4 ranks: at most two share a micro-batch, which the
    # work and critical-path facts do not see. The LP reaches the brute-force optimum here. Every
    # pass a barrier (ZeRO-3): with several passes per group a pattern is a segment, whose
    # passes the LP does not bind to the ranks (docs/solver.md).
    cluster = Cluster(4, 4)
    cost = replace(toy_cost(4, 92, 11.86765456030689, a2a=0.0005, attn=1e-4), pass_barrier=True)
    lengths = [189, 181, 225, 122]
    optimum = brute_force_ms(lengths, cost, cluster, resolve_sizes(cost, cluster, None))
    old = lower_bound_ms(lengths, cost, cluster)
    lp = lp_lower_bound_ms(lengths, cost, cluster, rel_width=0.0)
    assert lp.converged
    assert old < 0.8 * optimum
    assert lp.bound_ms >= 0.999 * optimum


def test_lp_bound_stopped_early_is_still_a_bound():
    # With no pricing round the bound is Farley's scaled dual of the starting columns: lower
    # than the LP, never above the optimum, and reported as not converged.
    cluster = Cluster(4, 4)
    cost = toy_cost(4, 92, 11.86765456030689, a2a=0.0005, attn=1e-4)
    lengths = [189, 181, 225, 122, 40, 30]
    full = lp_lower_bound_ms(lengths, cost, cluster, rel_width=0.0)
    cut = lp_lower_bound_ms(lengths, cost, cluster, rel_width=0.0, max_iterations=0)
    optimum = brute_force_ms(lengths, cost, cluster, resolve_sizes(cost, cluster, None))
    assert not cut.converged and cut.iterations == 0
    assert cut.bound_ms <= full.bound_ms * (1 + 1e-9) <= optimum * (1 + 1e-9)


def test_lp_bound_stays_below_the_optimum_with_a_near_zero_fixed_cost():
    # Found by Hypothesis (issue 19): with b ~ 1e-7 ms the column "both sequences in one group"
    # improves the master by less than the convergence tolerance, so the LP "converged" at two
    # micro-batches and the bound sat 1.1e-7 ms above the optimum.
    cluster = Cluster(1, 1)
    cost = toy_cost(1, 50, 1.192092896e-07, a2a=0.0005, attn=1e-6)
    lengths = [1, 1]
    optimum = brute_force_ms(lengths, cost, cluster, resolve_sizes(cost, cluster, None))
    lp = lp_lower_bound_ms(lengths, cost, cluster, rel_width=0.0)
    assert lp.bound_ms <= optimum * (1 + 1e-9) + 1e-9
    assert lp.bound_ms >= optimum * (1 - 1e-5)  # still tight
