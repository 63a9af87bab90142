"""The online refit separates the attention routes: a slowdown only ring groups have raises the
ring route's coefficient and leaves Ulysses groups' price alone (planner/cost/refit.py)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.cost.refit import GroupTiming, OnlineRefit, features
from megatron_hsp.step.observe import REFIT_HALF_LIFE_STEPS, REFIT_MAX_STEP, REFIT_MIN_RECORDS

WORLD = 16
RING_SLOWDOWN = 3.0


def _base():
    # ZeRO-3 (a per-pass fixed cost of the size the routes' features were designed around), as
    # tests/planner/cost/test_refit.py; the ZeRO-1 preset's separation is in docs/costmodel.md.
    spec = {"preset": "llama3-8b-h100", "training": {"zero_stage": 3}}
    return load_cost_model(spec, world_size=WORLD, max_seq_k=128)


def _step_records(base, rng, n=16):
    """One step's group records: ring groups (sizes 3 and 6 split with a ring) measured
    ``RING_SLOWDOWN`` x the model's time, Ulysses groups (1, 2, 4, 8) exactly the model's, 2%
    timing noise. Ring groups hold long sequences, as the planner gives them."""
    out = []
    cap = base.tokens_per_rank
    for _ in range(n):
        d = int(rng.choice([1, 2, 4, 8, 3, 6]))
        ring = base.split(d)[1] > 1
        if ring:
            lengths = [int(rng.uniform(0.5, 1.0) * cap * d)]
        else:
            k = int(rng.integers(1, 4))
            lengths = [int(x) for x in rng.integers(1024, cap * d // k, size=k)]
        ms = base.group_ms(lengths, d) * (RING_SLOWDOWN if ring else 1.0)
        out.append(GroupTiming(lengths, d, ms * (1 + 0.02 * rng.standard_normal()), base.split(d)))
    return out


def test_ring_slowdown_raises_the_ring_route_only():
    base = _base()
    assert base.route(3) == base.route(6) == "ring-fused" and base.route(8) == "ulysses"
    rng = np.random.default_rng(0)
    # The observer's own settings (step/observe.py): what a training run refits with.
    refit = OnlineRefit(
        base,
        max_step=REFIT_MAX_STEP,
        min_records=REFIT_MIN_RECORDS,
        half_life=REFIT_HALF_LIFE_STEPS,
        window=256,
    )
    for _ in range(12):
        assert refit.update(_step_records(base, rng)).accepted
    model = refit.model
    held_out = _step_records(base, np.random.default_rng(1), n=64)
    ratio = {True: [], False: []}
    for g in held_out:
        ratio[base.split(g.d)[1] > 1].append(
            model.group_ms(g.lengths, g.d) / base.group_ms(g.lengths, g.d)
        )
    # Ring groups: priced near their measured 3x; Ulysses groups: priced as before (5%).
    assert np.median(ratio[True]) == pytest.approx(RING_SLOWDOWN, rel=0.15), ratio[True]
    assert max(abs(r - 1.0) for r in ratio[False]) < 0.05, ratio[False]
    # The ring route's attention coefficient took the slowdown, the Ulysses one did not.
    assert model.attn_coefficient(6) > 3 * base.attn_coefficient(6)
    # (Ulysses groups' attention is a small share of their time, so its own factor is loosely
    # identified; it must not follow the ring's.)
    assert model.attn_coefficient(8) < 1.25 * base.attn_coefficient(8)


def test_a_record_is_fitted_under_the_route_the_runtime_reported():
    base = _base()
    g = GroupTiming([30000], 3, 100.0, base.split(3))
    fused = features(base, g)
    tiled = features(base, GroupTiming([30000], 3, 100.0, base.split(3), route="ring-tiled"))
    assert fused[4] > 0 and fused[5] == 0 and fused[0] == 0
    assert tiled[4] == 0 and tiled[5] == pytest.approx(base.route_factor("ring-tiled") * fused[4])
