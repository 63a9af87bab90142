"""``flexsp-style``: FlexSP's planner emulated on our solver, run through ``bench``.

The method must keep FlexSP's search space (power-of-two groups of >= 2 ranks, so every sequence
pays an all-to-all), give plans the validator accepts, and never beat the lower bound, which is
taken over every size hsp may use.
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hsp.evaluation.baselines import (
    FLEXSP_STYLE_CHUNKING,
    flexsp_style_config,
    flexsp_style_sizes,
)
from megatron_hsp.evaluation.bench import parse_methods, run_bench
from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.lengths import GlobalBatch
from megatron_hsp.planner.plan import Plan
from megatron_hsp.planner.search.settings import PlannerSettings
from megatron_hsp.planner.topology import Cluster

GPUS, PER_NODE = 16, 8


def _batches(cost, steps: int = 2) -> list[GlobalBatch]:
    """Mostly short sequences (hsp puts them on single ranks) plus a few needing 2-8 ranks."""
    rng = np.random.default_rng(7)
    out = []
    for step in range(steps):
        short = rng.integers(200, 3_000, size=40)
        long = rng.integers(cost.tokens_per_rank, 6 * cost.tokens_per_rank, size=3)
        lens = np.concatenate([short, long]).astype(np.int64)
        out.append(GlobalBatch(step, lens, np.arange(lens.size)))
    return out


def test_flexsp_style_runs_in_bench_with_flexsp_sizes_only() -> None:
    cost = load_cost_model("llama3-8b-h100", world_size=GPUS, gpus_per_node=PER_NODE)
    cluster = Cluster(GPUS, PER_NODE)
    batches = _batches(cost)
    plans: dict[str, list[Plan]] = {"hsp": [], "flexsp-style": []}
    out = run_bench(
        batches,
        cost,
        cluster,
        parse_methods("hsp,flexsp-style,lower-bound"),
        hsp=PlannerSettings(time_budget_s=0.5),
        plans_sink=plans,
    )
    flex = out["methods"]["flexsp-style"]
    assert flex["valid"] is True and flex["executable"] is True, flex.get("problems")
    assert len(plans["flexsp-style"]) == len(batches)
    for plan, b in zip(plans["flexsp-style"], batches, strict=True):
        plan.validate(b.lengths.tolist(), cost, GPUS)
        sizes = plan.group_sizes_used
        assert all(d >= 2 and d & (d - 1) == 0 for d in sizes), sizes
        assert plan.solver == "flexsp-style"
        assert plan.extra["chunking"].split("/")[0] == FLEXSP_STYLE_CHUNKING  # name/count
    # The batches are ones where hsp's wider space matters: it uses single ranks, so the size
    # check above would fail if the emulation were not restricted.
    assert any(1 in p.group_sizes_used for p in plans["hsp"])
    bound = out["methods"]["lower-bound"]["step_ms"]
    for ms, lb in zip(flex["step_ms"], bound, strict=True):
        assert ms >= lb * (1 - 1e-9)
    s = out["summary"]
    assert s["speedup_vs_flexsp_style"] == pytest.approx(
        s["total_step_wall_s"]["flexsp-style"] / s["total_step_wall_s"]["hsp"]
    )


def test_flexsp_style_config_is_flexsp_choices_on_hsp_settings() -> None:
    cost = load_cost_model("llama3-8b-h100", world_size=GPUS, gpus_per_node=PER_NODE)
    cluster = Cluster(GPUS, PER_NODE)
    base = PlannerSettings(solver="greedy", time_budget_s=0.7, seed=3).solver_config()
    cfg = flexsp_style_config(cost, cluster, base)
    assert cfg.sizes == (2, 4, 8, 16)
    assert cfg.chunkings == (FLEXSP_STYLE_CHUNKING,) and cfg.improve_evals == 0
    assert cfg.milp_min_gap == 0.0 and cfg.use_milp and cfg.pipeline is None
    assert (cfg.time_budget_s, cfg.seed) == (0.7, 3)  # what is not FlexSP's choice is kept
    assert flexsp_style_sizes(cost, cluster, [1, 4, 8]) == (4, 8)
    with pytest.raises(InputError, match="flexsp-style: no power-of-two group size"):
        flexsp_style_sizes(cost, cluster, [1])
