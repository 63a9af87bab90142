"""``plan``/``bench`` with a Megatron job's own flags: the flag table is Megatron's, the data is
the job's indexed blend and split, the gain is against the job's static CP, bad input is one
line naming the flag (issue 32, items 5 and 6)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from megatron_hsp.cli import build_parser, main

# A small model (first principles) that a CPU plans quickly; Megatron spellings throughout.
MODEL = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8",
         "--seq-length", "1024", "--max-position-embeddings", "1024", "--attention-dropout", "0",
         "--nnodes", "1", "--nproc-per-node", "8", "--hsp-time-budget-s", "0.3",
         "--hsp-overlong", "drop"]  # fmt: skip


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's errors (a bad value) exit from inside the parser
        rc = int(exc.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.spawns  # megatron-core's import runs ldconfig
def test_flag_table_is_megatrons_own() -> None:
    """The shipped list is what megatron-core's parser defines: names, values, types, defaults.
    A megatron-core upgrade that changes a flag fails here (regenerate with
    ``python -m megatron_hsp.commands.megatron_args --regenerate``)."""
    arguments = pytest.importorskip("megatron.training.arguments")
    from megatron_hsp.commands.megatron_args import (
        MEGATRON_FLAGS_FILE,
        PLANNER_FLAGS,
        flag_rows,
        megatron_flags,
    )

    parser = argparse.ArgumentParser(allow_abbrev=False)
    arguments.add_megatron_arguments(parser)
    shipped = Path(__file__).resolve().parents[2] / "megatron_hsp" / "data" / MEGATRON_FLAGS_FILE
    lines = [x for x in shipped.read_text().splitlines() if x and not x.startswith("#")]
    assert lines == flag_rows(parser)
    megatron = {a.dest: a for a in parser._actions}
    ours = {f.dest: f for f in megatron_flags()}
    for dest in PLANNER_FLAGS:  # the planner's flags: Megatron's defaults, parsed as Megatron
        assert ours[dest].default == megatron[dest].default, dest
        assert set(ours[dest].options) == set(megatron[dest].option_strings), dest


def _dataset(prefix: Path, lengths: list[int]) -> str:
    from megatron_hsp.step.corpus import write_indexed_dataset

    rng = np.random.default_rng(0)
    write_indexed_dataset(prefix, [rng.integers(0, 100, size=n) for n in lengths])
    return str(prefix)


@pytest.mark.spawns  # megatron-core's import runs ldconfig
def test_bench_plans_the_job_on_its_indexed_blend_and_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Batches come from the training split of the blend (``--split 50,50,0``: the second half
    of each dataset, lengths 101 and 301, is validation and never drawn), by token shares
    (0.25 / 0.75, within one document), whole documents up to the stock step's tokens
    (--global-batch-size 8 x --seq-length 1024) each; the cost model is the model's
    first-principles one; the report compares hsp with the job's static CP 2 as stock Megatron
    runs it, at equal tokens, then with the per-document static rows."""
    pytest.importorskip("megatron.core")
    a = _dataset(tmp_path / "a", [100] * 20 + [101] * 20)
    b = _dataset(tmp_path / "b", [300] * 20 + [301] * 20)
    job = [*MODEL, "--data-path", "0.25", a, "0.75", b, "--split", "50,50,0",
           "--global-batch-size", "8", "--context-parallel-size", "2", "--lr", "3e-4",
           "--tokenizer-type", "GPT2BPETokenizer", "--use-mcore-models", "--steps",
           "4"]  # fmt: skip
    from megatron_hsp.commands.bench import run_from_args

    argv = ["bench", *job]
    lengths: list[np.ndarray] = []
    result = run_from_args(build_parser(argv).parse_args(argv), None, lengths)
    drawn = np.concatenate(lengths)
    assert all(8192 - 300 < x.sum() <= 8192 for x in lengths), [x.sum() for x in lengths]
    assert set(drawn.tolist()) <= {100, 300}, sorted(set(drawn.tolist()))
    share = drawn[drawn == 300].sum() / drawn.sum()
    assert abs(drawn[drawn == 300].sum() - 0.75 * drawn.sum()) <= 300, share
    assert result["job"]["cost_model"].startswith("megatron-2x256-")
    assert {"hsp", "megatron-static-cp2", "static-2", "static-best"} <= set(result["methods"])
    assert result["summary"]["comparison"]["megatron-static-cp2"] == "equal tokens"

    rc, out, _ = _run(argv, capsys)
    assert rc == 0
    gain = [line for line in out.splitlines() if line.startswith("planned gain:")]
    assert "than your static CP 2 as stock Megatron runs it" in gain[0], out
    assert "equal tokens" in gain[0] and "static CP 2 packing whole documents" in gain[1], out
    assert "than the best per-document static" in gain[2], out
    assert "tokens per step:" in out and "stock step's" in out, out


