"""The ``spawns`` marker is honest: an unmarked test that starts a process fails, naming it, so
``make test-fast`` (``-m "not spawns and not slow"``) never starts one; marked tests and tests that
start nothing pass. Runs tests/conftest.py on planted tests in a fresh pytest."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
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


ORPHAN = """
import subprocess
import sys
import pytest


@pytest.mark.spawns
def test_starts_a_long_command(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    (tmp_path.parent / "child.pid").write_text(str(child.pid))
    child.wait()
"""


@pytest.mark.spawns
def test_a_command_a_test_started_dies_with_a_killed_pytest(tmp_path: Path) -> None:
    """A pytest stopped with SIGKILL (a CI time limit) runs no cleanup: the commands its tests
    started die with it (tests/conftest.py ties them), none is left running."""
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_orphan.py").write_text(ORPHAN)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    cmd += ["-o", "markers=dist: gloo ranks", "--basetemp", str(tmp_path / "base"), str(tmp_path)]
    pytest_run = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL)
    pid_file = tmp_path / "base" / "child.pid"
    deadline = time.monotonic() + 120
    while not pid_file.exists() or not pid_file.read_text():
        assert pytest_run.poll() is None and time.monotonic() < deadline, "the test never started"
        time.sleep(0.2)
    child = int(pid_file.read_text())
    pytest_run.kill()
    pytest_run.wait()
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = _alive(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the command the killed pytest's test started is still running"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
