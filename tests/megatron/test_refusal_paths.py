"""One refusal path for every way in (issue 42): a data flag ``--hsp`` refuses is one line on
stderr naming the flag and what would work, exit 2, never a traceback, through the library
(``install(args, ...)``), the launcher (unchanged script), the patched script and torchrun's
ranks. Before issue 42 ``installer.install`` called ``hsp_data_from_args`` outside
``exit_on_refusal``: ``--eod-mask-loss --hsp``, ``--mock-data`` without ``--data-path`` and a
``--data-path`` prefix without its files ended in an ``HSPArgsError`` traceback on every rank
(exit 1), where ``--context-parallel-size 2 --hsp`` got one line and exit 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_hsp.megatron.refusals import launch_rank
from tests.helpers.megatron_args import parse

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "tests" / "fixtures" / "cost-model-tiny.yaml"

# (case, flags changed from a run that would start, what the one line must name). The library
# cases read a parser with Megatron's names and defaults (tests/helpers/megatron_args.py); the
# launcher and patched cases Megatron's own parse_and_validate_args.
DATA_REFUSALS = {
    "eod-mask-loss": (["--eod-mask-loss"], "--eod-mask-loss"),
    "mock-data": (["--mock-data", "--no-data-path"], "--mock-data"),
    "missing-prefix": ([], "has no"),
    "no-data-path": (["--no-data-path"], "give --data-path PREFIX"),
}


def _argv(case: str, base: list[str], corpus: str) -> list[str]:
    """``base`` with a real dataset, then the case's changes (``--no-data-path``: none)."""
    extra, _ = DATA_REFUSALS[case]
    prefix = f"{corpus}-missing" if case == "missing-prefix" else corpus
    argv = [prefix if a == "unused-prefix" else a for a in base]
    if "--no-data-path" in extra:
        at = argv.index("--data-path")
        argv = argv[:at] + argv[at + 2 :]
    return [*argv, *(a for a in extra if a != "--no-data-path")]


@pytest.fixture
def corpus(tmp_path: Path) -> str:
    import numpy as np

    from megatron_hsp.step.corpus import write_indexed_dataset

    write_indexed_dataset(tmp_path / "corpus", [np.arange(2, 9), np.arange(3, 40)])
    return str(tmp_path / "corpus")


LIBRARY_BASE = [
    *("--hsp", "--num-attention-heads", "4", "--global-batch-size", "8"),
    *("--seq-length", "64", "--micro-batch-size", "1", "--attention-dropout", "0"),
    *("--hsp-cost-model", str(TINY_MODEL), "--data-path", "unused-prefix"),
]


@pytest.mark.parametrize("case", sorted(DATA_REFUSALS))
def test_install_refuses_a_data_flag_in_one_line_and_exit_2(case, corpus, capsys, monkeypatch):
    """The library way in: ``install(args, provider, forward_step)`` after Megatron parsed."""
    from megatron_hsp.megatron import hooks
    from megatron_hsp.megatron.installer import install

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    args = parse(_argv(case, LIBRARY_BASE, corpus), world_size=8)
    with pytest.raises(SystemExit) as stop:
        install(args, None, None)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    named = DATA_REFUSALS[case][1]
    assert len(err) == 1 and err[0].startswith("megatron-hsp: error: ") and named in err[0], err
    assert hooks.active_run() is None  # nothing installed


def test_install_is_quiet_on_other_ranks(corpus, capsys, monkeypatch):
    """Every rank refuses alike (the flags are the same everywhere); only rank 0 prints."""
    from megatron_hsp.megatron.installer import install

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = parse(_argv("eod-mask-loss", LIBRARY_BASE, corpus), world_size=8)
    with pytest.raises(SystemExit) as stop:
        install(args, None, None)
    assert stop.value.code == 2
    assert capsys.readouterr().err == ""


