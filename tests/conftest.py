"""Shared test set-up: the ``spawns`` marker that splits the fast tier from the full suite, and
the check that keeps that marker honest.

The ``exactness`` marker: the tests named in ``tests/exactness/coverage.toml`` (the checks against
an independent reference); ``make test`` runs them once, under coverage (docs/exactness.md).

Tiers: ``make test`` runs everything; ``make test-fast`` runs ``-m "not spawns and not slow"``:
the planner, cost model, evaluation, single-process runtime and flag tests, without starting a
process. A test that starts one (``subprocess``, ``multiprocessing``/``torch.multiprocessing``,
torchrun, the planner service's process, the demo's ranks) must carry ``@pytest.mark.spawns``
(``dist``, several gloo ranks, implies it); one that does so unmarked fails, naming what it
started, so the fast tier stays process-free.

Every command a test starts with ``subprocess`` from the main thread dies with the test process
(``lifetime.die_with_parent_preexec``, as ``selftest`` ties its launcher): a pytest stopped with
SIGKILL (a CI time limit) leaves no ``selftest`` or torchrun behind.

Importable helpers live in ``tests/helpers`` (``from tests.helpers.solver import toy_cost``);
``tests`` is a package, so pytest puts the repository root on ``sys.path`` and a spawned planner
process imports ``tests.helpers.planners`` the same way.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from megatron_hsp.runtime.lifetime import die_with_parent_preexec
from megatron_hsp.testing.exactness_coverage import CONFIG, MARKER, is_exactness_check, load_config
from tests.helpers import ROOT

SPAWNS = "spawns"

_running: list[pytest.Item] = []  # the test whose setup, call or teardown is running
_started: dict[str, list[str]] = {}  # unmarked test id -> what it started


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{SPAWNS}: starts processes (subprocess, multiprocessing, torchrun, the planner "
        "service); left out of `make test-fast`",
    )
    _watch_process_starts()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    checks = load_config(ROOT / CONFIG).checks
    for item in items:  # gloo ranks are processes
        if item.get_closest_marker("dist") is not None:
            item.add_marker(SPAWNS)
        # the exactness checks are named in one place, tests/exactness/coverage.toml
        if is_exactness_check(item.nodeid, checks):
            item.add_marker(MARKER)


# Helper programs a library runs once per process, whichever test happens to be first (argv
# prefixes, the program by its base name): matplotlib's font cache asks fontconfig's ``fc-list``
# for the installed fonts; megatron-core's ``package_info`` asks git for its own commit;
# ``ctypes.util.find_library`` (called while megatron-core imports) reads ``ldconfig -p``.
INCIDENTAL = (("fc-list",), ("git", "rev-parse", "--short", "HEAD"), ("ldconfig", "-p"))


def _command(args: Any) -> str:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    words = [os.path.basename(os.fsdecode(argv[0]))] if argv else []
    words += [os.fsdecode(a) if isinstance(a, (str, bytes)) else str(a) for a in argv[1:]]
    incidental = any(tuple(words[: len(prefix)]) == prefix for prefix in INCIDENTAL)
    return "" if incidental else f"subprocess {argv!r:.120}"


def _note(what: str) -> None:
    if what and _running and _running[-1].get_closest_marker(SPAWNS) is None:
        _started.setdefault(_running[-1].nodeid, []).append(what)


def _wrap(owner: Any, name: str, describe: Callable[..., str]) -> None:
    original = getattr(owner, name)
    if getattr(original, "_hsp_watched", False):
        return

    def watched(*args: Any, **kwargs: Any) -> Any:
        _note(describe(*args, **kwargs))
        return original(*args, **kwargs)

    watched._hsp_watched = True  # type: ignore[attr-defined]
    setattr(owner, name, watched)


def _tie_commands_to_the_test() -> None:
    """``subprocess.Popen`` from the main thread, with no ``preexec_fn`` of its own, gets
    ``lifetime.die_with_parent_preexec``. Only the main thread: the kernel's signal follows the
    thread that forked, and a helper thread may end before its child."""
    original = subprocess.Popen.__init__
    if getattr(original, "_hsp_tied", False):
        return
    tied = die_with_parent_preexec()

    def init(self: subprocess.Popen, *args: Any, **kwargs: Any) -> None:
        if (
            kwargs.get("preexec_fn") is None
            and threading.current_thread() is threading.main_thread()
        ):
            kwargs["preexec_fn"] = tied
        original(self, *args, **kwargs)

    init._hsp_tied = True  # type: ignore[attr-defined]
    subprocess.Popen.__init__ = init  # type: ignore[method-assign]


def _watch_process_starts() -> None:
    """Every way a test here starts a process goes through one of these."""
    _tie_commands_to_the_test()
    _wrap(subprocess.Popen, "__init__", lambda self, args, *a, **k: _command(args))
    _wrap(multiprocessing.process.BaseProcess, "start", lambda self: f"process {self.name}")
    _wrap(os, "fork", lambda: "os.fork()")
    _wrap(os, "system", lambda cmd: f"os.system({cmd!r:.120})")


def _phase(item: pytest.Item) -> Iterator[None]:
    _running.append(item)
    try:
        result = yield
    finally:
        _running.pop()
    started = _started.pop(item.nodeid, None)
    if started:
        pytest.fail(
            f"{item.nodeid} starts processes but is not marked @pytest.mark.{SPAWNS} "
            f"(make test-fast runs the unmarked tests): {'; '.join(dict.fromkeys(started))}",
            pytrace=False,
        )
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    return (yield from _phase(item))


# Hypothesis' per-example deadline (200 ms) times a property, not what it checks: on a loaded CI
# machine an example can take longer and fail as "unreliable timings". Timing targets are the
# benchmarks' (docs/), so no property test has one.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("megatron-hsp", deadline=None)
_hypothesis_settings.load_profile("megatron-hsp")