def test_plan_draws_whole_unpadded_documents_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --flexsp-harness no length is padded to 128 and --global-batch-size documents
    make a batch (the FlexSP harness padded 1001 to 1024 and took 512 sequences)."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(1001 + i) for i in range(20)) + "\n")
    argv = ["plan", *MODEL, "--lengths", str(lengths), "--global-batch-size", "8", "--json"]
    rc, out, _ = _run(argv, capsys)
    assert rc == 0
    plan = json.loads(out)
    planned = sorted(n for mb in plan["microbatches"] for g in mb["groups"] for n in g["lengths"])
    assert len(planned) == 8 and set(planned) <= set(range(1001, 1021)), planned


def test_unknown_flag_is_one_line_naming_it_and_megatron_flags_are_ignored(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ignored = ["--lr", "1e-4", "--train-iters", "10", "--use-flash-attn", "--eval-iters", "0",
               "--save", "/tmp/ckpt", "--global-batch-size", "8"]  # fmt: skip
    rc, out, err = _run(["plan", *MODEL, *ignored], capsys)
    assert rc == 0 and "est_ms" in out, err
    rc, _, err = _run(["plan", *MODEL, "--bogus-flag", "3"], capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert "--bogus-flag is neither a Megatron-LM training flag" in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--seq-length", "abc"], "--seq-length: invalid int value"),
        (["--gpus", "8"], "--gpus is a FlexSP-harness flag: add --flexsp-harness"),
        (["--max-seq", "8k"], "give your Megatron job's --seq-length"),
        (["--context-parallel-size", "3"], "not a multiple of --tensor-model-parallel-size 1"),
        (["--hsp-group-sizes", "16"], "--hsp-group-sizes 16: [16] are not legal"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1"),
    ],
)
def test_bad_job_flags_are_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = _run(["plan", *MODEL, *argv], capsys)
    assert rc == 2 and err.count("\n") == 1 and needle in err, err


@pytest.mark.spawns  # megatron-core's import runs ldconfig
def test_missing_dataset_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(["plan", *MODEL, "--data-path", "/nonexistent/corpus"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "/nonexistent/corpus.idx" in err, err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "--seq-length", "1024"], "--num-layers"),
        (["plan", "--flexsp-harness", "--num-layers", "4"], "--num-layers describes a Megatron"),
        (["plan", "--flexsp-harness", "--nnodes", "2"], "--nnodes describes a Megatron"),
        (["plan", "--flexsp-harness", "--hsp-solver", "cbc"], "--hsp-solver describes a Megatron"),
    ],
)
def test_mode_errors_are_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = _run(argv, capsys)
    assert rc == 2 and err.count("\n") == 1 and needle in err, err


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    """Every option's help in ``bench --help`` says its default, and --sampling is explained."""
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    options = text.split("\noptions:", 1)[1]
    blocks: list[str] = []
    for line in options.splitlines():
        if line.startswith("  -"):
            blocks.append(line)
        elif blocks and line.startswith("    "):
            blocks[-1] += " " + line.strip()
    blocks = [b for b in blocks if not b.strip().startswith("-h, --help")]
    assert len(blocks) > 60
    missing = [b.split()[0] for b in blocks if "default" not in b]
    assert not missing, missing
    sampling = next(b for b in blocks if b.strip().startswith("--sampling"))
    assert "training" in sampling and "sequential" in sampling


