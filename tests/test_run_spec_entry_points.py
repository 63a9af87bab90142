"""Every entry point gets the same run description for the same cluster and model.

Megatron's ``--hsp-*`` flags (``megatron/config.validate_hsp_args``), ``plan``/``bench``
(``commands/common.build_setup``) and ``demo`` (``DemoConfig.run_spec``) each build a
``RunSpec`` from their own flags; these tests give them the same cluster, cost model and choices
and compare what they derive: the slots, slots per node, the allowed group sizes (with the
``auto``/``pow2``/list grammar), the overlong policy, the solver and the time budget. The
expected values are written out by hand, not computed by ``run_spec``.
"""

from __future__ import annotations

import argparse

import pytest
import yaml

from megatron_hsp.commands import plan as plan_command
from megatron_hsp.commands.common import apply_harness_defaults, build_setup
from megatron_hsp.commands.demo_config import DEMO_COST_MODEL, DemoConfig
from megatron_hsp.megatron.config import validate_hsp_args
from megatron_hsp.megatron.refusals import HSPArgsError
from megatron_hsp.planner.cost.costmodel import load_cost_model
from megatron_hsp.planner.errors import InputError
from megatron_hsp.planner.run_spec import OverlongPolicy, Solver
from megatron_hsp.planner.search.settings import PlannerSettings
from tests.helpers.megatron_args import parse

MEGATRON_BASE = [
    "--hsp",
    "--attention-dropout",
    "0",
    "--global-batch-size",
    "16",
    "--num-attention-heads",
    "8",
]


def _cost_file(tmp_path, top: int) -> str:
    """The demo's CPU cost model, with all-to-all figures for every size up to ``top``, so that
    it prices every legal size of the clusters below."""
    spec = {**DEMO_COST_MODEL, "coefficients": dict(DEMO_COST_MODEL["coefficients"])}
    spec["coefficients"]["a2a_ms_per_token"] = {d: 0.01 * d for d in range(2, top + 1)}
    path = tmp_path / "cost.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def _megatron(argv: list[str], world: int, gpus_per_node: int):
    args = parse(MEGATRON_BASE + argv, world_size=world)
    config = validate_hsp_args(args, {"LOCAL_WORLD_SIZE": str(gpus_per_node)})
    assert config is not None
    return config


def _plan(argv: list[str]):
    parser = argparse.ArgumentParser()
    plan_command.add_arguments(parser)
    args = parser.parse_args(["--flexsp-harness", *argv, "--global-batch", "16"])
    apply_harness_defaults(args)  # what ``plan``'s main does before ``build_setup``
    return build_setup(args)


# (GPUs, GPUs per node, tp, pp, the size request, the allowed sizes written out)
CLUSTERS = [
    (16, 8, 1, 1, "auto", (1, 2, 3, 4, 5, 6, 7, 8, 16)),
    (16, 8, 1, 1, "pow2", (1, 2, 4, 8, 16)),
    (16, 8, 1, 1, "1,2,8", (1, 2, 8)),
    (32, 8, 2, 1, "auto", (1, 2, 3, 4, 8, 12, 16)),
    (32, 8, 2, 2, "pow2", (1, 2, 4, 8)),
    (24, 8, 1, 1, "pow2", (1, 2, 4, 8, 16)),  # 16 = two whole nodes, from slot 0
]


