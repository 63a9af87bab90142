"""One piece of a solve in a thread beside the rest: for work that leaves the GIL.

HiGHS solves a MILP in C++ with the GIL released, so ``solve`` runs its MILP stage in a thread
while it scores the baselines in Python. Nothing here decides anything: every MILP is
node-limited on one HiGHS thread with a fixed seed and each search is limited by counts, so a
solve returns the same plan with ``SolverConfig.workers`` 1 (everything in turn, in the calling
thread) or 2; only the wall clock differs (``plan.extra["cpu_ms"]``, the process's CPU time
over all threads, stands beside ``solve_ms``). Two Python searches in two threads gain nothing
(they share the GIL) and cost CPU in switching: measured, docs/solver.md.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class Beside[R]:
    """``fn()`` started now in its own thread where ``workers`` > 1, else run when asked for.

    ``result()`` waits for it and returns its value or raises its exception; ``close()`` waits
    for the thread without asking, so that none outlives the solve that started it, whatever
    the caller raised meanwhile.
    """

    def __init__(self, fn: Callable[[], R], workers: int) -> None:
        self._fn = fn
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future[R] | None = None
        if workers > 1:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hsp-solve")
            self._future = self._pool.submit(fn)

    def result(self) -> R:
        if self._future is None:
            return self._fn()
        try:
            return self._future.result()
        finally:
            self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
