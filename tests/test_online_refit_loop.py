"""The online refit in the training loop: the observer's refitter turns measured group times into
an accepted model written for the next run, and the planner process switches to it."""

from __future__ import annotations

import pytest

from megatron_hsp.planner.costmodel import load_cost_model
from megatron_hsp.planner.refit import scaled_model
from megatron_hsp.planner.settings import PlannerSettings
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
