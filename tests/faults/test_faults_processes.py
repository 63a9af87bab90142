"""Class 4: processes. A command that starts processes owns their tree: its timeout holds when
a child is stopped (SIGSTOP) or wedged; at the end every child and grandchild is continued and
killed; no process outlives the command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_hsp.runtime.lifetime import alive, descendants, stop_tree
from tests.faults.conftest import bounded

pytestmark = pytest.mark.spawns


def _wait_for(path: Path, timeout_s: float = 300.0) -> int:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.2)
    raise AssertionError(f"{path} never written")


def busy_rank(rank: int, world_size: int, folder: str) -> int:
    """A rank that keeps reporting progress for 2 minutes; rank 1 also starts a grandchild."""
    from megatron_hsp.testing.dist import report_progress

    if rank == 1:
        child = subprocess.Popen(["sleep", "300"])
        Path(folder, "grandchild").write_text(str(child.pid))
        Path(folder, "rank1").write_text(str(os.getpid()))
    for _ in range(240):
        report_progress()
        time.sleep(0.5)
    return rank


@pytest.mark.dist
def test_a_stopped_rank_ends_the_run_within_its_timeout_and_nothing_survives(tmp_path):
    """Before: a SIGSTOPped selftest rank kept ``selftest --timeout 20`` running past 90 s
    (the other ranks kept reporting; the stopped one was never killed)."""
    from megatron_hsp.testing.dist import run_distributed

    stopped_at: list[float] = [0.0]

    def stop_rank_1() -> None:
        pid = _wait_for(tmp_path / "rank1")
        os.kill(pid, signal.SIGSTOP)
        stopped_at[0] = time.monotonic()

    stopper = threading.Thread(target=stop_rank_1, daemon=True)
    stopper.start()
    t0 = time.monotonic()
    with bounded(400), pytest.raises(TimeoutError) as err:
        run_distributed(busy_rank, 2, str(tmp_path), timeout_s=10.0)
    took = time.monotonic() - (stopped_at[0] or t0)
    assert "stalled: rank 1" in str(err.value), str(err.value)[:500]
    rank1, grandchild = _wait_for(tmp_path / "rank1"), _wait_for(tmp_path / "grandchild")
    assert not alive(rank1) and not alive(grandchild)
    # The heartbeat bound (MIN_STALL_S, 30 s) plus the tree's 5 s grace, on a loaded host.
    assert took < 90, took


@pytest.mark.dist
def test_a_rank_stopped_while_it_starts_ends_the_run_without_the_startup_allowance(tmp_path):
    """Stopped before its heartbeat starts (still importing), a rank was bounded only by the
    300 s start-up allowance; it is now seen stopped in /proc."""
    from megatron_hsp.testing.dist import MIN_STALL_S, run_distributed

    caught: list[int] = []
    stopped_at: list[float] = []

    def stop_first_rank() -> None:
        end = time.monotonic() + 120
        while time.monotonic() < end and not caught:
            for pid in descendants(os.getpid()):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"spawn_main" in cmd:
                    os.kill(pid, signal.SIGSTOP)
                    caught.append(pid)
                    stopped_at.append(time.monotonic())
                    return
            time.sleep(0.05)

    threading.Thread(target=stop_first_rank, daemon=True).start()
    with bounded(400), pytest.raises(TimeoutError) as err:
        run_distributed(busy_rank, 2, str(tmp_path), timeout_s=10.0)
    assert caught and "stalled" in str(err.value), str(err.value)[:500]
    assert time.monotonic() - stopped_at[0] < MIN_STALL_S + 60
    assert not alive(caught[0])


def test_stop_tree_ends_a_stopped_process_and_its_stopped_child():
    code = "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        end = time.monotonic() + 30
        while not descendants(parent.pid) and time.monotonic() < end:
            time.sleep(0.1)
        (child,) = descendants(parent.pid)
        for pid in (child, parent.pid):
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with bounded(20):
            stop_tree([parent.pid], grace_s=2.0)
            parent.wait(10)
        assert time.monotonic() - t0 < 15
        assert not alive(child) and not alive(parent.pid)
    finally:
        if parent.poll() is None:
            parent.kill()


@pytest.mark.dist
def test_sigterm_to_the_demo_with_a_stopped_planner_leaves_nothing(tmp_path):
    """Before: a SIGSTOPped demo planner was still there (stopped) 15 s after the demo ended on
    SIGTERM, with two more processes."""
    from tests.commands.test_reliability_demo import _children, _gone, _rank_pids, _start

    cache = tmp_path / "cache"
    cache.mkdir()
    proc = _start(tmp_path, cache)
    try:
        ranks = _rank_pids(tmp_path, proc)
        everyone: list[int] = []
        for pid in [proc.pid]:
            everyone += descendants(pid)
        planner = _children(ranks[0])
        assert planner, "rank 0 runs the planner"
        for pid in planner:
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        assert time.monotonic() - t0 < 15
        end = time.monotonic() + 15
        while time.monotonic() < end and not all(_gone(p) for p in everyone):
            time.sleep(0.2)
        assert all(_gone(p) for p in everyone), [p for p in everyone if not _gone(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
