"""Issue 9, faults in the demo: a stopped rank is named within the stall timeout, SIGTERM to the
demo's main process stops every rank and the planner within seconds, and nothing is left behind
(processes or temp dirs). Real processes: ``megatron-hsp demo --nproc 2`` on gloo CPU ranks."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One corpus build for both tests."""
    return tmp_path_factory.mktemp("corpus")


def _start(tmp_path: Path, cache: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "megatron_hsp.cli", "demo", "--nproc", "2", "--steps", "400"]
    cmd += ["--compare-steps", "0", "--cache-dir", str(cache), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rank_pids(tmp_path: Path, proc: subprocess.Popen, timeout_s: float = 180) -> list[int]:
    """Wait until both ranks beat and the first step has trained; return their pids."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        beats = sorted(tmp_path.glob("hsp_demo_*/rank*.pkl.hb"))
        if len(beats) == 2 and all(b.read_text().strip() for b in beats):
            time.sleep(8)  # past start-up: the ranks are training
            return [int(b.read_text()) for b in beats]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    proc.kill()
    pytest.fail("demo ranks never started")


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def _assert_clean(tmp_path: Path, pids: list[int]) -> None:
    end = time.monotonic() + 10
    while time.monotonic() < end and not all(_gone(p) for p in pids):
        time.sleep(0.2)
    assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]
    assert not list(tmp_path.glob("hsp_demo_*")), "temp dir left behind"


@pytest.mark.spawns
@pytest.mark.dist
def test_stopped_rank_is_named_within_the_stall_timeout(tmp_path, cache):
    proc = _start(tmp_path, cache, "--stall-timeout", "5")
    pids = _rank_pids(tmp_path, proc)
    planner = _children(pids[0])
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        os.kill(pids[1], signal.SIGCONT) if not _gone(pids[1]) else None
    took = time.monotonic() - t0
    assert proc.returncode == 2 and "demo rank 1 stalled" in err, err[-2000:]
    assert took < 5 + 15, took
    _assert_clean(tmp_path, pids + planner)


@pytest.mark.spawns
@pytest.mark.dist
def test_sigterm_to_the_demo_stops_every_rank_and_the_planner(tmp_path, cache):
    proc = _start(tmp_path, cache)
    pids = _rank_pids(tmp_path, proc)
    planner = _children(pids[0])
    assert planner, "rank 0 should run the planner process"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 15
    assert proc.returncode == 130 and "interrupted" in err, err[-2000:]
    # quiet output: Megatron's import-time warnings are summarised in one line, not printed
    assert "UserWarning" not in err and "--verbose shows them" in err, err[-2000:]
    _assert_clean(tmp_path, pids + planner)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


@pytest.mark.spawns
@pytest.mark.dist
def test_sigkill_of_the_demo_leaves_no_rank_or_planner(tmp_path, cache):
    """Issue 18: SIGKILL of the demo's main process (no cleanup runs) left its ranks and the
    planner training; every child now dies with its parent (``runtime/lifetime.py``)."""
    proc = _start(tmp_path, cache)
    ranks = _rank_pids(tmp_path, proc)
    everyone = _descendants(proc.pid)
    assert set(ranks) <= set(everyone) and len(everyone) > len(ranks), everyone
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    end = time.monotonic() + 20
    while time.monotonic() < end and not all(_gone(p) for p in everyone):
        time.sleep(0.2)
    assert all(_gone(p) for p in everyone), [p for p in everyone if not _gone(p)]


@pytest.mark.spawns
def test_stopping_ranks_that_never_started_is_quiet():
    """A SIGINT/SIGTERM while the demo starts its ranks stops the started ones; the rest were
    never started and are skipped (it raised "can only join a started process")."""
    import multiprocessing as mp

    from megatron_hsp.commands.demo_ranks import _stop

    ctx = mp.get_context("spawn")
    started = ctx.Process(target=time.sleep, args=(30,))
    started.start()
    never = ctx.Process(target=time.sleep, args=(30,))
    _stop([started, never])
    assert not started.is_alive() and never.pid is None


@pytest.mark.spawns
@pytest.mark.dist
def test_a_killed_rank_or_planner_is_one_line_not_a_traceback(tmp_path, cache):
    """Issue 18: a dead rank or planner in the demo printed a traceback."""
    proc = _start(tmp_path, cache)
    pids = _rank_pids(tmp_path, proc)
    os.kill(pids[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err[-2000:]
    assert "demo rank 1 was killed by signal 9 (SIGKILL)" in err and "Traceback" not in err, err
    # A second short TMPDIR: the fork server's socket path must stay under AF_UNIX's limit.
    planner_run = Path(tempfile.mkdtemp(prefix="hspk"))
    proc = _start(planner_run, cache)
    pids = _rank_pids(planner_run, proc)
    old = _children(pids[0])  # rank 0's planner process
    for child in old:
        os.kill(child, signal.SIGKILL)
    # Issue 40: a dead planner is no reason to stop: its step trains on the fallback plan and
    # rank 0 starts a fresh planner, while the demo trains on.
    end = time.monotonic() + 90
    while time.monotonic() < end and not set(_children(pids[0])) - set(old):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.5)
    assert set(_children(pids[0])) - set(old), "no fresh planner was started"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    shutil.rmtree(planner_run, ignore_errors=True)
