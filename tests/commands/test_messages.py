"""Messages a new Megatron user meets (issue 32): each names the cause and the fix in one line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_hsp.planner.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
NO_TORCH = "import sys; sys.modules['torch'] = None; "


def run_python(code: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


@pytest.mark.spawns
def test_selftest_without_torch_is_one_line():
    """It was a traceback (ImportError from the selftest modules)."""
    code = NO_TORCH + "from megatron_hsp.cli import main; sys.exit(main(sys.argv[1:]))"
    run = run_python(code, "selftest", "--nproc", "4")
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith("megatron-hsp selftest: error: torch does not import here")
    assert "megatron-hsp[runtime]" in line


@pytest.mark.spawns
def test_the_launcher_without_torch_says_torch_is_missing(tmp_path):
    """It said to run from a Megatron-LM checkout, which the user was in."""
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("raise SystemExit('must not run')\n")
    code = NO_TORCH + "from megatron_hsp.launch import main; sys.exit(main(sys.argv[1:]))"
    run = run_python(code, str(script), "--hsp")
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and "checkout" not in run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert "torch does not import here" in line and "megatron-hsp[runtime]" in line


def test_lengths_given_a_bin_file_names_the_prefix(tmp_path):
    """``--lengths X.bin`` was a UTF-8 decode error."""
    from megatron_hsp.planner.lengths import read_lengths
    from megatron_hsp.step.corpus import write_indexed_dataset

    write_indexed_dataset(tmp_path / "docs", [np.arange(300) % 200, np.arange(5)])
    with pytest.raises(InputError) as err:
        read_lengths(tmp_path / "docs.bin")
    assert f"pass its prefix '{tmp_path / 'docs'}'" in str(err.value)
    assert list(read_lengths(tmp_path / "docs")) == [300, 5]  # the prefix works


def test_docs_name_the_megatron_loops_option_sets_as_the_loop_has_them():
    """Docs said eight (and the JSON held fourteen)."""
    from megatron_hsp.testing.megatron_loop import DEFAULT_OPTIONS

    words = "zero one two three four five six seven eight nine ten eleven twelve thirteen"
    words += " fourteen fifteen sixteen seventeen eighteen nineteen twenty"
    number = {w: i for i, w in enumerate(words.split())}
    said = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"\b(\w+) option sets\b", doc.read_text(), flags=re.IGNORECASE):
            word = m.group(1).lower()
            if word.isdigit() or word in number:
                said.append((doc.name, int(word) if word.isdigit() else number[word]))
    assert said, "no doc states the count"
    assert {n for _, n in said} == {len(DEFAULT_OPTIONS)}, said


@pytest.mark.slow
@pytest.mark.dist
def test_selftest_puts_the_ranks_output_in_a_log_and_says_where(tmp_path, capfd):
    """``selftest --megatron`` wrote ~38,600 lines of the ranks' Megatron logs to stderr."""
    from megatron_hsp.testing.dist import rank_output_logged, run_distributed

    with rank_output_logged(verbose=False, command="selftest"):
        run_distributed(_chatty_rank, 2, timeout_s=120)
    err = capfd.readouterr().err
    assert "rank 0 line 99" not in err
    (line,) = [x for x in err.splitlines() if "the ranks' output" in x]
    directory = line.split(" is kept in ")[1].split("/rank*.log")[0]
    logs = sorted(Path(directory).glob("rank*.log"))
    assert [p.name for p in logs] == ["rank0.log", "rank1.log"]
    assert "rank 1 line 99" in logs[1].read_text()
    with rank_output_logged(verbose=True, command="selftest"):
        run_distributed(_chatty_rank, 2, timeout_s=120)
    assert "rank 0 line 99" in capfd.readouterr().err  # --verbose: as before


def _chatty_rank(rank: int, world_size: int) -> None:
    for i in range(100):
        print(f"rank {rank} line {i}", file=sys.stderr, flush=True)
