"""Fault-injection suite (issue 40; docs/reliability.md): one file per class of fault, each case
bounded in time. In-process cases run under ``bounded`` (a SIGALRM that raises in the test, so a
hang on a regressed tree fails in seconds instead of holding CI); cases that start processes
carry ``spawns`` and bound their children with timeouts of their own."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator

import pytest

from megatron_hsp.cli import main


@contextlib.contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Fail the test (TimeoutError) when the block runs longer than ``seconds``."""

    def expired(_signum: int, _frame: object) -> None:
        raise TimeoutError(f"still running after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_cli(
    argv: list[str], capsys: pytest.CaptureFixture[str], bound_s: float = 20.0
) -> tuple[int, str, str]:
    """``megatron-hsp ARGV`` in-process under ``bounded``: (exit status, stdout, stderr)."""
    start = time.perf_counter()
    with bounded(bound_s):
        rc = main(argv)
    out = capsys.readouterr()
    assert time.perf_counter() - start < bound_s
    return rc, out.out, out.err


def one_error_line(err: str, *needles: str) -> str:
    """The command's stderr is one ``error`` line holding every needle (no traceback)."""
    lines = [
        ln
        for ln in err.strip().splitlines()
        if "warnings from imports hidden" not in ln
        and not ln.startswith(("note: ", "bench: running "))
    ]
    assert len(lines) == 1 and "error" in lines[0], err[-3000:]
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]
