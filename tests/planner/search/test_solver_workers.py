"""``SolverConfig.workers``: the MILP stage in a thread beside the baselines changes no plan.

The solve's MILP (HiGHS, outside the GIL) runs in a thread while the baselines are scored
(``search/concurrency.py``). Plans must not depend on it, no thread may outlive the solve, and
an error in the thread must reach the caller.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.search import solver as solver_mod
from megatron_hsp.planner.search.settings import SolverConfig
from megatron_hsp.planner.search.solver import solve
from megatron_hsp.planner.topology import Cluster


def _batch(seed: int, n: int = 256) -> list[int]:
    rng = np.random.default_rng(seed)
    long = rng.random(n) < 0.1
    x = np.where(long, rng.uniform(20_000, 120_000, n), rng.lognormal(7.5, 1.0, n))
    return np.clip(x, 64, 120_000).astype(int).tolist()


@pytest.mark.parametrize("model", ["llama3-8b-h100", "flexsp-gpt-7b"])
def test_same_plan_with_one_or_two_workers(model: str) -> None:
    cost = load_cost_model(model, world_size=32, max_seq_k=128)
    cluster = Cluster(32, 8)
    solved = 0
    for seed in range(3):
        lengths = _batch(seed)
        plans = [
            solve(lengths, cost, cluster, SolverConfig(time_budget_s=120.0, workers=w))
            for w in (1, 2)
        ]
        one, two = plans
        assert one.fingerprint() == two.fingerprint()
        assert one.est_step_ms.hex() == two.est_step_ms.hex()
        assert one.status == two.status and one.extra["milp"] == two.extra["milp"]
        assert not one.extra["cut_by_cap"] and not two.extra["cut_by_cap"]
        solved += two.extra["milp"]["solved"]
    assert solved > 0  # the MILP ran in the thread on some batch


def test_no_thread_outlives_the_solve_and_errors_reach_the_caller(monkeypatch) -> None:
    cost = load_cost_model("llama3-8b-h100", world_size=32, max_seq_k=128)
    cluster = Cluster(32, 8)
    lengths = _batch(0)
    before = threading.active_count()
    solve(lengths, cost, cluster, SolverConfig(time_budget_s=120.0, workers=2))
    assert threading.active_count() == before

    def broken(*args, **kwargs):
        raise RuntimeError("planted: the MILP stage failed")

    monkeypatch.setattr(solver_mod, "refine_microbatches", broken)
    with pytest.raises(RuntimeError, match="planted"):
        solve(lengths, cost, cluster, SolverConfig(time_budget_s=120.0, workers=2))
    assert threading.active_count() == before
