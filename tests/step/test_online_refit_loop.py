"""The online refit in the training loop: the observer's refitter turns measured group times into
an accepted model written for the next run, and the planner process switches to it."""

from __future__ import annotations

import pytest

from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.cost.refit import scaled_model
from megatron_hsp.planner.search.settings import PlannerSettings
from megatron_hsp.step.observe import REFIT_MAX_STEP, StepRefitter
from megatron_hsp.step.planner_service import PlannerService, PlannerSpec
from megatron_hsp.testing.manual_plan import manual_plan

SPEC = {
    "name": "loop-test",
    "coefficients": {
        "attn_ms_per_token2": 2.0e-6,
        "linear_ms_per_token": 0.02,
        "group_fixed_ms": 20.0,
        "a2a_ms_per_token": {2: 0.01, 4: 0.012},
        "tokens_per_rank": 65536,
    },
}


def test_refitter_learns_a_slower_machine_and_writes_a_loadable_model(tmp_path):
    base = load_cost_model(SPEC, world_size=4, gpus_per_node=4)
    truth = scaled_model(base, {"attn": 1.5, "linear": 1.5, "comm": 1.5, "fixed": 1.5})
    out = tmp_path / "refit.yaml"
    refitter = StepRefitter(base, out=str(out))
    layouts = [
        [[(2, [0, 1]), (1, [2]), (1, [3, 4])]],
        [[(4, [0, 1, 2])], [(2, [3]), (2, [4])]],
        [[(1, [0]), (1, [1]), (1, [2]), (1, [3, 4])]],
    ]
    results = []
    for step in range(9):
        lengths = [900 + 300 * ((step * 7 + i * 5) % 11) for i in range(5)]
        plan = manual_plan(4, lengths, layouts[step % 3])
        # Each slot's time of each micro-batch is its group's time on the "truth" machine.
        per_slot = [
            [
                truth.group_ms(list(mb.group_of(s).lengths), mb.group_of(s).size) / 1e3
                for mb in plan.microbatches
            ]
            for s in range(4)
        ]
        step_s = sum(max(t[m] for t in per_slot) for m in range(len(plan.microbatches)))
        results.append(refitter.record(step, plan, per_slot, step_s))
    assert results[0] is None  # the first step (first-touch, group creation) is skipped
    accepted = [r for r in results[1:] if r is not None and r.accepted]
    assert accepted, [r.reason for r in results[1:] if r is not None]
    assert refitter.model.linear_ms_per_token > base.linear_ms_per_token
    # Bounded: each accepted update moves a factor by at most REFIT_MAX_STEP.
    bound = (1 + REFIT_MAX_STEP) ** len(accepted)
    assert refitter.model.linear_ms_per_token <= base.linear_ms_per_token * bound
    reloaded = load_cost_model(str(out), world_size=4, gpus_per_node=4)
    assert reloaded.linear_ms_per_token == pytest.approx(refitter.model.linear_ms_per_token)
    assert [u["step"] for u in refitter.updates] == list(range(1, 9))


@pytest.mark.spawns
@pytest.mark.parametrize("background", [False, True])
def test_planner_switches_to_a_new_cost_model_for_later_requests(background):
    doubled = {
        **SPEC,
        "name": "doubled",
        "coefficients": {
            k: ({d: 2 * x for d, x in v.items()} if isinstance(v, dict) else 2 * v)
            if k != "tokens_per_rank"
            else v
            for k, v in SPEC["coefficients"].items()
        },
    }
    spec = PlannerSpec(SPEC, 4, 4, 8192, settings=PlannerSettings("greedy", 0.5, (1, 2, 4)))
    lengths = [3000, 1200, 800, 500, 300]
    with PlannerService(spec, background=background) as svc:
        svc.submit(0, lengths)
        first = svc.result(0).plan
        svc.use_cost_model(doubled)
        svc.submit(1, lengths)
        second = svc.result(1).plan
    assert first.cost_model == "loop-test" and second.cost_model == "doubled"
    assert second.est_step_ms == pytest.approx(2 * first.est_step_ms, rel=1e-6)


def test_a_wait_for_a_late_partner_belongs_to_the_previous_microbatch():
    """Micro-batch 0: a group of 2 (slots 0, 1) takes 300 ms, slots 2 and 3 alone take 100 ms.
    Micro-batch 1: one group of 4 that computes for 200 ms; slots 2 and 3 entered it 200 ms
    early and waited in its first collective, so their clocks read 400 ms. The group's time is
    its members' shortest (200 ms: the member that arrived last waited for no one); the slowest
    member's (400 ms) would charge micro-batch 1 for micro-batch 0's imbalance."""
    from megatron_hsp.step.observe import group_timings

    plan = manual_plan(4, [600, 300, 300, 900], [[(2, [0]), (1, [1]), (1, [2])], [(4, [3])]])
    per_slot = [[0.3, 0.2], [0.3, 0.2], [0.1, 0.4], [0.1, 0.4]]
    got = [(m, t.d, round(t.measured_ms, 6)) for m, t in group_timings(plan, per_slot)]
    assert got == [(0, 2, 300.0), (0, 1, 100.0), (0, 1, 100.0), (1, 4, 200.0)]


