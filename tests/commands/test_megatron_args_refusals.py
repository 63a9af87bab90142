"""``plan``/``bench`` refuse what the training run or Megatron's ``validate_args`` refuses, one
line naming the flag and what would work, exit 2; the three flags ``--hsp`` changes (CP,
micro-batch size, attention dropout) are the stock baseline's and said in a note, unless
``--hsp`` is typed (then they are the training run's, refused as the launcher refuses them;
issue 42, item 2). Megatron's checks are ``megatron/megatron_checks.py``, itself checked against
Megatron's ``validate_args`` in ``tests/megatron/test_megatron_checks.py``."""

from __future__ import annotations

import pytest

from megatron_hsp.cli import main

# The README's job, small enough to plan quickly on a CPU (no data flags: no torch import).
JOB = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8",
       "--seq-length", "32768", "--max-position-embeddings", "32768",
       "--position-embedding-type", "rope", "--attention-dropout", "0",
       "--nnodes", "4", "--nproc-per-node", "8", "--global-batch-size", "64",
       "--context-parallel-size", "4", "--hsp-time-budget-s", "0.3"]  # fmt: skip


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("command", ["bench", "plan"])
@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--mock-data"], "--hsp does not support --mock-data"),
        (["--eod-mask-loss"], "--hsp does not support --eod-mask-loss"),
        (["--max-position-embeddings", "8192"],
         "--max-position-embeddings 8192 is below --seq-length 32768 (Megatron's validate_args "
         "refuses it for your job as given); raise --max-position-embeddings to at least 32768"),
        (["--seq-length", "32766", "--max-position-embeddings", "32766"],
         "--seq-length 32766 is not a multiple of 2 x --context-parallel-size 4 = 8"),
        (["--global-batch-size", "63", "--micro-batch-size", "2"],
         "--global-batch-size 63 is not a multiple of --micro-batch-size 2 x 8 data-parallel "
         "ranks = 16 (Megatron's validate_args refuses it for your job as given)"),
        (["--global-batch-size", "48"],  # stock dp 8 takes it; under --hsp every GPU is a rank
         "--global-batch-size 48 is not a multiple of --micro-batch-size 1 x 32 data-parallel "
         "ranks = 32 (Megatron's validate_args refuses it for the same job under --hsp"),
        (["--world-size", "16"],
         "--world-size 16 disagrees with --nnodes 4 x --nproc-per-node 8 = 32 GPUs"),
    ],
)  # fmt: skip
def test_what_training_or_megatron_refuses_is_refused_in_one_line(
    command: str, flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = ["--steps", "1"] if command == "bench" else []
    rc, _, err = _run([command, *JOB, *steps, *flags], capsys)
    assert rc == 2 and err.count("\n") == 1 and needle in err, err


def test_bare_bench_says_what_bench_needs_not_what_hsp_needs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A user who typed no --hsp is told what bench needs (their job's flags)."""
    rc, _, err = _run(["bench"], capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert "bench needs your Megatron job's flags, --seq-length first" in err, err
    assert "--hsp needs" not in err, err


def test_stock_micro_batch_size_is_the_baselines_and_said(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--micro-batch-size 2 is the stock job's (its packed samples per rank); hsp's rows assume
    the --micro-batch-size 1 that training under --hsp needs, and the note says so."""
    rc, out, err = _run(["bench", *JOB, "--steps", "1", "--micro-batch-size", "2"], capsys)
    assert rc == 0, err
    assert (
        "note: --micro-batch-size 2: the static baseline's; training under --hsp needs "
        "--micro-batch-size 1"
    ) in err, err
    assert "planned gain: hsp" in out, out


def test_a_world_size_that_agrees_or_stands_alone_plans(
    capsys: pytest.CaptureFixture[str],
) -> None:
    alone = JOB[: JOB.index("--nnodes")] + JOB[JOB.index("--nproc-per-node") + 2 :]
    for argv in ([*JOB, "--world-size", "32"], [*alone, "--world-size", "32"]):
        rc, out, err = _run(["plan", *argv], capsys)
        assert rc == 0 and "est_ms" in out, err


@pytest.mark.parametrize("command", ["bench", "plan"])
@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--micro-batch-size", "2"], "so --micro-batch-size must be 1 (got 2)"),
        ([], "--hsp does not support --context-parallel-size 4"),  # JOB's CP 4
        (["--attention-dropout", "0.1"], "pass --attention-dropout 0"),
    ],
)  # fmt: skip
def test_flags_typed_with_hsp_are_the_training_runs_and_refused_as_it_refuses_them(
    command: str, flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """With --hsp typed the flags are the training run's own, so bench/plan refuse what the
    launcher refuses (without it CP, micro-batch size and dropout are the stock baseline's)."""
    job = JOB if "context-parallel" in needle else [*JOB, "--context-parallel-size", "1"]
    steps = ["--steps", "1"] if command == "bench" else []
    rc, _, err = _run([command, *job, *steps, "--hsp", *flags], capsys)
    assert rc == 2 and err.count("\n") == 1 and needle in err, err
