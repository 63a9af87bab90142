"""Megatron's dp_balanced packing scheduler: arrival-order packs, DP-multiple fix-up, ring cost."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsp.planner.baselines import (
    RingAssumptions,
    dp_balanced_layout,
    dp_balanced_plan,
    ring_group_ms,
)
from megatron_hsp.planner.costmodel import load_cost_model
from megatron_hsp.planner.errors import InfeasibleError, InputError
from megatron_hsp.planner.topology import Cluster


def test_packs_in_arrival_order_and_moves_to_dp_multiple():
    cost = load_cost_model("flexsp-gpt-7b", world_size=8)
    cap = cost.capacity(4)
    # arrival order: [0.6, 0.6] would fit one pack best-fit with [0.4, 0.4]; arrival order doesn't
    lens = [int(cap * f) for f in (0.6, 0.6, 0.4, 0.4, 0.1)]
    layout = dp_balanced_layout(lens, cost, 8, 4)
    packs = [ids for mb in layout for _, ids in mb]
    # packs: [0], [1,2], [3,4] -> 3 packs, DP 2 -> pop 4 into a 4th pack
    assert packs == [[0], [1, 2], [3], [4]]
    assert all(size == 4 for mb in layout for size, _ in mb)
    assert len(layout) == 2


def test_plan_valid_and_costed_as_ring():
    cost = load_cost_model("flexsp-gpt-7b", world_size=16)
    cluster = Cluster(16, 8)
    rng = np.random.default_rng(0)
    lens = rng.integers(500, cost.capacity(4) // 2, size=64)
    plan = dp_balanced_plan(lens, cost, cluster, 4)
    plan.validate(lens.tolist(), cost, 16)
    g = max((g for mb in plan.microbatches for g in mb.groups), key=lambda g: g.est_ms)
    assert g.est_ms == pytest.approx(ring_group_ms(g.lengths, 4, cost, RingAssumptions()))
    exposed = dp_balanced_plan(lens, cost, cluster, 4, RingAssumptions(exposed_comm=1.0))
    assert exposed.est_step_ms > plan.est_step_ms


def test_errors_name_the_flag():
    cost = load_cost_model("flexsp-gpt-7b", world_size=8)
    with pytest.raises(InputError, match="divide --gpus 8"):
        dp_balanced_plan([100], cost, Cluster(8, 8), 3)
    with pytest.raises(InfeasibleError, match="memory cap"):
        dp_balanced_plan([cost.capacity(2) + 1] + [5] * 7, cost, Cluster(8, 8), 2)
    with pytest.raises(InfeasibleError, match="cannot fill 4 data-parallel groups"):
        dp_balanced_plan([5, 5], cost, Cluster(8, 8), 2)
    with pytest.raises(InputError, match="exposed_comm"):
        RingAssumptions(exposed_comm=2.0)
