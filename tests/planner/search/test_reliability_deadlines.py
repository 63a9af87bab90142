"""Issue 9 item 2, hard deadlines: the lower bound, run once per solve, honours the solve's budget.

Fact 4 of ``planner/search/bounds.py`` searches per critical sequence and per group size; it is made
adversarially slow here (each size's search takes 0.2 s) so that without the deadline a solve with
a 0.3 s budget would take > 2 s. With it, the solve returns within budget + margin and the bound
it reports is still a valid (weaker) bound.
"""

from __future__ import annotations

import random
import time

from megatron_hsp.planner.cost.costmodel import CostModel
from megatron_hsp.planner.search import bounds, solver
from megatron_hsp.planner.search.instance import Instance, check_lengths, resolve_sizes
from megatron_hsp.planner.topology import Cluster

COEFFS = {
    "attn_ms_per_token2": 1.0e-7,
    "linear_ms_per_token": 0.002,
    "group_fixed_ms": {0: 1.0},
    "a2a_ms_per_token": {2: 0.001, 4: 0.0008, 8: 0.0006},
    "tokens_per_rank": 4096,
}
SLOW_S = 0.2


def _instance(n_seqs: int = 1000) -> tuple[list[int], CostModel, Cluster, Instance]:
    rng = random.Random(0)
    cost = CostModel("t", **COEFFS)
    cluster = Cluster(64, 8)
    lengths = [rng.choice([100, 900, 2000, 4096]) for _ in range(n_seqs)]
    sizes = resolve_sizes(cost, cluster, None)
    inst = Instance.build(check_lengths(lengths, cost, sizes), cost, cluster, sizes)
    return lengths, cost, cluster, inst


def _slow_star_in_size(monkeypatch) -> None:
    real = bounds._star_in_size

    def slow(*args, **kwargs):
        time.sleep(SLOW_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(bounds, "_star_in_size", slow)


def test_cut_bound_is_valid_and_weaker():
    """A bound cut at once keeps facts 1-3: never above the full bound, never below fact 1."""
    _, _, _, inst = _instance()
    full = bounds.instance_lower_bound(inst)
    cut = bounds.instance_lower_bound(inst, deadline=time.perf_counter())
    work_fact = sum(inst.work_min) / inst.world_size + inst.min_fixed
    assert work_fact - 1e-9 <= cut <= full + 1e-9


def test_bound_returns_within_deadline_plus_one_size(monkeypatch):
    _, _, _, inst = _instance()
    _slow_star_in_size(monkeypatch)
    t0 = time.perf_counter()
    bounds.instance_lower_bound(inst, deadline=t0 + 0.1)
    # Margin: one size's search (SLOW_S) plus the linear facts.
    assert time.perf_counter() - t0 < 0.1 + SLOW_S + 0.5


def test_solve_meets_budget_with_slow_bound(monkeypatch):
    lengths, cost, cluster, inst = _instance()
    best = [inst.best_time(i) for i in range(len(inst.lengths))]
    stars = bounds._most_critical(inst, best, 3)
    n_calls = sum(len(inst.sizes) - inst.dmin[i] for i in stars)  # what an unbounded bound runs
    assert n_calls * SLOW_S > 1.0  # so the check below fails without the deadline
    _slow_star_in_size(monkeypatch)
    budget = 0.3
    t0 = time.perf_counter()
    plan = solver.solve(lengths, cost, cluster, solver.SolverConfig(time_budget_s=budget))
    took = time.perf_counter() - t0
    assert plan.num_sequences == len(lengths)
    assert took < budget + SLOW_S + 1.0, took
