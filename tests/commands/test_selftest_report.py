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


def test_run_times_from_its_start_and_marks_a_pass_for_the_logs(monkeypatch):
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
    assert before <= seen["started"] <= time.monotonic()
    import os

    assert not os.path.exists(seen["logs"])
