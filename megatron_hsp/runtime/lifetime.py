"""Child processes die with their parent: no rank or planner outlives the command that started it.

A process killed with SIGKILL runs no cleanup, so its children (demo ranks, the background
planner, test ranks) kept training. ``die_with_parent`` is called first thing in every
child HSP starts:

* Linux ``prctl(PR_SET_PDEATHSIG, SIGTERM)``: the kernel signals the child when its parent
  exits, however it exits (the child's SIGTERM handler unwinds: planner closed, temp files
  removed);
* a daemon watchdog thread that polls ``getppid()`` every second, for platforms without prctl
  and for a child blocked in a C call (a gloo collective) whose Python signal handler cannot
  run: once the parent is gone it sends SIGTERM itself and, ``grace_s`` later, exits hard.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

_PR_SET_PDEATHSIG = 1


def die_with_parent(
    grace_s: float = 10.0,
    poll_s: float = 1.0,
    watchdog: bool = True,
    parent: int | None = None,
) -> None:
    """Tie this process's life to its parent (module docstring).

    ``parent``: the pid of the process that started this one, when the caller knows it. A child
    that gets here only after its parent died (a spawned rank still importing torch when the
    command was stopped) has been re-parented already, and ``getppid()`` would name the new
    parent: it then exits at once instead of watching the wrong process (ranks
    outlived a stopped ``profile``). ``watchdog=False`` for a process that must stay
    single-threaded (a multiprocessing fork server: forking a multi-threaded process can
    deadlock the child); prctl alone then.
    """
    if parent is not None and os.getppid() != parent:
        os._exit(1)
    parent = os.getppid() if parent is None else parent
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the watchdog alone
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    if not watchdog:
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="hsp-die-with-parent", daemon=True).start()


__all__ = ["die_with_parent"]
