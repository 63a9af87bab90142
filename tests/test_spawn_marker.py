"""The ``spawns`` marker is honest: an unmarked test that starts a process fails, naming it, so
``make test-fast`` (``-m "not spawns and not slow"``) never starts one; marked tests and tests that
start nothing pass. Runs tests/conftest.py on planted tests in a fresh pytest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

PLANTED = """
import multiprocessing
import subprocess
import sys

import pytest


def test_unmarked_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unmarked_process():
    p = multiprocessing.get_context("fork").Process(target=print)
    p.start()
    p.join()


@pytest.mark.spawns
def test_marked_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.dist
def test_dist_implies_spawns():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_starts_nothing():
    assert sum(range(4)) == 6
"""


@pytest.mark.spawns
def test_unmarked_process_starts_fail_and_the_fast_tier_deselects_marked_ones(
    tmp_path: Path,
) -> None:
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_planted.py").write_text(PLANTED)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    cmd += ["-o", "markers=dist: gloo ranks", "-rf", str(tmp_path)]
    # the copied conftest imports ``tests.helpers`` as it does in the repository: the subprocess
    # runs from tmp_path, so the repository goes on its path (CI sets no PYTHONPATH of its own)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    full = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    out = full.stdout + full.stderr
    assert "2 failed, 3 passed" in out, out
    assert "test_unmarked_subprocess starts processes but is not marked" in out, out
    assert "test_unmarked_process starts processes but is not marked" in out, out
    fast = subprocess.run(
        [*cmd, "-m", "not spawns and not slow"], capture_output=True, text=True, cwd=tmp_path,
        timeout=300, env=env,
    )  # fmt: skip
    assert "2 failed, 1 passed, 2 deselected" in fast.stdout, fast.stdout + fast.stderr