@pytest.mark.parametrize(("gpus", "gpn", "tp", "pp", "request_text", "allowed"), CLUSTERS)
def test_megatron_and_plan_derive_the_same_run(tmp_path, gpus, gpn, tp, pp, request_text, allowed):
    cost = _cost_file(tmp_path, gpus)
    megatron = _megatron(
        [
            "--hsp-cost-model",
            cost,
            "--seq-length",
            "4096",
            "--tensor-model-parallel-size",
            str(tp),
            "--pipeline-model-parallel-size",
            str(pp),
            "--hsp-group-sizes",
            request_text,
            "--hsp-overlong",
            "split",
            "--hsp-time-budget-s",
            "0.25",
            "--hsp-solver",
            "cbc",
        ],
        gpus,
        gpn,
    ).run
    plan_argv = ["--gpus", str(gpus), "--gpus-per-node", str(gpn), "--sizes", request_text]
    plan_argv += ["--overlong", "split", "--time-budget", "0.25", "--solver", "cbc"]
    plan_argv += ["--max-seq", "4096", "--cost-model", cost, "--sampling", "random"]
    if tp == pp == 1:
        plan_setup = _plan(plan_argv)
        plan = plan_setup.run
        # plan plans with the cost model's sizes where --sizes is auto (None): the same set.
        assert plan.allowed_sizes(plan_setup.cost.sizes) == allowed
    else:  # a fitted file knows no TP/PP: the run description alone, as plan builds it
        from megatron_hsp.commands.common import parallel_dims
        from megatron_hsp.planner.run_spec import GroupSizeRequest

        dims = parallel_dims(argparse.Namespace(gpus=gpus, gpus_per_node=gpn, tp=tp, pp=pp))
        plan = None
        assert GroupSizeRequest.parse(request_text, "--sizes").resolve(dims.cluster(), "x") == (
            allowed
        )
        assert (dims.slots, dims.slots_per_node) == (
            megatron.dims.slots,
            megatron.dims.slots_per_node,
        )
    slots = gpus // (tp * pp)
    assert (megatron.dims.slots, megatron.dims.slots_per_node) == (slots, min(gpn // tp, slots))
    assert megatron.planner.sizes == allowed
    assert megatron.overlong is OverlongPolicy.SPLIT
    assert megatron.planner.solver is Solver.CBC and megatron.planner.time_budget_s == 0.25
    if plan is not None:
        assert (plan.dims.slots, plan.dims.slots_per_node) == (slots, min(gpn, slots))
        assert plan.sizes == megatron.sizes
        assert plan.overlong is OverlongPolicy.SPLIT
        assert plan.planner.solver is Solver.CBC and plan.planner.time_budget_s == 0.25


def test_the_demo_derives_the_run_megatron_and_plan_derive(tmp_path):
    """The demo's four CPU ranks in one node, its cost model, overlong split and budget."""
    cost_path = tmp_path / "demo.yaml"
    cost_path.write_text(yaml.safe_dump(DEMO_COST_MODEL))
    cfg = DemoConfig(nproc=4, seed=3)
    demo = cfg.run_spec(load_cost_model(DEMO_COST_MODEL, world_size=4, gpus_per_node=4))
    budget = str(demo.planner.time_budget_s)
    megatron = _megatron(
        [
            "--hsp-cost-model",
            str(cost_path),
            "--seq-length",
            str(demo.max_seq),
            "--hsp-overlong",
            "split",
            "--hsp-time-budget-s",
            budget,
            "--hsp-seed",
            "3",
        ],
        4,
        4,
    )
    plan_setup = _plan(
        [
            "--gpus",
            "4",
            "--gpus-per-node",
            "4",
            "--cost-model",
            str(cost_path),
            "--max-seq",
            str(demo.max_seq),
            "--overlong",
            "split",
            "--time-budget",
            budget,
            "--seed",
            "3",
            "--sampling",
            "random",
        ]
    )
    plan = plan_setup.run
    assert demo.planner.sizes == (1, 2, 4)  # every size of 4 slots the demo model prices
    assert megatron.group_sizes == demo.planner.sizes
    assert plan.allowed_sizes(plan_setup.cost.sizes) == demo.planner.sizes
    for run in (demo, megatron.run, plan):
        assert (run.dims.slots, run.dims.slots_per_node) == (4, 4)
        assert run.overlong is OverlongPolicy.SPLIT and run.max_seq == demo.max_seq
        assert run.planner.time_budget_s == demo.planner.time_budget_s == 0.5
        assert run.planner.seed == 3


@pytest.mark.parametrize("budget", ["0", "-1", "1e9", "nan"])
def test_every_entry_point_refuses_the_same_time_budgets(budget):
    """One rule (> 0, at most an hour), each entry point naming its own flag."""
    with pytest.raises(HSPArgsError, match="--hsp-time-budget-s must be"):
        _megatron(["--seq-length", "4096", "--hsp-time-budget-s", budget], 8, 8)
    with pytest.raises(InputError, match="--time-budget must be"):
        _plan(["--gpus", "8", "--time-budget", budget])
    with pytest.raises(InputError, match="time budget must be"):
        PlannerSettings(time_budget_s=float(budget))


@pytest.mark.parametrize("text", ["12", "3,12"])
def test_every_entry_point_refuses_the_same_group_sizes(text):
    """16 GPUs in nodes of 8: 12 tiles nothing."""
    with pytest.raises(HSPArgsError, match=r"--hsp-group-sizes .*12.* legal sizes: 1,2,3,4"):
        _megatron(["--seq-length", "4096", "--hsp-group-sizes", text], 16, 8)
    with pytest.raises(InputError, match=r"--sizes .*12.* legal sizes: 1,2,3,4"):
        _plan(["--gpus", "16", "--sizes", text])


@pytest.mark.parametrize("text", ["0", "two", "1,,x"])
def test_every_entry_point_reads_one_size_grammar(text, capsys):
    """What is not ``auto``, ``pow2`` or a list of sizes >= 1 is refused as the flags are read
    (Megatron's parser: exit 2 naming the flag; plan: the same error)."""
    with pytest.raises(SystemExit):
        parse([*MEGATRON_BASE, "--hsp-group-sizes", text])
    megatron_error = capsys.readouterr().err
    with pytest.raises(InputError) as plan_error:
        _plan(["--gpus", "16", "--sizes", text])
    assert "--hsp-group-sizes" in megatron_error and str(plan_error.value).startswith("--sizes")
    why = str(plan_error.value).removeprefix("--sizes")
    assert why in megatron_error.replace("--hsp-group-sizes", "")


@pytest.mark.parametrize(
    ("gpus", "gpn", "tp", "pp"), [(24, 8, 1, 2), (16, 8, 3, 1), (16, 4, 8, 1), (20, 8, 1, 1)]
)
def test_every_entry_point_refuses_the_same_layouts(gpus, gpn, tp, pp):
    """Slots that do not fill whole nodes, TP not dividing the world or a node, TP across
    nodes: refused by Megatron's flags and by plan's alike."""
    flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    with pytest.raises(HSPArgsError):
        _megatron(["--seq-length", "4096", *flags], gpus, gpn)
    with pytest.raises(InputError):
        _plan(
            [
                "--gpus",
                str(gpus),
                "--gpus-per-node",
                str(gpn),
                "--tp",
                str(tp),
                "--pp",
                str(pp),
                "--cost-model",
                "llama3-8b-h100",
                "--max-seq",
                "4k",
            ]
        )


def _choices(parser: argparse.ArgumentParser, flag: str) -> tuple[str, ...]:
    (action,) = [a for a in parser._actions if flag in a.option_strings]
    return tuple(action.choices)


def test_the_closed_vocabularies_are_the_entry_points_choices():
    """One list of overlong policies and solvers: what each entry point's flags offer and what
    the samplers accept."""
    from megatron_hsp.commands import demo
    from megatron_hsp.megatron.flags import add_hsp_args
    from megatron_hsp.planner.lengths import BatchSampler
    from megatron_hsp.step.sampler import SamplerConfig
    from tests.helpers.megatron_args import megatron_like_parser

    megatron = add_hsp_args(megatron_like_parser())
    plan = argparse.ArgumentParser()
    plan_command.add_arguments(plan)
    demo_parser = argparse.ArgumentParser()
    demo.add_arguments(demo_parser)
    assert _choices(megatron, "--hsp-overlong") == _choices(plan, "--overlong")
    assert _choices(plan, "--overlong") == ("error", "drop", "split")
    assert _choices(megatron, "--hsp-solver") == _choices(demo_parser, "--solver")
    assert _choices(demo_parser, "--solver") == ("highs", "cbc", "greedy")
    assert _choices(plan, "--solver") == ("highs", "cbc")  # plan compares MILP backends
    for bad in ("truncate", "Split"):
        with pytest.raises(InputError, match="--hsp-overlong"):
            SamplerConfig(seed=0, max_length=8, token_budget=8, overlong=bad)
        with pytest.raises(InputError, match="--overlong"):
            BatchSampler([5, 6], global_batch=1, overlong=bad)
