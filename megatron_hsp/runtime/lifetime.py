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

import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable

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


def die_with_parent_preexec() -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess`` that ties the command to this process (prctl only).

    libc is loaded here, in the parent: the forked child of a threaded process (torch's pools,
    gloo) must not ``dlopen``, whose loader lock another thread may have held at the fork; it
    runs the one ``prctl`` call, then exits at once if this process is already gone."""
    parent = os.getpid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: nothing to set
        prctl = None

    def tie() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return tie


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid`` from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # the name may hold spaces and parentheses
    return fields[0], int(fields[1])


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), read from /proc; [] elsewhere."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                children.setdefault(st[1], []).append(int(name))
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def stopped(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP) or a tracer: it runs no code until continued."""
    st = _stat(pid)
    return st is not None and st[0] in ("T", "t")


def alive(pid: int) -> bool:
    """Running or stopped, not a zombie (a zombie has exited: only its parent's wait remains)."""
    st = _stat(pid)
    if st is None:
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return not os.path.exists("/proc")  # no /proc (not Linux): assume alive
    return st[0] not in ("Z", "X")


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def stop_tree(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """Stop ``pids`` and every process below them, whatever state they are in.

    Why: a stopped (SIGSTOP) or wedged child ignores SIGTERM until continued, and its own
    children (a rank's planner) outlive it when it is SIGKILLed: the command then either waits
    on it for ever (multiprocessing joins its children at exit) or leaves it behind. The whole
    tree is read first (children are re-parented once their parent dies), every process is
    continued (SIGCONT) and sent SIGTERM so that it can clean up, and whatever is alive after
    ``grace_s`` (the tree read again) is SIGKILLed, which acts on stopped processes too.
    Returns the pids that were SIGKILLed.
    """
    tree: list[int] = []
    for pid in pids:
        if pid and pid not in tree:
            tree += [pid, *(d for d in descendants(pid) if d not in tree)]
    for pid in tree:
        _signal(pid, signal.SIGCONT)
        _signal(pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(alive(p) for p in tree):
        time.sleep(0.05)
    left = [p for p in tree if alive(p)]
    for pid in list(left):
        left += [d for d in descendants(pid) if d not in left]
    for pid in left:
        _signal(pid, signal.SIGKILL)
    end = time.monotonic() + 5.0
    while time.monotonic() < end and any(alive(p) for p in left):
        time.sleep(0.05)
    return left


def start_heartbeat(path: str, every_s: float = 1.0) -> None:
    """Touch ``path`` every ``every_s`` from a daemon thread (its mtime is the beat).

    Why a thread: a process waiting in a collective for a slow peer still beats (gloo and torch
    release the GIL), while a stopped or wedged process does not, so its parent can tell a
    stopped child from a slow one and name it (``testing/dist.py``).
    """

    def beat() -> None:
        while True:
            try:
                with open(path, "a"):
                    pass
                os.utime(path)
            except OSError:
                return  # the parent removed the folder: it is done with us
            time.sleep(every_s)

    threading.Thread(target=beat, name="hsp-heartbeat", daemon=True).start()


__all__ = ["alive", "descendants", "die_with_parent", "start_heartbeat", "stop_tree", "stopped"]
