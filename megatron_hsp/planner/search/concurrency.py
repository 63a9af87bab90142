"""Pieces of a solve in a helper thread beside the rest: for work that leaves the GIL.

HiGHS solves a MILP in C++ with the GIL released, so ``solve`` hands its MILPs to one helper
thread while the calling thread goes on in Python: the ``flexsp-style`` search's MILP beside
hsp's own search, hsp's MILP beside the homogeneous layouts' scoring. Nothing here decides
anything: every MILP is node-limited on one HiGHS thread with a fixed seed and each search is
limited by counts, so a solve returns the same plan with ``SolverConfig.workers`` 1 (everything
in turn, in the calling thread) or 2; only the wall clock differs (``plan.extra["cpu_ms"]``, the
process's CPU time over all threads, stands beside ``solve_ms``). Two Python searches in two
threads gain nothing (they share the GIL) and cost CPU in switching: measured, docs/solver.md.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType


class Helper:
    """One solve's helper thread (``workers`` > 1), or none: a context manager whose exit waits
    for the thread, so that none outlives the solve that started it, whatever it raised."""

    def __init__(self, workers: int) -> None:
        self._pool: ThreadPoolExecutor | None = None
        if workers > 1:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hsp-solve")

    def beside[R](self, fn: Callable[[], R]) -> Beside[R]:
        """``fn()`` queued on the helper thread now, or (no thread) run when its result is asked
        for."""
        return Beside(fn, None if self._pool is None else self._pool.submit(fn))

    def __enter__(self) -> Helper:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class Beside[R]:
    """A piece handed to ``Helper.beside``: ``result()`` waits for it and returns its value or
    raises its exception; ``close()`` drops it unstarted or waits for it, without asking."""

    def __init__(self, fn: Callable[[], R], future: Future[R] | None) -> None:
        self._fn = fn
        self._future = future

    def result(self) -> R:
        if self._future is None:
            return self._fn()
        return self._future.result()

    def close(self) -> None:
        if self._future is not None and not self._future.cancel():
            concurrent.futures.wait([self._future])


def finish[R](steps: Generator[None, None, R]) -> R:
    """Run the rest of a staged computation (a generator that yields where it has handed work
    to the helper and the caller may do other work meanwhile) and return its value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
