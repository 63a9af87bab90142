"""``selftest``'s closing line (issue 42): the command's wall time, not the first suite's, and
the torch / megatron-core that ran; the ranks' logs of a passing run removed."""

from __future__ import annotations

import argparse
import time

from megatron_hsp.commands import selftest


def test_the_duration_is_the_commands_wall_time(monkeypatch):
    """ "in 46.0 s" was printed for a 4 min 41 s command: only the first suite was timed."""
    now = time.monotonic()
    monkeypatch.setattr(selftest.time, "monotonic", lambda: now + 281.0)
    assert selftest._wall(now, 46.0) == "4 min 41 s"
    assert selftest._wall(now + 280.0, 46.0) == "1.0 s"


def test_run_times_from_the_process_start_and_marks_a_pass_for_the_logs(monkeypatch):
    seen = {}

    def fake_run(args, started):
        import os

        from megatron_hsp.testing.dist import RANK_LOG_DIR_ENV

        seen["started"] = started
        seen["logs"] = os.environ[RANK_LOG_DIR_ENV]
        with open(os.path.join(seen["logs"], "rank0.log"), "w") as fh:
            fh.write("x\n" * 10)
        return 0

    monkeypatch.setattr(selftest, "_run", fake_run)
    before = time.monotonic()
    assert selftest.run(argparse.Namespace(verbose=False)) == 0
    assert seen["started"] <= before
    import os

    assert not os.path.exists(seen["logs"])


def test_the_clock_starts_with_the_process():
    """Interpreter start-up and torch's import are part of the wait: the start is the process's,
    which is no later than now and (this test process) no earlier than its start."""
    import os

    started = selftest._process_started()
    now = time.monotonic()
    assert started <= now
    if os.path.exists("/proc/self/stat"):
        # This pytest process started seconds to minutes ago, not now.
        assert now - started > 0.5
