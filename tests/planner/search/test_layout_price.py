"""``homogeneous.layout_step_ms`` prices a layout exactly as its plan is priced.

``solve`` prices every homogeneous layout without building its plan and builds only the
cheapest valid one; if the two prices differed in a single bit, a different baseline could be
taken than before (plans are compared to the bit, docs/results/solver.md).
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.errors import InfeasibleError
from megatron_hsp.planner.search.homogeneous import (
    homogeneous_layouts,
    layout_step_ms,
    plan_from_layout,
)
from megatron_hsp.planner.topology import Cluster


def _lengths(rng: np.random.Generator, n: int = 512) -> list[int]:
    long = rng.random(n) < 0.08
    x = np.where(long, rng.uniform(20_000, 150_000, n), rng.lognormal(7.0, 1.0, n))
    return np.clip(x, 64, 150_000).astype(int).tolist()


def _reference(lengths, cost, cluster, layout) -> float | None:
    try:
        return plan_from_layout(lengths, cost, cluster, layout, solver="x").est_step_ms
    except InfeasibleError:
        return None


@pytest.mark.parametrize("model", ["llama3-8b-h100", "flexsp-gpt-7b"])  # pass barriers: no, yes
def test_layout_price_is_the_plans_to_the_bit(model: str) -> None:
    cost = load_cost_model(model, world_size=64, max_seq_k=192)
    cluster = Cluster(64, 8)
    rng = np.random.default_rng(3)
    checked = 0
    for _ in range(3):
        lengths = _lengths(rng)
        layouts = list(homogeneous_layouts(lengths, cost, cluster).values())
        for _ in range(30):  # mixed sizes, empty groups, passes of different partitions
            ids = rng.permutation(len(lengths)).tolist()
            layout, pos = [], 0
            for _ in range(int(rng.integers(1, 6))):
                mb, left = [], 64
                while left > 0 and pos < len(ids):
                    d = int(rng.choice([x for x in (1, 2, 4, 8, 16, 32, 64) if x <= left]))
                    k = int(rng.integers(0, 4))
                    mb.append((d, ids[pos : pos + k]))
                    pos, left = pos + k, left - d
                layout.append(mb)
            layouts.append(layout)
        for layout in layouts:
            ref = _reference(lengths, cost, cluster, layout)
            got = layout_step_ms(lengths, cost, cluster, layout)
            assert (ref is None) == (got is None)
            if ref is not None:
                assert got is not None and got.hex() == ref.hex()
                checked += 1
    assert checked > 60


def test_layout_that_does_not_place_has_no_price() -> None:
    cost = load_cost_model("llama3-8b-h100", world_size=64, max_seq_k=192)
    cluster = Cluster(64, 8)
    layout = [[(32, [0]), (32, [1]), (32, [2])]]  # 96 ranks on 64
    assert layout_step_ms([1000, 2000, 3000], cost, cluster, layout) is None
