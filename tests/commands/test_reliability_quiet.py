"""Issue 9 item 7, quiet output: third-party import warnings are summarised in one line.

A fresh interpreter is needed (imports are cached per process): ``plan --method megatron-dcp``
imports megatron-core, which warns about Apex/TE/absl on a CPU machine. The same helper
(``commands.common.import_warnings_summarised``) wraps demo, bench, plan and selftest.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_hsp.commands import bench, demo, plan, selftest
from tests.helpers import ROOT

ARGV = [
    "plan",
    "--flexsp-harness",
    "--method",
    "megatron-dcp",
    "--gpus",
    "8",
    "--global-batch",
    "8",
]


def _run(extra: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run(
        [sys.executable, "-m", "megatron_hsp.cli", *ARGV, "--max-seq", "16k", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.spawns
def test_import_warnings_hidden_and_counted():
    proc = _run([])
    assert proc.returncode == 0, proc.stderr
    assert "UserWarning" not in proc.stderr, proc.stderr
    summary = [ln for ln in proc.stderr.splitlines() if "warnings from imports hidden" in ln]
    assert len(summary) == 1 and summary[0].startswith("plan: "), proc.stderr
    assert "--verbose shows them" in summary[0]


@pytest.mark.spawns
def test_verbose_shows_them():
    proc = _run(["--verbose"])
    assert proc.returncode == 0, proc.stderr
    assert "UserWarning" in proc.stderr
    assert "warnings from imports hidden" not in proc.stderr


@pytest.mark.parametrize("module", [plan, bench, demo, selftest])
def test_every_command_goes_through_the_one_helper(module):
    """Each command's ``run`` wraps its work in the shared helper (no per-command copy)."""
    import inspect

    src = inspect.getsource(module.run)
    assert "import_warnings_summarised(args.verbose" in src
    assert "filterwarnings" not in inspect.getsource(module)


@pytest.mark.spawns
def test_highs_banner_never_reaches_stdout():
    """Issue 18: highspy 1.16 prints its banner from C++ to fd 1 on the first ``Highs()`` of a
    process, ahead of ``--json`` output. The lower bound (highspy directly) and the MILP (PuLP's
    HiGHS) both go through ``planner/search/highs.py``; a fresh process's stdout stays clean."""
    import subprocess
    import sys

    code = (
        "import highspy, json\n"
        "from megatron_hsp.planner.search.highs import quiet_highs\n"
        "quiet_highs(); highspy.Highs()\n"
        "print(json.dumps({'ok': True}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert out == '{"ok": true}\n', out
    bench = subprocess.run(
        [sys.executable, "-m", "megatron_hsp.cli", "bench", "--flexsp-harness", "--steps", "1",
         "--methods", "hsp,lower-bound"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    assert "Running HiGHS" not in bench and bench.startswith("bench:"), bench[:200]