def test_launch_rank_reads_torchrun_then_slurm():
    assert launch_rank({"RANK": "5", "SLURM_PROCID": "2"}) == 5
    assert launch_rank({"SLURM_PROCID": "2"}) == 2
    assert launch_rank({}) == 0
    assert launch_rank({"RANK": ""}) == 0


GIT = shutil.which("git")


def _script_entry(entry: str, tmp_path: Path) -> tuple[list[str], Path]:
    from tests.megatron.test_patches import checkout

    if entry == "launcher":
        root = checkout("main", tmp_path, patched=False)
        return ["-m", "megatron_hsp.launch", str(root / "pretrain_gpt.py")], root
    root = checkout("core_r0.19.0", tmp_path, patched=True)
    return [str(root / "pretrain_gpt.py")], root


@pytest.mark.spawns
@pytest.mark.slow
@pytest.mark.skipif(GIT is None, reason="git is not installed")
@pytest.mark.parametrize("entry", ["launcher", "patched"])
@pytest.mark.parametrize("case", ["eod-mask-loss", "mock-data", "missing-prefix"])
def test_data_refusals_are_one_line_through_megatrons_parser(entry, case, corpus, tmp_path):
    """Megatron's real ``parse_and_validate_args`` and ``install``: one stderr line naming the
    flag, exit 2, no traceback (before: ``HSPArgsError`` traceback, exit 1)."""
    from tests.megatron.test_patches import TINY, run_script

    argv, root = _script_entry(entry, tmp_path)
    run = run_script([*argv, *_argv(case, TINY, corpus), "--hsp"], tmp_path, root)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if "megatron-hsp: error:" in line]
    assert len(errors) == 1 and DATA_REFUSALS[case][1] in errors[0], run.stderr[-3000:]
    assert run.stderr.rstrip().endswith(errors[0])


@pytest.mark.spawns
@pytest.mark.slow
@pytest.mark.skipif(GIT is None, reason="git is not installed")
def test_under_torchrun_every_rank_refuses_and_the_user_sees_one_line(corpus, tmp_path):
    """Two ranks under torchrun: each exits 2 at argument time (before any collective, so
    nothing waits on a peer), rank 0 alone prints the line; torchrun then reports the ranks'
    exit code 2 in its own failure summary (torchrun's, not a rank's traceback)."""
    from tests.megatron.test_patches import TINY

    argv, root = _script_entry("launcher", tmp_path)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{root}")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_PROCID"):
        env.pop(name, None)
    run = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"),
            *("--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"),
            *argv,
            *_argv("eod-mask-loss", TINY, corpus),
            "--hsp",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    errors = [line for line in out.splitlines() if "megatron-hsp: error:" in line]
    assert len(errors) == 1 and "--eod-mask-loss" in errors[0], out[-3000:]
    assert "HSPArgsError" not in out and "megatron_hsp/" not in out, out[-3000:]
    assert out.count("exitcode  : 2") + out.count("exitcode: 2") >= 1, out[-3000:]


JOB = [
    *("--nnodes", "1", "--nproc-per-node", "8", "--num-layers", "2", "--hidden-size", "512"),
    *("--num-attention-heads", "8", "--seq-length", "4096", "--global-batch-size", "16"),
]


@pytest.mark.parametrize("command", ["bench", "plan"])
def test_plan_and_bench_refuse_a_missing_prefix_as_training_does(command, corpus, capsys):
    """``plan``/``bench`` read ``--data-path`` with the training run's own check
    (``datasets.hsp_data_from_args``): the same one line, exit 2. (``--mock-data`` and
    ``--eod-mask-loss`` are not read by them yet: issue 42 item 2.)"""
    from megatron_hsp import cli

    rc = cli.main([command, *JOB, "--data-path", f"{corpus}-missing"])
    err = [line for line in capsys.readouterr().err.splitlines() if "Warning" not in line]
    assert rc == 2
    errors = [line for line in err if "error:" in line]
    assert len(errors) == 1 and "--data-path" in errors[0] and "has no" in errors[0], err
    assert not any("Traceback" in line for line in err)
