"""``SolverConfig.workers``: MILPs in a helper thread change no plan.

The ``flexsp-style`` search's MILP runs in the helper while hsp's search runs, and hsp's MILP
while the homogeneous layouts are scored (HiGHS, outside the GIL; ``search/concurrency.py``).
Plans must not depend on it, no thread may outlive the solve, and an error in the thread must
reach the caller, as must one raised while the helper still holds a MILP.
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


def test_both_milps_run_in_the_helper_and_an_error_beside_them_leaves_no_thread(
    monkeypatch,
) -> None:
    cost = load_cost_model("llama3-8b-h100", world_size=32, max_seq_k=128)
    cluster = Cluster(32, 8)
    lengths = _batch(1)
    threads: list[str] = []
    real = solver_mod.refine_microbatches

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(solver_mod, "refine_microbatches", recorded)
    before = threading.active_count()
    solve(lengths, cost, cluster, SolverConfig(time_budget_s=120.0, workers=2))
    # hsp's MILP stage and the flexsp-style search's, both in the helper.
    assert len(threads) == 2 and all(t.startswith("hsp-solve") for t in threads)
    threads.clear()
    solve(lengths, cost, cluster, SolverConfig(time_budget_s=120.0, workers=1))
    assert threads == [threading.main_thread().name] * 2

    greedy = solver_mod._greedy_candidates
    calls: list[int] = []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the first is the flexsp-style search's, the second hsp's
            raise RuntimeError("planted: hsp's search failed")
        return greedy(*args, **kwargs)

    # hsp's search fails after the flexsp-style search handed its MILP to the helper.
    monkeypatch.setattr(solver_mod, "_greedy_candidates", broken)
    threads.clear()
    with pytest.raises(RuntimeError, match="planted"):
        solve(lengths, cost, cluster, SolverConfig(time_budget_s=120.0, workers=2))
    assert calls == [1, 1]  # raised in hsp's search, the flexsp-style MILP with the helper
    assert threading.active_count() == before


@pytest.mark.parametrize("workers", [0, -1, 3])
def test_a_worker_count_other_than_one_or_two_is_refused(workers: int) -> None:
    from megatron_hsp.planner.errors import InputError

    cost = load_cost_model("llama3-8b-h100", world_size=32, max_seq_k=128)
    with pytest.raises(InputError, match=f"SolverConfig.workers={workers}: use 1"):
        solve(_batch(0, 32), cost, Cluster(32, 8), SolverConfig(workers=workers))
