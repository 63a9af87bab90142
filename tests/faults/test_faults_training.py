"""Class 5: training never stalls on the planner. A plan later than its deadline, or a dead
planner, is replaced by the fallback plan (logged) and the planner is restarted; the ranks wait
for the plan in a bounded tensor exchange; a Megatron loop with its planner stopped mid-run
finishes on fallback plans, equal per parameter to the stock path."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from megatron_hsp.runtime.lifetime import alive
from megatron_hsp.step.planner_service import PlannerService, PlannerSpec
from tests.faults.conftest import bounded

pytestmark = pytest.mark.spawns


def _spec(**options: object) -> PlannerSpec:
    return PlannerSpec(
        cost_model="unused",
        world_size=4,
        gpus_per_node=4,
        max_seq=100,
        factory="tests.helpers.planners:one_group_per_rank",
        options=options,
    )


def test_a_stopped_planner_is_replaced_by_the_fallback_and_restarted(caplog):
    from tests.helpers.planners import one_group_per_rank

    svc = PlannerService(_spec(), plan_deadline_s=1.0, fallback=one_group_per_rank(_spec()))
    try:
        with bounded(120):
            svc.submit(0, [10, 20, 30, 40])
            svc.result(0)  # started
            stopped = svc._proc.pid
            os.kill(stopped, signal.SIGSTOP)
            svc.submit(1, [10, 20, 30, 40])
            t0 = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="megatron_hsp.planner_service"):
                res = svc.result(1)
            assert time.monotonic() - t0 < 1.0 + 5.0
            res.plan.validate([10, 20, 30, 40], world_size=4)
            assert svc.fallbacks == [1] and svc.restarts == 1
            assert "trained with the fallback plan" in caplog.text and "restarted" in caplog.text
            assert not alive(stopped)  # the stopped planner was continued and ended
            svc.plan_deadline_s = None  # the restarted planner answers the next step
            svc.submit(2, [5, 6])
            assert svc.result(2).plan.num_sequences == 2 and svc.fallbacks == [1]
    finally:
        fresh = svc._proc.pid if svc._proc is not None else None
        svc.close()
    assert fresh is None or not alive(fresh)


def test_close_ends_a_stopped_planner():
    svc = PlannerService(_spec())
    svc.submit(0, [1, 2])
    svc.result(0)
    pid = svc._proc.pid
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with bounded(60):
        svc.close()
    assert time.monotonic() - t0 < 20 and not alive(pid)


def silent_planning_rank(rank: int, world_size: int) -> str:
    """Rank 0 never sends its plan; rank 1 must give up within the exchange's bound."""
    from megatron_hsp.runtime.agreement import PlanningFailedError, agree_on_plan

    if rank == 0:
        time.sleep(15)
        return "silent"
    t0 = time.monotonic()
    try:
        agree_on_plan(None, mode="broadcast", timeout_s=3.0)
    except PlanningFailedError as exc:
        return f"{time.monotonic() - t0:.1f} {exc}"
    return "received a plan"


@pytest.mark.dist
def test_the_plan_exchange_waits_a_bounded_time():
    """Before: an object broadcast, bounded only by the distributed timeout (10 min)."""
    from megatron_hsp.testing.dist import raise_rank_errors, run_distributed

    with bounded(300):
        out = raise_rank_errors(run_distributed(silent_planning_rank, 2, timeout_s=60))
    took, message = out[1].split(" ", 1)
    assert float(took) < 3.0 + 5.0, out[1]
    assert "within 3 s" in message and "\n" not in message


def _silent_peer(rank: int, world_size: int, what: str) -> str:
    """Rank 0 never joins; rank 1's plan check (``mode="verify"``) or the refit's gather of
    timings must give up within its bound."""
    import torch

    from megatron_hsp.runtime.agreement import (
        PlanningFailedError,
        agree_on_plan,
        bounded_all_gather,
    )

    if rank == 0:
        time.sleep(15)
        return "silent"
    t0 = time.monotonic()
    try:
        if what == "verify":
            agree_on_plan(None, mode="verify", timeout_s=3.0)
        else:
            row = torch.zeros(4, dtype=torch.float64)
            out = [torch.empty_like(row) for _ in range(world_size)]
            bounded_all_gather(out, row, timeout_s=3.0, what="the refit's timings")
    except PlanningFailedError as exc:
        return f"{time.monotonic() - t0:.1f} {exc}"
    return f"{what} completed"


