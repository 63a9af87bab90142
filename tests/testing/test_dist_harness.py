"""``run_distributed``'s hang detection: progress moves the timeout on; silence trips it.

CI runs on a shared machine where a whole multi-part run can take twice its quiet time; the
harness must not call that a hang, and must still stop a run that really is stuck, quickly and
without leaving a rank behind.
"""

from __future__ import annotations

import time

import pytest

from megatron_hsp.testing.dist import raise_rank_errors, report_progress, run_distributed

pytestmark = pytest.mark.spawns


def _steady(rank: int, world_size: int, parts: int, part_s: float) -> int:
    """Works longer than the timeout in all, reporting after each part."""
    for _ in range(parts):
        time.sleep(part_s)
        report_progress()
    return rank


def _stuck_after(rank: int, world_size: int, parts: int, part_s: float) -> int:
    """Reports a few times, then stops reporting for good (a hang after a good start)."""
    _steady(rank, world_size, parts, part_s)
    time.sleep(3600)
    return rank


def _busy_forever(rank: int, world_size: int, part_s: float) -> int:
    """Keeps reporting and never ends: only the overall cap stops it."""
    while True:
        _steady(rank, world_size, 1, part_s)


@pytest.mark.dist
def test_progress_keeps_a_run_longer_than_its_timeout_alive():
    # 12 parts of 1 s: 12 s of work against an 8 s timeout (starting, before the harness's own
    # first report, has its own allowance: under CI load it took more than 20 s).
    start = time.monotonic()
    out = raise_rank_errors(run_distributed(_steady, 2, 12, 1.0, timeout_s=8.0))
    assert out == [0, 1]
    assert time.monotonic() - start > 12.0  # it really ran past the timeout


@pytest.mark.dist
def test_a_healthy_run_dumps_no_stacks(capfd):
    # A rank's stack dump is for a silent rank: none while it starts (imports, rendezvous) or
    # between reports. Starting once dumped every rank's stacks after 1 s (the progress timeout's
    # delay), and faulthandler reading a thread mid-import crashed a rank with SIGSEGV under load.
    out = raise_rank_errors(run_distributed(_steady, 2, 3, 0.5, timeout_s=8.0))
    assert out == [0, 1]
    err = capfd.readouterr().err
    assert "most recent call first" not in err, err[-2000:]


@pytest.mark.dist
def test_a_run_that_stops_reporting_is_stopped_after_the_timeout(capfd):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"made no progress for 8s \(likely a hang\)"):
        run_distributed(_stuck_after, 2, 2, 1.0, timeout_s=8.0)
    # Stopped at the last report + 8 s, far from the cap (the 300 s startup allowance + 32 s).
    assert time.monotonic() - start < 120
    # ... and the silent ranks printed their stacks first (4 s after their last report).
    assert "_stuck_after" in capfd.readouterr().err


@pytest.mark.dist
def test_the_overall_cap_stops_a_run_that_never_ends():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not finish within 20s"):
        run_distributed(_busy_forever, 2, 1.0, timeout_s=8.0, max_total_s=20.0)
    assert time.monotonic() - start < 120
