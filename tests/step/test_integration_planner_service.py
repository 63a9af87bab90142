"""The background planner process: order, overlap with training, logged waits, errors."""

from __future__ import annotations

import logging
import time

import pytest

from megatron_hsp.planner.errors import HSPError, InfeasibleError
from megatron_hsp.planner.search.settings import PlannerSettings
from megatron_hsp.step.planner_service import PlannerService, PlannerSpec

pytestmark = pytest.mark.spawns


def spec(**options) -> PlannerSpec:
    return PlannerSpec(
        cost_model="unused",
        world_size=4,
        gpus_per_node=4,
        max_seq=100,
        factory="tests.helpers.planners:one_group_per_rank",
        options=options,
    )


def test_background_plans_in_order_and_validate():
    with PlannerService(spec()) as svc:
        batches = {t: [10 + t, 20, 30, 40, 50] for t in range(3)}
        for t, lengths in batches.items():
            svc.submit(t, lengths)
        for t, lengths in batches.items():
            res = svc.result(t)
            assert res.step == t
            res.plan.validate(lengths, world_size=4)
            assert res.plan.microbatches[0].groups[0].lengths == (lengths[0], lengths[4])


def test_solve_overlaps_training_and_late_planner_wait_is_logged(caplog):
    with PlannerService(spec(sleep_s=0.3)) as svc:
        svc.submit(0, [5, 6])
        svc.result(0)  # warm: the process is up and the first plan is done
        svc.submit(1, [5, 6])
        time.sleep(0.6)  # "step 0 trains" longer than the solve: no wait for step 1
        assert svc.result(1).wait_s < 0.1
        svc.submit(2, [5, 6])
        with caplog.at_level(logging.WARNING, logger="megatron_hsp.planner_service"):
            late = svc.result(2)  # immediately: the planner is late
        assert late.wait_s > 0.15 and late.solve_s >= 0.3
        assert "step 2 waited" in caplog.text


def test_planner_errors_reach_the_training_process():
    with PlannerService(spec()) as svc:
        svc.submit(0, [500])
        with pytest.raises(InfeasibleError, match="longer than 100"):
            svc.result(0)
        svc.submit(1, [50])  # the service keeps serving after a failed plan
        assert svc.result(1).plan.num_sequences == 1
        with pytest.raises(HSPError, match="no plan was submitted for step 7"):
            svc.result(7)


def test_broken_planner_factory_fails_at_first_result():
    svc = PlannerService(
        PlannerSpec("x", 4, 4, 100, factory="tests.helpers.planners:broken_factory")
    )
    try:
        svc.submit(0, [1])
        with pytest.raises(ValueError, match=r"nope\.yaml"):
            svc.result(0)
    finally:
        svc.close()


def test_synchronous_mode_reports_its_wait():
    svc = PlannerService(spec(sleep_s=0.05), background=False)
    svc.submit(0, [1, 2, 3])
    res = svc.result(0)
    assert res.wait_s >= 0.05 and res.plan.num_sequences == 3


def test_production_planner_in_the_background_process():
    """The real cost model + MILP solver, planned in the spawned process and validated here."""
    from megatron_hsp.planner.cost.costmodel import load_cost_model

    spec = PlannerSpec(
        cost_model="flexsp-gpt-7b",
        world_size=8,
        gpus_per_node=8,
        max_seq=192 * 1024,
        settings=PlannerSettings(time_budget_s=0.5),
    )
    lengths = [28_000, 16_000, 9_000, 6_000, 3_000, 2_000, 1_000, 500] * 2
    cost = load_cost_model("flexsp-gpt-7b", world_size=8, gpus_per_node=8, max_seq_k=192)
    with PlannerService(spec) as svc:
        svc.submit(0, lengths)
        res = svc.result(0)
    res.plan.validate(lengths, cost, 8)
    assert res.plan.solver == "highs" and res.plan.est_step_ms >= res.plan.lower_bound_ms > 0


def test_late_plan_is_logged_then_replaced_by_the_counted_fallback(caplog):
    """Issue 9: a planner that overruns its deadline no longer blocks training forever."""
    from tests.helpers.planners import one_group_per_rank

    slow = spec(sleep_s=1.5)
    svc = PlannerService(slow, plan_deadline_s=0.6, fallback=one_group_per_rank(spec()))
    svc.late_log_s = 0.2
    with svc, caplog.at_level(logging.WARNING, logger="megatron_hsp.planner_service"):
        svc.submit(0, [5, 6])
        svc.result(0)  # warm start (the first solve also sleeps 1.5 s; the deadline triggers)
        svc.submit(1, [7, 8, 9])
        t0 = time.perf_counter()
        res = svc.result(1)
        assert time.perf_counter() - t0 < 1.2
        res.plan.validate([7, 8, 9], world_size=4)
        assert svc.fallbacks == [0, 1]
        assert "plan late" in caplog.text and "trained with the fallback plan" in caplog.text
        svc.plan_deadline_s = None  # the discarded late plans do not answer later steps
        svc.submit(2, [1, 2])
        assert svc.result(2).plan.num_sequences == 2


def test_a_killed_planner_is_replaced_and_its_step_trains_on_the_fallback(caplog):
    """Issue 40 (was issue 18's one-line error): a dead planner is no reason to stop training;
    the step trains on the fallback plan, a fresh planner process serves the next steps."""
    import os
    import signal

    from tests.helpers.planners import one_group_per_rank

    svc = PlannerService(spec(), fallback=one_group_per_rank(spec()))
    try:
        svc.submit(0, [10, 20, 30, 40])
        svc.result(0)  # started
        dead = svc._proc.pid
        os.kill(dead, signal.SIGKILL)
        svc.submit(1, [10, 20, 30, 40])
        with caplog.at_level(logging.WARNING, logger="megatron_hsp.planner_service"):
            svc.result(1).plan.validate([10, 20, 30, 40], world_size=4)
        assert svc.fallbacks == [1] and svc.restarts == 1 and svc._proc.pid != dead
        assert "planner process died" in caplog.text and "restarted" in caplog.text
        svc.submit(2, [5, 6])
        assert svc.result(2).plan.num_sequences == 2 and svc.fallbacks == [1]
    finally:
        svc.close()
