"""Every plan the planner and its baselines emit runs on the runtime, for many models and batches.

"Runs" is ``groupspace.problems`` with the model's heads (legal block, Ulysses degree dividing the
query heads, ring degree the runtime supports) plus: each group records the split the runtime
pre-creates sub-groups for (``HeadSpace.split``). A model with heads the sizes do not divide
(gpt-7b's 32 heads on 64 ranks, 52 heads, odd head counts) is where this used to fail.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hsp.evaluation.baselines import batchada_plan, homogeneous_sizes, static_plan
from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.groupspace import Cluster, HeadSpace, problems
from megatron_hsp.planner.search.settings import SolverConfig
from megatron_hsp.planner.search.solver import solve


def _check(plan, heads: HeadSpace) -> None:
    assert problems(plan, heads) == [], problems(plan, heads)[:3]
    for mb in plan.microbatches:
        for g in mb.groups:
            assert (g.ulysses, g.ring) == heads.split(g.size), (g.size, g.ulysses, g.ring)


def _model(heads: int, kv: int, nodes: int):
    spec = {
        "name": f"m{heads}",
        "model": {
            "name": f"m{heads}",
            "layers": 4,
            "hidden": heads * 64,
            "heads": heads,
            "kv_heads": kv,
            "ffn_hidden": 1024,
            "vocab": 1000,
        },
        "hardware": {"name": "h", "peak_tflops": 100.0, "hbm_gb": 1.0},
        "training": {"zero_stage": 3},
    }
    return load_cost_model(spec, world_size=8 * nodes, gpus_per_node=8)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.sampled_from([(32, 8), (52, 52), (6, 2), (7, 7), (12, 4), (40, 40), (3, 1)]),
    nodes=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 10_000),
)
def test_planner_and_baselines_emit_executable_plans(shape, nodes, seed) -> None:
    heads, kv = shape
    cost = _model(heads, kv, nodes)
    cluster = Cluster(8 * nodes, 8)
    space = cost.head_space()
    assert space == HeadSpace(heads, kv)
    rng = np.random.default_rng(seed)
    cap = cost.max_trainable_length()
    lengths = [int(x) for x in rng.integers(1, max(2, cap), size=int(rng.integers(1, 24)))]
    _check(solve(lengths, cost, cluster, SolverConfig(time_budget_s=0.3, use_milp=False)), space)
    _check(batchada_plan(lengths, cost, cluster), space)
    for d in homogeneous_sizes(cost, cluster):
        if cost.capacity(d) >= max(lengths):
            _check(static_plan(lengths, cost, cluster, d), space)


def test_flexsp_presets_at_384k_on_64_gpus_are_executable() -> None:
    """The rows the issue names: 32 and 52 heads on 64 ranks need Ulysses x ring groups."""
    cluster = Cluster(64, 8)
    for name in ("flexsp-gpt-7b", "flexsp-gpt-30b"):
        cost = load_cost_model(name, world_size=64, gpus_per_node=8, max_seq_k=384)
        rng = np.random.default_rng(1)
        lengths = [int(x) for x in rng.integers(1000, 380_000, size=6)]
        plan = solve(lengths, cost, cluster, SolverConfig(time_budget_s=0.5, use_milp=False))
        space = cost.head_space()
        _check(plan, space)
        assert any(g.ring > 1 for mb in plan.microbatches for g in mb.groups)


def test_every_baseline_plan_in_bench_is_executable() -> None:
    """``bench`` with a model that has heads: every method's plans run (Megatron CP as (1, d))."""
    from megatron_hsp.evaluation.bench import run_bench
    from megatron_hsp.evaluation.torch_side.dcp_baseline import megatron_dcp_plan
    from megatron_hsp.planner.lengths import GlobalBatch
    from megatron_hsp.planner.search.settings import PlannerSettings

    cost = load_cost_model("flexsp-gpt-7b", world_size=64, gpus_per_node=8, max_seq_k=384)
    cluster = Cluster(64, 8)
    rng = np.random.default_rng(2)
    batches = []
    for step in range(2):
        lens = np.concatenate([rng.integers(500, 20_000, size=60), [300_000, 120_000]])
        batches.append(GlobalBatch(step, lens.astype(np.int64), np.arange(lens.size)))
    methods = [
        "hsp", "static-best", "static-64", "batchada", "flexsp-style", "dp-balanced",
        "dp-balanced-64", "megatron-dcp",
    ]  # fmt: skip
    out = run_bench(
        batches,
        cost,
        cluster,
        methods,
        hsp=PlannerSettings(time_budget_s=0.3),
        extra_methods={"megatron-dcp": lambda: lambda b: megatron_dcp_plan(b, cost, cluster)},
    )
    assert set(out["methods"]) == set(methods)
    for name, m in out["methods"].items():
        assert m.get("executable") is True, (name, m.get("problems"))
    assert out["summary"]["all_plans_executable"] is True