def silent_peer_at_the_plan_check(rank: int, world_size: int) -> str:
    return _silent_peer(rank, world_size, "verify")


def silent_peer_at_the_refit_gather(rank: int, world_size: int) -> str:
    return _silent_peer(rank, world_size, "gather")


@pytest.mark.dist
@pytest.mark.parametrize(
    ("worker", "what"),
    [
        (silent_peer_at_the_plan_check, "the plan check"),
        (silent_peer_at_the_refit_gather, "the refit's timings"),
    ],
)
def test_the_plan_check_and_the_refit_gather_wait_a_bounded_time(worker, what):
    """Before: an object all-gather (verify) and a plain tensor all-gather (the refit's timings,
    hooks.refit_step), bounded only by the distributed timeout (10 min)."""
    from megatron_hsp.testing.dist import raise_rank_errors, run_distributed

    with bounded(300):
        out = raise_rank_errors(run_distributed(worker, 2, timeout_s=60))
    took, message = out[1].split(" ", 1)
    assert float(took) < 3.0 + 5.0, out[1]
    assert f"{what} did not complete within 3 s" in message and "\n" not in message, out[1]


@pytest.mark.dist
def test_a_megatron_loop_with_its_planner_stopped_mid_run_equals_the_stock_path():
    """Megatron's own train_step on 4 gloo ranks, background planner, stopped after step 1:
    the late step trains on the fallback plan within --hsp-plan-timeout-s, the planner is
    restarted, and loss, gradients and weights equal the stock path per parameter."""
    from megatron_hsp.testing.megatron_loop import run_megatron_loop
    from megatron_hsp.testing.megatron_loop.faults import FAULT_PLAN_TIMEOUT_S
    from megatron_hsp.testing.megatron_loop.options import DEFAULT_OPTIONS

    with bounded(900):
        (entry,) = run_megatron_loop(
            4, DEFAULT_OPTIONS[:1], steps=5, timeout_s=600, plant="planner-stopped-after-step-1"
        )
    faults = entry["faults"]
    assert entry["ok"], entry["failures"]
    assert faults["fallbacks"] and faults["restarts"] >= 1, faults
    assert faults["max_wait_s"] < FAULT_PLAN_TIMEOUT_S + 10, faults


def test_the_plan_timeout_flag_is_bounded_by_the_distributed_timeout():
    """--hsp-plan-timeout-s: its default and any value must leave the exchange's margin under
    Megatron's --distributed-timeout-minutes, so a late planner never meets the watchdog."""
    from megatron_hsp.megatron.config import validate_hsp_args
    from megatron_hsp.megatron.refusals import HSPArgsError
    from megatron_hsp.planner.search.settings import DEFAULT_PLAN_TIMEOUT_S, PLAN_EXCHANGE_MARGIN_S
    from tests.helpers.megatron_args import parse
    from tests.megatron.test_integration_args import BASE

    cfg = validate_hsp_args(parse([*BASE, "--hsp"]), env={})
    assert cfg.plan_timeout_s == DEFAULT_PLAN_TIMEOUT_S
    assert DEFAULT_PLAN_TIMEOUT_S + PLAN_EXCHANGE_MARGIN_S < 10 * 60  # Megatron's default
    assert validate_hsp_args(parse([*BASE, "--hsp", "--hsp-plan-timeout-s", "5"]), env={})
    for bad, minutes in (("0", 10), ("-1", 10), ("nan", 10), ("600", 10), ("100", 2)):
        args = parse([*BASE, "--hsp", "--hsp-plan-timeout-s", bad])
        args.distributed_timeout_minutes = minutes
        with pytest.raises(HSPArgsError, match="--hsp-plan-timeout-s"):
            validate_hsp_args(args, env={})
