"""The MILP phase's work limit (issue 19 item 5: solve time at the default budget)."""

from __future__ import annotations

import numpy as np

from megatron_hsp.planner.cost.costmodel import flexsp_cost_model
from megatron_hsp.planner.search.settings import SolverConfig
from megatron_hsp.planner.search.solver import solve
from megatron_hsp.planner.topology import Cluster


def _bimodal(n: int = 512) -> list[int]:
    rng = np.random.default_rng(0)
    long = rng.random(n) < 0.1
    x = np.where(long, rng.uniform(96_000, 150_000, n), rng.lognormal(6.0, 0.5, n))
    return np.clip(x, 128, 150_000).astype(int).tolist()


def test_milp_phase_solves_at_most_the_configured_micro_batches():
    cost = flexsp_cost_model("flexsp-gpt-7b", world_size=64, max_seq_k=192)
    lengths = _bimodal()
    cluster = Cluster(64, 8)
    # A budget far above what the work limits need: the result must not depend on the load of
    # the machine (under a loaded CI runner a tight budget would cut the MILP phase instead).
    limited = solve(lengths, cost, cluster, SolverConfig(time_budget_s=120.0))
    assert SolverConfig().milp_max_microbatches == 1
    assert limited.extra["milp"]["solved"] <= 1
    free = solve(
        lengths, cost, cluster, SolverConfig(time_budget_s=120.0, milp_max_microbatches=10_000)
    )
    # The limit binds on this batch: without it more micro-batches get a MILP.
    assert free.extra["milp"]["solved"] > 1
    assert free.extra["milp"]["skipped_limit"] == 0
    assert limited.extra["milp"]["skipped_limit"] > 0
    assert limited.status != "optimal"  # left-out micro-batches are not proven
