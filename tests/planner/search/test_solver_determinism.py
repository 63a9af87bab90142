"""Issue 30 item 4: the plan does not depend on machine load; a plan the wall-clock cap cut says so.

Machine speed is simulated deterministically, whatever the load of the machine running the
test: ``time.perf_counter`` is patched to a virtual clock that advances by a fixed step at every
read, so each wall-clock check of the search sees as much time gone as a machine that slow
would have spent (0: an infinitely fast one). HiGHS's own clock is not patched; its node limit
is what binds. Before the fix the default 1 s budget limited the search (the greedy count climb,
local search's share of the budget, the MILP's time slices): on the code-heavy-tail batches the
slow machine planned differently. Now work counts limit it and the budget is a safety cap.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.search.settings import SolverConfig
from megatron_hsp.planner.search.solver import solve
from megatron_hsp.planner.topology import Cluster

CLUSTER = Cluster(64, 8)


def _sft_long_mix(seed: int) -> list[int]:
    """benchmarks/suite.py's sft-long-mix shape: 70% chat turns, 30% 32k-192k documents."""
    rng = np.random.default_rng(seed)
    long = rng.random(512) < 0.3
    x = np.where(long, rng.uniform(32_000, 192_000, 512), rng.lognormal(7.0, 0.8, 512))
    return np.clip(x, 128, 192_000).astype(int).tolist()


def _code_heavy_tail(seed: int) -> list[int]:
    """benchmarks/suite.py's code-heavy-tail shape: Pareto tail, alpha 1.1, min 512."""
    rng = np.random.default_rng(seed)
    return np.clip(512 * (1 + rng.pareto(1.1, 512)), 128, 192_000).astype(int).tolist()


def _virtual_clock(monkeypatch: pytest.MonkeyPatch, step_s: float) -> None:
    """``time.perf_counter()`` from now on: ``step_s`` more at every read, from 0."""
    reads = itertools.count(1)
    monkeypatch.setattr(time, "perf_counter", lambda: step_s * next(reads))


def _identity(plan) -> tuple[str, float, str, int]:
    return plan.fingerprint(), round(plan.est_step_ms, 6), plan.status, len(plan.microbatches)


@pytest.mark.parametrize("model", ["flexsp-gpt-7b", "llama3-8b-zero1"])
@pytest.mark.parametrize("batch", [_sft_long_mix, _code_heavy_tail])
def test_same_plan_on_an_idle_and_a_slowed_machine(monkeypatch, model, batch):
    spec = (
        {"preset": "llama3-8b-h100", "training": {"zero_stage": 1}}
        if model == "llama3-8b-zero1"
        else model
    )
    cost = load_cost_model(spec, world_size=64, gpus_per_node=8)
    lengths = batch(0)
    _virtual_clock(monkeypatch, 0.0)  # an infinitely fast machine: no wall-clock check fires
    idle = solve(lengths, cost, CLUSTER)  # the default settings, what users get
    # 1.5 ms per read: 0.6-1.7 s by the end of these searches (389-1152 reads).
    _virtual_clock(monkeypatch, 1.5e-3)
    loaded = solve(lengths, cost, CLUSTER)
    assert _identity(loaded) == _identity(idle)
    # The counts, not the clock, ended both searches.
    assert idle.extra["cut_by_cap"] == loaded.extra["cut_by_cap"] == []


def test_a_plan_cut_by_the_cap_says_so(monkeypatch):
    cost = load_cost_model("flexsp-gpt-7b", world_size=64, gpus_per_node=8)
    lengths = _sft_long_mix(1)
    _virtual_clock(monkeypatch, 0.1)  # 100 ms gone at every check
    cut = solve(lengths, cost, CLUSTER, SolverConfig(time_budget_s=1.0))
    assert cut.extra["cut_by_cap"]  # the stages the cap stopped, by name
    stages = {"bound", "chunking", "greedy", "improve", "milp"}
    # The flexsp-style plan solve() also scores: skipped, or its own stages cut.
    stages |= {"flexsp-style", *(f"flexsp-style:{s}" for s in stages)}
    assert set(cut.extra["cut_by_cap"]) <= stages
    cut.validate(lengths, cost, CLUSTER.world_size)  # still a valid plan, just a weaker one
    assert cut.to_dict()["extra"]["cut_by_cap"] == cut.extra["cut_by_cap"]  # ``plan --json``


def test_bench_json_names_the_batches_the_cap_cut(monkeypatch):
    from megatron_hsp.evaluation.bench import run_bench
    from megatron_hsp.planner.lengths import GlobalBatch
    from megatron_hsp.planner.search.settings import PlannerSettings

    cost = load_cost_model("flexsp-gpt-7b", world_size=64, gpus_per_node=8)
    batch = GlobalBatch(0, np.asarray(_sft_long_mix(2)), np.arange(512))
    calm = run_bench([batch], cost, CLUSTER, ["hsp"])["methods"]["hsp"]
    assert "cut_by_cap" not in calm  # only batches the cap cut are reported
    _virtual_clock(monkeypatch, 0.1)
    cut = run_bench([batch], cost, CLUSTER, ["hsp"], hsp=PlannerSettings(time_budget_s=1.0))
    cut = cut["methods"]["hsp"]
    assert len(cut["cut_by_cap"]) == 1 and cut["cut_by_cap"][0]
    # every batch's fingerprint, for comparing runs on an idle and a loaded machine
    # (benchmarks/suite.py --fingerprints); the cut plan is a different one
    assert len(calm["fingerprints"]) == len(cut["fingerprints"]) == 1
    assert calm["fingerprints"] != cut["fingerprints"]
