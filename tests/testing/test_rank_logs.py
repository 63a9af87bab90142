"""``testing/dist.rank_output_logged``: the ranks' logs of a passing command are removed, a
failing command's are kept and named (issue 42: a passing ``selftest --megatron`` left ~36,000
lines of rank logs in /tmp)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_hsp.testing.dist import RANK_LOG_DIR_ENV, rank_output_logged


def _write_rank_log(lines: int) -> Path:
    import os

    directory = Path(os.environ[RANK_LOG_DIR_ENV])
    (directory / "rank0.log").write_text("".join(f"line {i}\n" for i in range(lines)))
    return directory


def test_a_passing_commands_logs_are_removed(capsys):
    with rank_output_logged(verbose=False, command="selftest") as logs:
        directory = _write_rank_log(100)
        logs.passed = True
    assert not directory.exists()
    assert "rank" not in capsys.readouterr().err


def test_a_failing_commands_logs_are_kept_and_named(capsys):
    with rank_output_logged(verbose=False, command="selftest"):
        directory = _write_rank_log(100)
    try:
        err = capsys.readouterr().err
        assert f"the ranks' output (100 lines) is kept in {directory}/rank*.log" in err
        assert (directory / "rank0.log").is_file()
    finally:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)


def test_an_exception_keeps_the_logs(capsys):
    with pytest.raises(RuntimeError), rank_output_logged(False, "selftest") as logs:
        directory = _write_rank_log(3)
        assert logs.directory == str(directory)
        raise RuntimeError("a rank failed")
    try:
        assert "is kept in" in capsys.readouterr().err
    finally:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
