"""``evaluation/torch_side/methods.py``: the one name -> plan function ``--hsp-plan-method``
trains with."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsp.evaluation.baselines import batchada_plan, static_best_degree, static_plan
from megatron_hsp.evaluation.torch_side.methods import (
    method_plan_fn,
    planner_for_spec,
    resolve_static_best,
)
from megatron_hsp.planner.cost.execution import price
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.run_spec import check_plan_method, static_degree
from megatron_hsp.planner.search.settings import PlannerSettings
from megatron_hsp.planner.topology import Cluster
from megatron_hsp.step.planner_service import PlannerSpec
from tests.helpers import FIXTURES

COST = str(FIXTURES / "cost-model-tiny.yaml")
BATCHES = [[200, 30, 30, 12, 7, 90], [60, 60, 60, 60, 5], [250, 8, 8, 8]]


def spec(method: str, **options) -> PlannerSpec:
    settings = PlannerSettings(solver="greedy", time_budget_s=1.0, sizes=(1, 2, 4))
    base = PlannerSpec(COST, 4, 4, 256, settings=settings)
    if method == "hsp":
        return base
    from megatron_hsp.step.pipeline import METHOD_PLANNER

    return PlannerSpec(
        COST,
        4,
        4,
        256,
        settings=settings,
        factory=METHOD_PLANNER,
        options={"method": method, **options},
    )


def test_grammar():
    for ok in ("hsp", "static-4", "static-best", "batchada", "megatron-dcp"):
        assert check_plan_method(ok) == ok
    for bad in ("static", "static-0", "flexsp", "lower-bound", ""):
        with pytest.raises(InputError, match="--hsp-plan-method"):
            check_plan_method(bad)
    assert static_degree("static-4") == 4 and static_degree("batchada") is None


@pytest.mark.parametrize("method", ["static-4", "batchada", "megatron-dcp", "hsp"])
def test_each_method_plans_every_batch_as_bench_does(method):
    """The training planner's plan is the baseline function's own, priced by the one price
    function (what ``bench`` does), for every batch."""
    s = spec(method)
    plan_fn = (
        planner_for_spec(s)
        if method != "hsp"
        else method_plan_fn("hsp", s.load_cost_model(), Cluster(4, 4), s.settings)
    )
    cost, cluster = s.load_cost_model(), Cluster(4, 4)
    for lengths in BATCHES:
        plan = plan_fn(lengths)
        assert not plan.problems(lengths=lengths, world_size=4)
        if method == "static-4":
            want = price(static_plan(np.asarray(lengths), cost, cluster, 4), cost)
            assert plan == want and plan.est_step_ms == want.est_step_ms
        if method == "batchada":
            want = price(batchada_plan(np.asarray(lengths), cost, cluster, (1, 2, 4)), cost)
            assert plan.est_step_ms == pytest.approx(want.est_step_ms)


def test_static_best_is_the_hindsight_degree_over_the_given_batches():
    cost, cluster = spec("hsp").load_cost_model(), Cluster(4, 4)
    method, line = resolve_static_best(BATCHES, cost, cluster, (1, 2, 4))
    degree, _ = static_best_degree(BATCHES, cost, cluster, (1, 2, 4))
    assert method == f"static-{degree}" and f"next {len(BATCHES)} batches" in line
    with pytest.raises(InputError, match="resolve it to static-N first"):
        method_plan_fn("static-best", cost, cluster, PlannerSettings())


def test_the_planner_resolves_static_best_once_over_the_lookahead(capsys):
    """The planner process chooses static-best's degree over the batches it was handed, prints
    it, and keeps it when a refit cost model rebuilds the planner."""
    s = spec("static-best", lookahead=BATCHES)
    degree, _ = static_best_degree(BATCHES, s.load_cost_model(), Cluster(4, 4), (1, 2, 4))
    plan = planner_for_spec(s)(BATCHES[0])
    assert plan.extra["method"] == f"static-{degree}"
    assert f"static-{degree} chosen over the run's next 3 batches" in capsys.readouterr().out
    planner_for_spec(s)(BATCHES[1])  # rebuilt: the choice is kept, not printed again
    assert capsys.readouterr().out == ""
