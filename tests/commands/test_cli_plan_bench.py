"""``megatron-hsp plan`` / ``bench``: contracts of docs/design.md sec. 3, errors, and no torch."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from megatron_hsp.cli import main
from megatron_hsp.planner.plan import Plan
from tests.helpers import ROOT

HAS_SOLVER = importlib.util.find_spec("megatron_hsp.planner.search.solver") is not None
HAS_BOUNDS = importlib.util.find_spec("megatron_hsp.planner.search.bounds") is not None
SUMMARY_KEYS = {
    "speedup_vs_static_best",
    "speedup_vs_batchada",
    "speedup_vs_megatron_dcp",
    "gap_to_lower_bound",
    "solve_ms_p50",
    "solve_ms_p99",
    "all_plans_valid",
}


@pytest.mark.spawns
def test_planner_and_commands_do_not_import_torch():
    code = (
        "import sys\n"
        "import megatron_hsp.planner, megatron_hsp.planner.cost.costmodel\n"
        "import megatron_hsp.planner.lengths\n"
        "import megatron_hsp.evaluation.baselines, megatron_hsp.evaluation.bench\n"
        "import megatron_hsp.commands.plan, megatron_hsp.commands.bench, megatron_hsp.cli\n"
        "from megatron_hsp.cli import build_parser\n"
        "build_parser(['plan']); build_parser(['bench'])\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'))\n"
        "assert not bad, bad\n"
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)


def test_plan_static_json_is_a_valid_plan(capsys):
    assert (
        main(["plan", "--flexsp-harness", "--method", "static-64", "--json", "--batch-index", "2"])
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    for key in (
        "world_size",
        "gpus_per_node",
        "cost_model",
        "est_step_ms",
        "lower_bound_ms",
        "solve_ms",
        "solver",
        "status",
        "microbatches",
    ):
        assert key in d
    group = d["microbatches"][0]["groups"][0]
    keys = {"size", "ranks", "comm", "seq_ids", "lengths", "est_ms", "ulysses", "ring"}
    assert set(group) == keys
    assert group["ulysses"] * group["ring"] == group["size"]
    plan = Plan.from_dict(d)
    assert plan.world_size == 64 and plan.cost_model == "flexsp-gpt-7b"
    assert plan.num_sequences == 512


def test_plan_table_by_default(capsys):
    assert (
        main(
            [
                "plan",
                "--flexsp-harness",
                "--method",
                "batchada",
                "--gpus",
                "16",
                "--global-batch",
                "64",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "estimated step" in out and "groups (size x count)" in out


def test_bench_json_contract(tmp_path, capsys):
    out = tmp_path / "b.json"
    argv = [
        "bench",
        "--flexsp-harness",
        "--steps",
        "2",
        "--methods",
        "static-64,static-32,static-best,batchada",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert set(result) == {"config", "methods", "summary"}
    assert result["config"]["steps"] == 2 and result["config"]["cost_model"] == "flexsp-gpt-7b"
    assert set(result["summary"]) >= SUMMARY_KEYS
    assert result["summary"]["all_plans_valid"] is True
    assert result["summary"]["planner_peak_rss_mb"] > 0
    for name in ("static-64", "static-32", "static-best", "batchada"):
        assert len(result["methods"][name]["step_ms"]) == 2
        assert len(result["methods"][name]["solve_ms"]) == 2
    ms = result["methods"]
    assert sum(ms["batchada"]["step_ms"]) <= sum(ms["static-best"]["step_ms"]) + 1e-6
    assert "static-best" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--flexsp-harness", "--lengths", "/nonexistent/x.txt"], "no such file"),
        (["plan", "--flexsp-harness", "--gpus", "12"], "not a multiple of --gpus-per-node"),
        (["plan", "--flexsp-harness", "--cost-model", "gpt-9000"], "neither a preset"),
        (["plan", "--flexsp-harness", "--max-seq", "huge"], "--max-seq"),
        (["plan", "--flexsp-harness", "--sizes", "12"], "cannot tile"),
        (["plan", "--flexsp-harness", "--batch-index", "100000"], "full batches"),
        (
            [
                "plan",
                "--flexsp-harness",
                "--method",
                "static-64",
                "--max-seq",
                "8k",
                "--overlong",
                "error",
                "--sampling",
                "random",
                "--memory-cap-gb",
                "2.5",
            ],
            "longest trainable length",
        ),
        (["plan", "--flexsp-harness", "--method", "static-3"], "must divide --gpus"),
        (["plan", "--flexsp-harness", "--method", "static-best"], "use `megatron-hsp bench`"),
        (["bench", "--flexsp-harness", "--methods", "magic"], "--methods"),
        (["bench", "--flexsp-harness", "--steps", "0", "--methods", "batchada"], "--steps"),
    ],
)
def test_errors_exit_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_lengths_file_names_line(tmp_path, capsys):
    f = tmp_path / "l.txt"
    f.write_text("100\nx\n")
    assert main(["plan", "--flexsp-harness", "--lengths", str(f)]) == 2
    assert "l.txt:2" in capsys.readouterr().err


@pytest.mark.skipif(
    not HAS_SOLVER, reason="megatron_hsp.planner.search.solver not merged in this build"
)
def test_plan_hsp_json(capsys):
    assert (
        main(["plan", "--flexsp-harness", "--json", "--global-batch", "128", "--gpus", "16"]) == 0
    )
    plan = Plan.from_dict(json.loads(capsys.readouterr().out))
    assert plan.num_sequences == 128 and plan.lower_bound_ms > 0


@pytest.mark.skipif(
    not (HAS_SOLVER and HAS_BOUNDS), reason="solver/bounds not merged in this build"
)
def test_bench_hsp_summary(tmp_path):
    out = tmp_path / "b.json"
    argv = [
        "bench",
        "--flexsp-harness",
        "--steps",
        "2",
        "--gpus",
        "16",
        "--global-batch",
        "128",
        "--methods",
        "hsp,static-best,batchada",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    s = json.loads(out.read_text())["summary"]
    assert s["speedup_vs_static_best"] > 0 and s["gap_to_lower_bound"] >= 0
    assert s["solve_ms_p50"] is not None and s["all_plans_valid"] is True


def test_bench_reports_infeasible_static_degree(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(["300"] * 15 + ["20000"]) + "\n")
    out = tmp_path / "b.json"
    argv = [
        "bench",
        "--flexsp-harness",
        "--lengths",
        str(lengths),
        "--gpus",
        "8",
        "--global-batch",
        "8",
        "--steps",
        "2",
        "--methods",
        "static-1,static-8,static-best",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["methods"]["static-1"]["infeasible_batches"] == 1
    assert r["methods"]["static-1"]["step_ms"][1] is None
    assert "static-1" not in r["summary"]["total_step_s"]
    assert r["methods"]["static-best"]["degree"] != 1
    assert "infeasible on 1 of 2 batches" in capsys.readouterr().out


def test_bench_text_output_says_what_memory_dropped():
    """Issue 18: only the JSON showed sequences dropped as too long for memory."""
    from megatron_hsp.commands.bench import format_bench

    result = {
        "config": {
            "cost_model": "x",
            "gpus": 8,
            "gpus_per_node": 8,
            "max_seq": 1000,
            "global_batch": 4,
            "sampling": "random",
            "start_step": 0,
            "steps": 1,
        },
        "summary": {
            "total_step_s": {},
            "all_plans_valid": True,
            "planner_peak_rss_mb": 1.0,
            "batches": {
                "sequences": [3],
                "overlong_dropped": 1,
                "overlong_split": 0,
                "tokens_per_rank": 512,
            },
        },
        "methods": {},
    }
    text = format_bench(result)
    assert "overlong: 1 of 4 sequences dropped, 0 split" in text
    result["summary"]["batches"]["overlong_dropped"] = 0
    assert "overlong" not in format_bench(result)
