"""HiGHS without its banner: the one place the planner gets a HiGHS instance.

highspy 1.16 prints "Running HiGHS 1.16.0 ... Copyright ..." from C++ to the process's stdout
(file descriptor 1, so Python's ``redirect_stdout`` does not catch it) the first time a
``highspy.Highs`` is constructed in a process, before any ``output_flag`` option can be set. That
put two lines ahead of ``plan``/``bench``/``demo --json`` output and into training logs.
PuLP's HiGHS interface constructs one per solve as well. ``silence_banner()`` constructs the
process's first instance with fd 1 pointed at /dev/null, once; later instances print nothing.
"""

from __future__ import annotations

import functools
import os
import sys
import threading

_BANNER_LOCK = threading.Lock()


def silence_banner() -> None:
    """Construct this process's first ``highspy.Highs`` with stdout at the descriptor level
    discarded (once per process; Python's buffered output is flushed first, so none is lost).

    Locked: a solve's MILP stage runs in a thread beside the ``flexsp-style`` search's MILP
    (``concurrency``), and two threads swapping descriptor 1 at once could leave it on
    /dev/null."""
    with _BANNER_LOCK:
        _silence_banner_once()


@functools.cache
def _silence_banner_once() -> None:
    try:
        import highspy
    except ImportError:  # CBC-only installs never print it
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def quiet_highs():
    """A ``highspy.Highs`` with logging off and no banner on stdout."""
    import highspy

    silence_banner()
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    return h


def add_row(h, lb: float, ub: float, terms: list[tuple[int, float]]) -> None:
    """``lb <= sum coef * x[col] <= ub`` for ``terms`` of (column, coefficient) on ``h``."""
    import numpy as np

    h.addRow(lb, ub, len(terms), np.array([c for c, _ in terms], np.int32),
             np.array([v for _, v in terms], dtype=np.float64))  # fmt: skip
