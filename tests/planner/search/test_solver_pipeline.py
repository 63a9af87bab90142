"""The solver, bench and CLI under a pipeline (SolverConfig.pipeline, plan/bench --pp/--vpp)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from megatron_hsp.evaluation.bench import run_bench
from megatron_hsp.planner.cost.parallel import (
    ParallelConfig,
    load_parallel_cost_model,
    pipeline_spec_for,
)
from megatron_hsp.planner.cost.pipeline import PipelineSpec, simulate
from megatron_hsp.planner.errors import InfeasibleError, InputError
from megatron_hsp.planner.lengths import GlobalBatch
from megatron_hsp.planner.search.settings import PlannerSettings
from megatron_hsp.planner.search.solver import solve

BUDGET = 0.5


def _batch(n: int = 40, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.clip(rng.lognormal(8.5, 1.2, n), 128, 60000)]


def _gb(step: int, lengths: list[int]) -> GlobalBatch:
    return GlobalBatch(step, np.asarray(lengths), np.arange(len(lengths)))


def _setup(pp: int, vpp: int = 1):
    par = ParallelConfig(tp=1, pp=pp, vpp=vpp)
    return load_parallel_cost_model("llama3-8b-h100", par, gpus=16 * pp)


@pytest.mark.parametrize("pp,vpp", [(2, 1), (4, 1), (4, 2)])
def test_solver_prices_the_pipeline(pp, vpp):
    cost, plane = _setup(pp, vpp)
    lengths = _batch()
    plan = solve(lengths, cost, plane, PlannerSettings(time_budget_s=BUDGET, pp=pp, vpp=vpp)
                 .solver_config())  # fmt: skip
    plan.validate(lengths, cost, plane.world_size)
    spec = pipeline_spec_for(cost, pp, vpp)
    times = [mb.est_ms for mb in plan.microbatches]
    # est_step_ms is the pipelined step of the plan's own (bubble-ordered) micro-batch order.
    assert plan.est_step_ms == pytest.approx(simulate(times, spec))
    assert plan.est_step_ms > sum(times)
    info = plan.extra["pipeline"]
    assert info["sum_microbatch_ms"] == pytest.approx(sum(times))
    assert info["bubble_ms"] == pytest.approx(plan.est_step_ms - sum(times))
    assert len(plan.microbatches) % spec.microbatch_multiple == 0
    assert plan.lower_bound_ms <= plan.est_step_ms + 1e-6
    # Memory: every group fits the per-micro-batch cap, which already divides by the in-flight.
    for mb in plan.microbatches:
        for g in mb.groups:
            assert g.tokens <= cost.tokens_per_rank * g.size


def test_solver_refuses_a_model_not_built_for_the_pipeline():
    cost, plane = _setup(1)
    with pytest.raises(InputError, match="prices pp 1"):
        solve(_batch(), cost, plane, PlannerSettings(pp=2).solver_config())


def test_interleaving_needs_enough_sequences():
    cost, plane = _setup(4, 2)
    with pytest.raises(InfeasibleError, match="multiple of --pp 4"):
        solve([1000, 2000, 3000], cost, plane, PlannerSettings(pp=4, vpp=2).solver_config())


def test_bubble_order_beats_the_sum_order():
    # The pipeline order never loses against the plan's longest-first assembly order.
    cost, plane = _setup(4)
    lengths = _batch(60, seed=3)
    plan = solve(lengths, cost, plane, PlannerSettings(time_budget_s=BUDGET, pp=4).solver_config())
    spec = pipeline_spec_for(cost, 4)
    times = [mb.est_ms for mb in plan.microbatches]
    longest_first = sorted(times, reverse=True)
    assert plan.est_step_ms <= simulate(longest_first, spec) + 1e-9


def test_bench_prices_every_method_under_the_same_pipeline():
    cost, plane = _setup(4)
    spec = pipeline_spec_for(cost, 4)
    batches = [_gb(i, _batch(40, seed=i)) for i in range(2)]
    out = run_bench(
        batches,
        cost,
        plane,
        ["hsp", "static-4", "dp-balanced-2", "static-best", "lower-bound"],
        hsp=PlannerSettings(time_budget_s=BUDGET, pp=4),
        pipeline=spec,
        plans_sink={"static-4": (static := [])},
    )
    m = out["methods"]
    assert out["summary"]["all_plans_valid"]
    for p in static:  # as-given order, priced by the same recurrence
        assert p.extra["pipeline"]["order"] == "as-given"
        assert p.est_step_ms == pytest.approx(simulate([mb.est_ms for mb in p.microbatches], spec))
    assert sum(m["lower-bound"]["step_ms"]) <= sum(m["hsp"]["step_ms"]) + 1e-6
    with pytest.raises(InputError, match="hsp plans for pp 1"):
        run_bench(batches, cost, plane, ["static-4"], pipeline=spec)


def test_bench_interleaved_refuses_baseline_counts_megatron_refuses():
    cost, plane = _setup(4, 2)
    spec = pipeline_spec_for(cost, 4, 2)
    batches = [_gb(0, [500] * 5)]
    out = run_bench(
        batches, cost, plane, ["static-8"], hsp=PlannerSettings(pp=4, vpp=2), pipeline=spec
    )
    # Five short sequences pack into one static-8 micro-batch: megatron-core's interleaved
    # schedule (microbatch_group_size_per_vp_stage = pp) would refuse one micro-batch.
    res = out["methods"]["static-8"]
    assert res["infeasible_batches"] == 1
    assert "multiple of --pp 4" in res["infeasible_reason"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_hsp.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.spawns
def test_cli_plan_with_pipeline_and_refusal():
    r = _cli(
        "plan", "--flexsp-harness", "--cost-model", "llama3-70b-h100", "--gpus", "256", "--tp",
        "8", "--pp", "4", "--max-seq", "128k", "--global-batch", "32", "--time-budget", "0.5",
        "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["world_size"] == 8 and plan["extra"]["pipeline"]["schedule"] == "1f1b"
    assert plan["est_step_ms"] > plan["extra"]["pipeline"]["sum_microbatch_ms"]
    r = _cli(
        "plan",
        "--flexsp-harness",
        "--cost-model",
        "flexsp-gpt-7b",
        "--pp",
        "2",
        "--global-batch",
        "16",
    )
    assert r.returncode == 2 and "cannot be split" in r.stderr
    r = _cli(
        "plan",
        "--flexsp-harness",
        "--cost-model",
        "llama3-8b-h100",
        "--vpp",
        "2",
        "--global-batch",
        "16",
    )
    assert r.returncode == 2 and "--vpp" in r.stderr


def test_spec_order_as_given_is_respected():
    cost, plane = _setup(2)
    cfg = dataclasses.replace(
        PlannerSettings(time_budget_s=BUDGET, pp=2).solver_config(),
        pipeline=PipelineSpec(2, order="as-given"),
    )
    plan = solve(_batch(), cost, plane, cfg)
    assert plan.extra["pipeline"]["order"] == "as-given"
    times = [mb.est_ms for mb in plan.microbatches]
    assert times == sorted(times, reverse=True)  # the assembly's longest-first order


@pytest.mark.spawns
@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--tp", "3"], "--tp 3"),
        (["--pp", "0"], "--pp"),
        (["--cost-model", "qwen3-30b-a3b-h100", "--ep", "3"], "--ep 3"),
        (["--cost-model", "llama3-8b-h100", "--gpus", "64", "--pp", "3"], "multiple of --tp"),
    ],
)
def test_cli_refuses_bad_parallel_flags(flags, needle):
    r = _cli(
        "plan", "--flexsp-harness", "--cost-model", "llama3-8b-h100", "--global-batch", "16", *flags
    )
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) <= 2


def test_megatron_dcp_priced_under_the_pipeline_in_its_own_order():
    from megatron_hsp.evaluation.torch_side.dcp_baseline import megatron_dcp_plan

    cost, plane = _setup(2)
    spec = pipeline_spec_for(cost, 2)
    got: list = []
    out = run_bench(
        [_gb(0, _batch(40, seed=5))],
        cost,
        plane,
        ["megatron-dcp"],
        hsp=PlannerSettings(pp=2),
        pipeline=spec,
        extra_methods={"megatron-dcp": lambda: lambda b: megatron_dcp_plan(b, cost, plane)},
        plans_sink={"megatron-dcp": got},
    )
    (plan,) = got
    raw = megatron_dcp_plan(_batch(40, seed=5), cost, plane)
    times = [mb.est_ms for mb in raw.microbatches]
    assert [mb.est_ms for mb in plan.microbatches] == times  # scheduler's order kept
    assert out["methods"]["megatron-dcp"]["step_ms"][0] == pytest.approx(simulate(times, spec))


def test_pipeline_balancing_never_worse_and_keeps_every_sequence():
    import math

    from megatron_hsp.planner.search import solver as solver_mod
    from megatron_hsp.planner.search.instance import Instance, check_lengths, resolve_sizes

    cost, plane = _setup(4)
    spec = pipeline_spec_for(cost, 4)
    lengths = check_lengths(_batch(60, seed=11), cost, resolve_sizes(cost, plane, None))
    inst = Instance.build(lengths, cost, plane, resolve_sizes(cost, plane, None))
    cfg = PlannerSettings(pp=4).solver_config()
    cand = solver_mod._greedy_candidates(inst, plane, cfg, math.inf, spec)[0][0]
    before = solver_mod._objective(cand.microbatches, spec)
    after_mbs = solver_mod._balance_for_pipeline(inst, plane, cand.microbatches, spec, math.inf, 60)
    assert solver_mod._objective(after_mbs, spec) <= before + 1e-9
    ids = sorted(i for _, groups in after_mbs for _, g in groups for i in g)
    assert ids == list(range(len(lengths)))
    assert len(after_mbs) == len(cand.microbatches)


def test_sequential_passes_are_pipeline_microbatches_each_paying_its_fixed_cost():
    """A Megatron CP group's sub-samples are passes; under a pipeline each pass is a pipeline
    micro-batch (a barrier), priced as the slowest group's pass with its fixed cost."""
    from megatron_hsp.evaluation.bench import price_baseline
    from megatron_hsp.planner.plan import Group, MicroBatch, Plan

    cost, _ = _setup(2)
    spec = pipeline_spec_for(cost, 2)
    assert spec.pp == 2 and cost.pass_barrier  # the stage model: every pass a barrier
    ring = (1, 8)  # Megatron CP: pure ring
    a0 = Group(tuple(range(8)), (0,), (4000,), 0.0, *ring)
    b0 = Group(tuple(range(8, 16)), (2,), (2000,), 0.0, *ring)
    a1 = Group(tuple(range(8)), (1,), (1000,), 0.0, *ring)
    b1 = Group(tuple(range(8, 16)), (), (), 0.0, *ring)
    plan = Plan(16, 8, (MicroBatch((a0, b0)), MicroBatch((a1, b1))))
    f = cost.fixed_ms(8, ring)

    def seq(n: int) -> float:
        return float(cost.seq_ms([n], 8, ring)[0]) + f

    passes = [max(seq(4000), seq(2000)), seq(1000)]
    priced = price_baseline(plan, cost, spec)
    assert priced.est_step_ms == pytest.approx(simulate(passes, spec))