@pytest.mark.spawns
def test_a_megatron_job_plans_without_torch() -> None:
    """The planner side of a Megatron job (flags, first-principles cost model, training sampler
    over --lengths) imports neither torch nor Megatron."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from megatron_hsp.cli import main\n"
        f"assert main(['plan', *{MODEL!r}, '--global-batch-size', '8', '--lr', '1e-4']) == 0\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'))\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_headline_is_equal_tokens_against_the_stock_run_of_the_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pasted stock flags (GBS 16, --seq-length 1024, CP 2) give a planned gain against stock
    Megatron's run of those flags at equal tokens per step: every batch holds the stock step's
    16 x 1024 tokens (whole documents, the one crossing the budget starts the next step), every
    row trains them, and the report prints tokens per step (issue 43 items 1 and 2). Before, a
    batch held 16 documents (some 3k tokens) and the gain was against FlexSP-packed static-2."""
    lengths = tmp_path / "lengths.txt"
    rng = np.random.default_rng(5)
    lengths.write_text("\n".join(str(n) for n in rng.integers(40, 1000, size=400)) + "\n")
    argv = ["bench", *MODEL, "--lengths", str(lengths), "--global-batch-size", "16",
            "--context-parallel-size", "2", "--steps", "2", "--json", "-"]  # fmt: skip
    rc, out, _ = _run(argv, capsys)
    assert rc == 0
    result = json.loads(out)
    summary, job = result["summary"], result["job"]
    assert job["stock_step_tokens"] == job["token_budget"] == 16 * 1024
    tokens = summary["batches"]["tokens"]
    assert all(16 * 1024 - 1000 < t <= 16 * 1024 for t in tokens), tokens
    assert result["methods"]["megatron-static-cp2"]["tokens"] == tokens
    assert summary["comparison"]["megatron-static-cp2"] == "equal tokens"
    assert summary["speedup_vs_megatron_static_cp2"] == pytest.approx(
        summary["total_step_wall_s"]["megatron-static-cp2"] / summary["total_step_wall_s"]["hsp"]
    )
    rc, out, _ = _run(argv[:-2], capsys)
    assert rc == 0
    gains = [line for line in out.splitlines() if line.startswith("planned gain:")]
    assert "your static CP 2 as stock Megatron runs it" in gains[0], out
    assert "equal tokens" in gains[0], out
    assert any(
        line.startswith("tokens per step:") and "16384" in line for line in out.splitlines()
    ), out


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--cp-comm-type", "p2p", "a2a"], "bench prices one type for every layer"),
        (["--cp-comm-type", "a2a+p2p"], "needs --hierarchical-context-parallel-sizes"),
        (["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "4", "2"],
         "product must be --context-parallel-size 2"),
        (["--cp-comm-type", "ring"], "--cp-comm-type ring: choose one of"),
    ],
)  # fmt: skip
def test_cp_comm_type_errors_are_one_line(
    flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", *MODEL, "--global-batch-size", "8", "--context-parallel-size", "2", *flags]
    rc, _, err = _run(argv, capsys)
    assert rc == 2 and needle in err and err.count("\n") == 1, err


def test_gains_say_when_a_step_is_not_the_stock_steps_tokens() -> None:
    """A --hsp-token-budget other than --global-batch-size x --seq-length (or documents per
    step) still compares equal tokens between the rows, but not the stock step's: said."""
    from megatron_hsp.commands.megatron_args import gain_lines

    result = {
        "summary": {
            "total_step_s": {"hsp": 10.0, "megatron-static-cp4": 15.0, "static-4": 12.0},
            "tokens_per_step": {"hsp": 4000.0, "megatron-static-cp4": 4000.0},
            "comparison": {"megatron-static-cp4": "equal tokens", "static-4": "equal tokens"},
        },
        "methods": {"hsp": {"step_ms": [1.0] * 2}, "megatron-static-cp4": {}, "static-4": {}},
        "job": {"token_budget": 4096, "stock_step_tokens": 65536, "stock": {"per_document": True}},
    }
    lines = gain_lines(result, 4)
    assert lines[0].startswith("tokens per step: 4000")
    assert "NOT the stock step's 65536 tokens: --hsp-token-budget 4096" in lines[0]
    assert lines[1].startswith("planned gain: hsp 1.50x faster than your static CP 4 as stock")
    assert lines[2].startswith("planned gain: hsp 1.20x faster than static CP 4 packing")
    result["job"]["token_budget"] = None
    assert "--global-batch-size counts documents" in gain_lines(result, 4)[0]


# MODEL without its --hsp-overlong: the default is what these tests check.
DEFAULT_OVERLONG_MODEL = MODEL[: MODEL.index("--hsp-overlong")]


def test_bench_splits_documents_past_seq_length_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 42: a corpus with documents past --seq-length plans with no overlong flag; they are
    cut into --seq-length pieces (stock Megatron cuts them into --seq-length samples) and the
    start-up line says how many (the old default, error, stopped on every real corpus)."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(["500"] * 30 + ["3000"] * 3) + "\n")
    argv = ["bench", *DEFAULT_OVERLONG_MODEL, "--lengths", str(lengths),
            "--global-batch-size", "8", "--steps", "1"]  # fmt: skip
    rc, out, err = _run(argv, capsys)
    assert rc == 0, err
    assert (
        "training split: 3 of 33 documents are over 1024 tokens (--seq-length): split into "
        "1024-token pieces (--hsp-overlong split)"
    ) in err, err
    assert "planned gain: hsp" in out, out


def test_overlong_error_bound_by_seq_length_suggests_only_seq_length(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--hsp-overlong error`` still refuses, in one line that suggests only what can help:
    the limit is --seq-length, so a larger memory cap or group sizes would not (issue 42)."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(["500"] * 30 + ["3000"] * 3) + "\n")
    argv = ["bench", *DEFAULT_OVERLONG_MODEL, "--lengths", str(lengths),
            "--global-batch-size", "8", "--steps", "1", "--hsp-overlong", "error"]  # fmt: skip
    rc, _, err = _run(argv, capsys)
    assert rc == 2 and err.count("\n") == 1, err
    assert "3 documents are longer than the longest trainable length 1024" in err, err
    assert "is --seq-length; a larger --seq-length" in err, err
    assert "--hsp-memory-cap-gb" not in err and "--hsp-group-sizes" not in err, err