def test_a_step_is_predicted_by_the_model_refit_after_the_step_before():
    """Step 2's plan was made (prefetched) under the first model; after step 1 the refitter
    learned a 1.5x slower machine. The record of step 2 prices its plan with that newest model
    (``predicted_ms``) and keeps the plan's own estimate (``planned_ms``)."""
    from megatron_hsp.planner.search.settings import SolverConfig
    from megatron_hsp.planner.search.solver import solve
    from megatron_hsp.planner.topology import Cluster
    from megatron_hsp.step.observe import StepRecord, plan_ms, predicted_step_ms

    base = load_cost_model(SPEC, world_size=4, gpus_per_node=4)
    truth = scaled_model(base, dict.fromkeys(("attn", "linear", "comm", "fixed"), 1.5))
    # Step 2's plan, made by the planner under the first model while step 1 trained.
    plan2 = solve([3000, 1200, 800, 500, 300], base, Cluster(4, 4), SolverConfig(use_milp=False))
    # The planner prices its plan as plan_ms does: the same rule, the same model.
    assert plan_ms(plan2, base) == pytest.approx(plan2.est_step_ms, rel=1e-9)
    # Step 1 runs on the slower machine and the refitter learns from it.
    lengths = [2500, 1800, 1100, 700, 2000, 1500]
    plan1 = manual_plan(
        4, lengths, [[(1, [0]), (1, [1]), (1, [2]), (1, [3])], [(2, [4]), (2, [5])]]
    )
    per_slot = [
        [
            truth.group_ms(list(mb.group_of(s).lengths), mb.group_of(s).size) / 1e3
            for mb in plan1.microbatches
        ]
        for s in range(4)
    ]
    step_s = sum(max(t[m] for t in per_slot) for m in range(len(plan1.microbatches)))
    refitter = StepRefitter(base, skip_steps=0)
    assert refitter.record(1, plan1, per_slot, step_s).accepted
    newest = refitter.model
    rec = StepRecord.from_plan(2, plan2, step_overhead_ms=base.step_overhead_ms, model=newest)
    assert rec.planned_ms == pytest.approx(plan2.est_step_ms + base.step_overhead_ms)
    assert rec.predicted_ms == pytest.approx(predicted_step_ms(plan2, newest))
    measured = plan_ms(plan2, truth)  # step 2 on the slower machine
    assert abs(rec.predicted_ms - measured) < abs(rec.planned_ms - measured) / 2
    # Without a newer model (refit off) the prediction is the plan's own estimate.
    fixed = StepRecord.from_plan(2, plan2, step_overhead_ms=base.step_overhead_ms)
    assert fixed.predicted_ms == fixed.planned_ms


def test_the_logging_rank_rebuilds_the_refit_model_from_its_state():
    """The Megatron hooks send rank 0's refit model to the logging rank as
    ``StepRefitter.model_state`` numbers; rebuilt on the starting model it prices every plan as
    the refitter's own model does (per-step cost included)."""
    from megatron_hsp.step.observe import model_from_state, predicted_step_ms

    base = load_cost_model(SPEC, world_size=4, gpus_per_node=4)
    truth = scaled_model(base, {"attn": 1.3, "linear": 1.6, "comm": 0.8, "fixed": 1.2})
    refitter = StepRefitter(base, skip_steps=0)
    lengths = [2500, 1800, 1100, 700, 2000, 1500, 3000]
    layout = [[(1, [0]), (1, [1]), (1, [2]), (1, [3])], [(2, [4]), (2, [5])], [(4, [6])]]
    plan = manual_plan(4, lengths, layout)
    for step in range(3):
        per_slot = [
            [
                truth.group_ms(list(mb.group_of(s).lengths), mb.group_of(s).size) / 1e3
                for mb in plan.microbatches
            ]
            for s in range(4)
        ]
        step_s = 0.05 + sum(max(t[m] for t in per_slot) for m in range(3))
        assert refitter.record(step, plan, per_slot, step_s).accepted
    assert refitter.model.step_overhead_ms > 0
    rebuilt = model_from_state(base, refitter.model_state())
    assert predicted_step_ms(plan, rebuilt) == pytest.approx(
        predicted_step_ms(plan, refitter.model), rel=1e-12
    )
    assert predicted_step_ms(plan, rebuilt) != pytest.approx(predicted_step_ms(plan, base))
