"""Per-route attention coefficients (planner/routes.py, CostModel.attn_route_factor/ring_route):
each route priced by its own coefficient, the planner steering away from a slow ring route."""

from __future__ import annotations

import dataclasses
import random

import pytest

from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.routes import (
    RING_FUSED,
    RING_TILED,
    ULYSSES,
    attention_route,
    ring_routes,
)
from megatron_hsp.planner.search.settings import SolverConfig
from megatron_hsp.planner.search.solver import solve
from megatron_hsp.planner.topology import Cluster

WORLD = 64


def _cost(**changes):
    cost = load_cost_model("llama3-70b-h100", world_size=WORLD, max_seq_k=128)
    return dataclasses.replace(cost, **changes) if changes else cost


def _wiki_like(n: int, seed: int) -> list[int]:
    """Heavy-tailed lengths (as the solver tests draw them), a multiple of 2 x WORLD."""
    rng = random.Random(seed)
    step = 2 * WORLD
    return [
        ((min(int(rng.lognormvariate(6.0, 1.4)) + 1, 60_000) - 1) // step + 1) * step
        for _ in range(n)
    ]


def _ring_groups(plan):
    return [g for mb in plan.microbatches for g in mb.groups if g.seq_ids and g.ring > 1]


def _priced(plan, cost) -> float:
    """The plan's micro-batches priced by ``cost`` (each its slowest group), independently of
    the solver's own bookkeeping."""
    return sum(
        max(
            cost.group_ms(list(g.lengths), g.size, (g.ulysses, g.ring))
            for g in mb.groups
            if g.seq_ids
        )
        for mb in plan.microbatches
    )


def test_route_rule_follows_the_runtime_backend_rule():
    # No ring: Ulysses whatever the backend.
    assert attention_route(8, 1, te_version="2.14.0") == ULYSSES
    # TE carries a pure ring on every supported TE, a hybrid only from 2.19 on.
    assert attention_route(1, 3, te_version="2.14.0") == RING_FUSED
    assert attention_route(2, 3, te_version="2.14.0") == RING_TILED
    assert attention_route(2, 3, te_version="2.19.1") == RING_FUSED
    # The torch backend runs HSP's own ring: tiled unless its kernel is fused.
    assert attention_route(1, 3, te_version=None) == RING_TILED
    assert attention_route(1, 3, te_version=None, fused_ring=True) == RING_FUSED
    assert ring_routes({4: (4, 1), 6: (2, 3), 3: (1, 3)}, te_version="2.14.0") == {
        6: RING_TILED,
        3: RING_FUSED,
    }


def test_defaults_price_as_the_single_coefficient_and_tiled_is_slower():
    cost = _cost()
    lengths = [4096, 9000]
    for d in (3, 6, 8):  # pure ring, hybrid, pure Ulysses
        assert cost.route(d) == (ULYSSES if cost.split(d)[1] == 1 else RING_FUSED)
        assert cost.attn_coefficient(d) == cost.attn_ms_per_token2
    tiled = _cost(ring_route={0: RING_TILED})
    assert tiled.route(6) == RING_TILED and tiled.route(8) == ULYSSES
    # Attention by the tiled route's own coefficient (ring traffic hidden to isolate it).
    extra = tiled.group_ms(lengths, 6, ring="hidden") - cost.group_ms(lengths, 6, ring="hidden")
    attn = cost.attn_ms_per_token2 * sum(s * s for s in lengths) / 6
    assert extra == pytest.approx((tiled.route_factor(RING_TILED) - 1) * attn, rel=1e-9)
    assert tiled.route_factor(RING_TILED) > 1
    assert tiled.group_ms(lengths, 8) == cost.group_ms(lengths, 8)


def test_spec_round_trip_and_the_runtime_map_overrides_the_spec():
    cost = _cost(attn_route_factor={RING_TILED: 30.0}, ring_route={6: RING_TILED})
    back = load_cost_model(cost.to_spec(), world_size=WORLD)
    assert back == cost
    over = load_cost_model(
        cost.to_spec(), world_size=WORLD, ring_routes={6: RING_FUSED, 3: RING_TILED}
    )
    assert over.ring_route == {6: RING_FUSED, 3: RING_TILED}


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"attn_route_factor": {"ring-slow": 2.0}}, "unknown routes"),
        ({"attn_route_factor": {RING_TILED: 0}}, "must be > 0"),
        ({"ring_route": {6: "ulysses"}}, "ring or hybrid group's route"),
        ({"ring_route": {6: 3}}, "ring or hybrid group's route"),
    ],
)
def test_bad_route_entries_are_refused_by_name(change, pattern):
    spec = _cost().to_spec()
    spec["coefficients"].update(change)
    with pytest.raises(InputError, match=pattern):
        load_cost_model(spec, world_size=WORLD)


def test_a_ten_times_slower_ring_route_is_avoided_and_priced():
    lengths = _wiki_like(128, 1)
    config = SolverConfig(time_budget_s=30.0, milp_slice_s=5.0, seed=0)
    cluster = Cluster(WORLD, 8)
    # The search's own plans (``baselines=False``): on this batch the flexsp-style plan that
    # ``solve`` also scores, Ulysses groups only, is 0.2% cheaper and would be returned.
    fast = solve(lengths, _cost(), cluster, config, baselines=False)
    assert _ring_groups(fast), "precondition: the default model chooses ring groups here"
    slow_cost = _cost(attn_route_factor={RING_FUSED: 10.0})
    slow = solve(lengths, slow_cost, cluster, config, baselines=False)
    # Every sequence fits a Ulysses group of this cluster: no ring group is chosen any more.
    assert not _ring_groups(slow), [(g.size, g.ulysses, g.ring) for g in _ring_groups(slow)]
    # The plan is priced by the slow route's coefficient, and the old plan costs more under it.
    assert slow.est_step_ms == pytest.approx(_priced(slow, slow_cost), rel=1e-9)
    assert _priced(fast, slow_cost) > slow.est_step_ms
    assert _priced(fast, slow_cost) > _priced(fast, _cost())
