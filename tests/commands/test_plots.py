"""``plan --plot`` / ``bench --plot``: a real PNG is written; bad paths fail fast with exit 2."""

from __future__ import annotations

import pytest

from megatron_hsp.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path) -> bool:
    data = path.read_bytes()
    return data[:8] == PNG_MAGIC and b"IEND" in data[-16:] and len(data) > 5000


def test_plan_plot_writes_png(tmp_path):
    out = tmp_path / "plan.png"
    argv = [
        "plan",
        "--flexsp-harness",
        "--method",
        "batchada",
        "--gpus",
        "16",
        "--global-batch",
        "64",
    ]
    assert main([*argv, "--plot", str(out)]) == 0
    assert _is_png(out)


def test_bench_plot_writes_png(tmp_path):
    out = tmp_path / "bench.png"
    argv = ["bench", "--flexsp-harness", "--gpus", "16", "--global-batch", "64", "--steps", "2"]
    assert main([*argv, "--methods", "hsp,batchada,dp-balanced", "--plot", str(out)]) == 0
    assert _is_png(out)


@pytest.mark.parametrize("command", ["plan", "bench"])
@pytest.mark.parametrize(
    ("name", "message"),
    [("missing/x.png", "does not exist"), ("x.jpg", "ending in .png"), (".", "ending in .png")],
)
def test_bad_plot_paths_exit_2(tmp_path, capsys, command, name, message):
    path = tmp_path / name if name != "." else tmp_path
    argv = [command, "--flexsp-harness", "--gpus", "16", "--global-batch", "64"]
    argv += ["--plot", str(path)]
    if command == "bench":
        argv += ["--steps", "1", "--methods", "batchada"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--plot" in err and message in err
    assert not path.is_file()


@pytest.mark.spawns
def test_demo_plot_bad_path_fails_before_any_work(tmp_path, capsys):
    # Exits before the corpus is built or a rank starts: a bad path costs a second, not a run.
    assert main(["demo", "--cache-dir", str(tmp_path), "--plot", str(tmp_path / "x.jpg")]) == 2
    assert "--plot" in capsys.readouterr().err


def test_demo_plot_draws_loss_and_comparison(tmp_path):
    from megatron_hsp.commands.plots import plot_demo

    result = {
        "steps": [{"step": i, "loss": 5.0 - i} for i in range(4)],
        "config": {"nproc": 4},
        "comparison": {
            "static_degree": 4,
            "speedup_measured": 1.3,
            "batches": [
                {
                    "step": 3,
                    "adaptive": {"measured_s": 1.0, "predicted_ms": 900.0},
                    "static-4": {"measured_s": 1.3, "predicted_ms": 1200.0},
                }
            ],
        },
    }
    out = tmp_path / "demo.png"
    plot_demo(result, out)
    assert _is_png(out)
