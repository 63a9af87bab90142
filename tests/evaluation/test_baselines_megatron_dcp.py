"""megatron-core's BalancedCPScheduler as a baseline: real scheduler, our cost and validator."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")

from megatron_hsp.evaluation.torch_side.dcp_baseline import megatron_dcp_plan
from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.errors import InfeasibleError, InputError
from megatron_hsp.planner.topology import Cluster


@pytest.mark.parametrize(("gpus", "model"), [(8, "flexsp-gpt-7b"), (64, "llama3-8b-h100")])
def test_dcp_plans_are_valid(gpus, model):
    cost = load_cost_model(model, world_size=gpus)
    cluster = Cluster(gpus, 8)
    rng = np.random.default_rng(1)
    lengths = np.concatenate(
        [rng.integers(100, 3000, size=60), [cost.tokens_per_rank * 3, cost.tokens_per_rank // 2]]
    )
    plan = megatron_dcp_plan(lengths, cost, cluster)
    plan.validate(lengths.tolist(), cost, gpus)
    assert plan.solver == "megatron-dcp"
    assert max(plan.group_sizes_used) >= 4  # the long sequence needs a CP group of 4


def test_dcp_errors():
    cost = load_cost_model("flexsp-gpt-7b", world_size=24)
    with pytest.raises(InputError, match="power of two"):
        megatron_dcp_plan([100], cost, Cluster(24, 8))
    cost8 = load_cost_model("flexsp-gpt-7b", world_size=8)
    with pytest.raises(InfeasibleError, match="needs a CP group of 16"):
        megatron_dcp_plan([cost8.tokens_per_rank * 9], cost8, Cluster(8, 8))


def test_dcp_sub_samples_are_passes_priced_per_pass():
    """Each scheduler group runs as one pass per sub-sample (main's sequential forward/backward):
    every pass must fit its group, and pays its fixed cost; under ZeRO-3 (FlexSP's preset) each
    pass is a barrier, so the step is the sum over passes of the slowest group's pass."""
    from megatron_hsp.evaluation.baselines import RingAssumptions

    cost = load_cost_model("flexsp-gpt-7b", world_size=8)
    assert cost.pass_barrier
    cluster = Cluster(8, 8)
    rng = np.random.default_rng(3)
    lengths = rng.integers(cost.tokens_per_rank // 3, cost.tokens_per_rank * 3, size=40)
    plan = megatron_dcp_plan(lengths, cost, cluster)
    assert len(plan.microbatches) > plan.extra["scheduler_microbatches"]
    assert all(len(g.seq_ids) <= 1 for mb in plan.microbatches for g in mb.groups)
    assert plan.extra["execution"] == "one-pass-per-sequence"
    plan.validate(lengths.tolist(), cost, 8)
    by_hand = sum(
        max(cost.group_ms(g.lengths, g.size, (1, g.size)) if g.lengths else 0.0 for g in mb.groups)
        for mb in plan.microbatches
    )
    assert plan.est_step_ms == pytest.approx(by_hand)
    # exposing ring communication can only make the baseline slower
    slower = megatron_dcp_plan(lengths, cost, cluster, RingAssumptions(overlap="exposed"))
    assert slower.est_step_ms > plan.est_step_ms
